"""What a tuning trial of the attention backward measures: shapes for a bucket, inputs, launch, check, cost."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tilegen.families import base
from tilegen.families.attention_bwd.config import Config
from tilegen.families.attention_bwd.reference import attention_backward_reference
from tilegen.families.attention_bwd.spec import AttentionBwdSpec
from tilegen.families.attention_fwd.masks import launch_window
from tilegen.families.attention_fwd import problem as forward
from tilegen.families.attention_fwd.problem import attention_flops
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.mods.blocks import backward_tables
from tilegen.mods.grad import grad_tensors
from tilegen.triton_internals.launch import Launcher

__all__ = ["Problem", "BACKWARD_FLOPS"]

#: A backward does 2.5 times the forward's matmul FLOPs (five products against two), the convention
#: FlashAttention's papers and benchmarks count by.
BACKWARD_FLOPS = 2.5
_CPU_MAX_SEQ = 48


@dataclass(frozen=True)
class Problem(forward.Problem):
    """The backward of the forward family's self-attention problem (its shapes, mask bounds, softcap and
    scale). Inputs are Q, K, V, the output gradient and the forward's O and LSE (computed by the
    reference, so the backward is checked against the attention it differentiates); dense layout."""

    spec: AttentionBwdSpec

    @classmethod
    def for_bucket(cls, spec: AttentionBwdSpec, bucket: int, *, on_gpu: bool, batch: int | None = None,
                   heads_q: int | None = None) -> Problem:
        if spec.layout != "dense":
            raise NotImplementedError(f"layout={spec.layout!r}: the tuner measures the dense backward; a ragged "
                                      "call is served the dense spec's tuned rows where its kernels run them")
        shape = super().for_bucket(spec, bucket, on_gpu=on_gpu, batch=batch, heads_q=heads_q)
        # Odd under the interpreter: no block divides it.
        seq = shape.seq if on_gpu else max(1, min(bucket, _CPU_MAX_SEQ) - 1)
        return cls(spec, shape.batch, shape.heads_kv, seq, on_gpu, shape.mods)

    def _mask_args(self) -> dict:
        left, right = self.bounds
        return {"causal": self.spec.mask == "causal", "window": None if self.spec.mask != "window" else (left, right),
                "softcap": self.softcap, "scale": self.scale}

    def inputs(self, seed: int):
        device = "cuda" if self.on_gpu else "cpu"
        gen = torch.Generator(device).manual_seed(seed)
        dtype = self.torch_dtype()
        d, dv = self.spec.head_dim, self.spec.dv
        q = torch.randn((self.batch, self.heads_q, self.seq, d), generator=gen, device=device, dtype=dtype)
        k = torch.randn((self.batch, self.heads_kv, self.seq, d), generator=gen, device=device, dtype=dtype)
        v = torch.randn((self.batch, self.heads_kv, self.seq, dv), generator=gen, device=device, dtype=dtype)
        dout = torch.randn((self.batch, self.heads_q, self.seq, dv), generator=gen, device=device, dtype=dtype)
        out = torch.empty_like(dout)
        lse = torch.empty((self.batch, self.heads_q, self.seq), device=device)
        g = self.spec.q_per_kv
        compute = torch.float32 if self.on_gpu else torch.float64
        mods = self._mods(device)
        # One KV group at a time: the reference holds that group's scores. A mod sees the group's own batch and
        # head indices through _shifted.
        for b in range(self.batch):
            for h in range(self.heads_kv):
                o, l = attention_reference(q[b:b + 1, h * g:(h + 1) * g], k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1],
                                           compute_dtype=compute, **self._mask_args(), **_shifted(mods, b, h * g))
                out[b, h * g:(h + 1) * g] = o[0].to(dtype)
                lse[b, h * g:(h + 1) * g] = l[0].float()
        return (q, k, v, out, dout, lse) if mods is None else (q, k, v, out, dout, lse, mods)

    def placeholder_inputs(self):
        if self.mods != (None, None):
            return self.inputs(0)  # the mods' tensors and the forward's output need values (compile-ahead: real ones)
        device = "cuda" if self.on_gpu else "cpu"
        dtype = self.torch_dtype()
        d, dv = self.spec.head_dim, self.spec.dv
        shapes = ((self.heads_q, d), (self.heads_kv, d), (self.heads_kv, dv), (self.heads_q, dv), (self.heads_q, dv))
        q, k, v, out, dout = (torch.empty((self.batch, h, self.seq, x), device=device, dtype=dtype) for h, x in shapes)
        return q, k, v, out, dout, torch.empty((self.batch, self.heads_q, self.seq), device=device)

    def outputs(self, inputs):
        q, k, v, _, _, lse = inputs[:6]
        poison = [torch.full_like(t, math.nan) for t in (q, k, v)]
        scratch = torch.empty_like(lse), torch.empty_like(lse), torch.empty_like(q, dtype=torch.float32)
        return (*poison, *scratch)

    def launch(self, launcher: Launcher, config: Config, inputs, outputs) -> None:
        q, k, v, out, dout, lse, *mods = inputs
        dq, dk, dv, delta, lse2, dq_acc = outputs
        left, right = launch_window(self.spec.mask, *self.bounds, self.seq, self.seq)
        extra = {}
        if mods:
            # Timed without gradients into captured tensors (fixed ALiBi slopes, document ids): a learned table's
            # atomics are a variant of the kernel this trial does not compile.
            extra["mod_tensors"] = mods[0].tensors
            extra["mod_grads"] = [None] * len(grad_tensors(self.spec.score_mod))
            if mods[0].mask_mod is not None:
                extra.update(backward_tables(mods[0].mask_text, mods[0].mask_tensors, self.batch, self.heads_q,
                                             self.seq, self.seq, config, q.device))
        launcher.launch(q, k, v, out, dout, lse, None, dq, dk, dv, delta, lse2, dq_acc, None, None, self.seq, self.seq,
                        scale=self.scale, softcap=self.softcap or 0.0, window_left=left, window_right=right,
                        **extra, **config.to_dict())

    def check(self, inputs, outputs) -> tuple[float, float]:
        """Every gradient element must be written (no NaN anywhere); the values of batch 0's first KV group and
        of the last batch's last KV group against the reference: a kernel that offsets a batch or a head wrongly
        writes finite values there."""
        q, k, v, _, dout, _, *mods = inputs
        got = outputs[:3]
        if any(torch.isnan(t).any() for t in got):
            return math.inf, math.inf
        g = self.spec.q_per_kv
        compute = torch.float32 if q.is_cuda else torch.float64
        errors = []
        for b, h in dict.fromkeys(((0, 0), (q.shape[0] - 1, k.shape[1] - 1))):
            heads = (slice(h * g, (h + 1) * g), slice(h, h + 1), slice(h, h + 1))
            if mods:
                # The derivation written out knows no mods: autograd of the forward reference through them.
                leaves = [t[b:b + 1, s].to(compute).requires_grad_() for t, s in zip((q, k, v), heads)]
                o, _ = attention_reference(*leaves, compute_dtype=compute, **self._mask_args(),
                                           **_shifted(mods[0], b, h * g))
                refs = torch.autograd.grad(o, leaves, dout[b:b + 1, heads[0]].to(compute))
            else:
                refs = attention_backward_reference(*(t[b:b + 1, s] for t, s in zip((q, k, v), heads)),
                                                    dout[b:b + 1, heads[0]], compute_dtype=compute, **self._mask_args())
            errors += [base.relative_error(t[b:b + 1, s], r) for t, s, r in zip(got, heads, refs)]
        return max(e[0] for e in errors), max(e[1] for e in errors)

    def flops(self) -> float:
        return BACKWARD_FLOPS * attention_flops(self.spec, self.batch, self.heads_q, self.seq, self.seq, *self.bounds)

    def bytes_moved(self) -> float:
        """Q, K, V, O and dO read once, dQ, dK and dV written once."""
        elt = self.torch_dtype().itemsize
        d, dv = self.spec.head_dim, self.spec.dv
        rows_q, rows_kv = self.batch * self.seq * self.heads_q, self.batch * self.seq * self.heads_kv
        return float((rows_q * (2 * d + 2 * dv) + rows_kv * 2 * (d + dv)) * elt)


def _shifted(mods, b: int, h: int) -> dict:
    """The reference's ``score_mod``/``mask_mod`` for a slice of the problem that starts at batch ``b`` and query
    head ``h``: the mods see the indices of the whole problem, as the kernel's do."""
    if mods is None:
        return {}
    shifted = {}
    if mods.score_mod is not None:
        shifted["score_mod"] = lambda s, bb, hh, qi, ki, f=mods.score_mod: f(s, bb + b, hh + h, qi, ki)
    if mods.mask_mod is not None:
        shifted["mask_mod"] = lambda bb, hh, qi, ki, f=mods.mask_mod: f(bb + b, hh + h, qi, ki)
    return shifted
