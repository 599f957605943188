"""What a tuning trial of attention forward measures: shapes for a bucket, inputs, launch, check, cost."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tilegen.families import base
from tilegen.families.attention_fwd.config import Config
from tilegen.families.attention_fwd.masks import launch_window, mask_band
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.families.attention_fwd.spec import AttentionSpec
from tilegen.mods.sources import sources_for, tuning_mods
from tilegen.mods.trace import CallRanges
from tilegen.triton_internals.launch import Launcher

__all__ = ["Problem", "attention_flops", "visible_pairs"]

#: A GPU bucket is timed on this many tokens (batch x seq) and query heads: enough
#: work to fill an H200, so the timing ranks configs as a real prefill would.
_GPU_TOKENS = 16384
_GPU_HEADS = 16
#: Under the interpreter every element costs microseconds: one tiny head pair keeps a trial under a second.
_CPU_HEADS = 2
_CPU_MAX_SEQ = 64
#: Score elements the reference may materialize (1 GiB in fp32); past it only the last rows are checked.
_REFERENCE_BUDGET = 1 << 28
#: Softcap value used when the spec has one: small enough that tanh actually bends the logits.
_SOFTCAP = 10.0


def visible_pairs(n_q: int, n_k: int, left: int | None, right: int | None) -> int:
    """(query, key) pairs a mask lets through, per head: the work no kernel can skip.

    Bounds as ``masks.window_bounds`` gives them (``None``: unbounded), around the
    bottom-right aligned diagonal.
    """
    diag = torch.arange(n_q, dtype=torch.int64) + (n_k - n_q)
    first = (diag - left).clamp(min=0) if left is not None else torch.zeros_like(diag)
    last = (diag + right).clamp(max=n_k - 1) if right is not None else torch.full_like(diag, n_k - 1)
    return int((last - first + 1).clamp(min=0).sum())


def attention_flops(
    spec: AttentionSpec, batch: int, heads_q: int, n_q: int, n_k: int, left: int | None, right: int | None
) -> float:
    """2 FLOPs per multiply-add in QK^T and in PV, over the visible pairs only.

    Causal counts n(n+1)/2 pairs per head, within 1/n of the 4*B*H*N*N*D/2 convention.
    """
    return 2.0 * batch * heads_q * visible_pairs(n_q, n_k, left, right) * (spec.head_dim + spec.dv)


@dataclass(frozen=True)
class Problem(base.Problem):
    """Self-attention of ``batch`` sequences of ``seq`` tokens, with the spec's mask at that length."""

    spec: AttentionSpec
    batch: int
    heads_kv: int
    seq: int
    on_gpu: bool
    #: The import paths of the spec's mods (``tilegen.mods.sources``): a trial imports and builds them.
    mods: tuple[str | None, str | None] = (None, None)

    @classmethod
    def for_bucket(
        cls, spec: AttentionSpec, bucket: int, *, on_gpu: bool, batch: int | None = None, heads_q: int | None = None
    ) -> Problem:
        mods = sources_for(spec)
        heads = heads_q or (_GPU_HEADS if on_gpu else _CPU_HEADS)
        seq = bucket if on_gpu else min(bucket, _CPU_MAX_SEQ)
        if batch is None:
            batch = max(1, _GPU_TOKENS // seq) if on_gpu else 1
        return cls(spec, batch, max(1, heads // spec.q_per_kv), seq, on_gpu, mods)

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.spec.q_per_kv

    @property
    def bounds(self) -> tuple[int | None, int | None]:
        """The mask's ``(left, right)`` at this length; a window narrow enough that both edges cut tiles."""
        return {"none": (None, None), "causal": (None, 0), "window": (self.seq // 4, self.seq // 16)}[self.spec.mask]

    @property
    def softcap(self) -> float | None:
        return _SOFTCAP if self.spec.softcap else None

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.spec.head_dim)

    def inputs(self, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        device = "cuda" if self.on_gpu else "cpu"
        gen = torch.Generator(device).manual_seed(seed)
        shapes = (
            (self.batch, self.heads_q, self.seq, self.spec.head_dim),
            (self.batch, self.heads_kv, self.seq, self.spec.head_dim),
            (self.batch, self.heads_kv, self.seq, self.spec.dv),
        )
        q, k, v = (torch.randn(s, generator=gen, device=device, dtype=self.torch_dtype()) for s in shapes)
        mods = self._mods(device)
        return (q, k, v) if mods is None else (q, k, v, mods)

    def _mods(self, device):
        """The spec's mods built for this problem (``tilegen.mods.sources``), or ``None`` without mods."""
        if self.mods == (None, None):
            return None
        ranges = CallRanges(self.batch, self.heads_q, self.seq, self.seq, mask_band(*self.bounds))
        return tuning_mods(self.spec, self.mods, ranges, batch=self.batch, heads=self.heads_q, n_q=self.seq,
                           n_k=self.seq, device=device)

    def outputs(self, inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        q = inputs[0]
        out = torch.full((*q.shape[:3], self.spec.dv), math.nan, device=q.device, dtype=q.dtype)
        lse = torch.full(q.shape[:3], math.nan, device=q.device) if self.spec.return_lse else None
        return out, lse

    def launch(self, launcher: Launcher, config: Config, inputs, outputs) -> None:
        q, k, v, *mods = inputs
        out, lse = outputs
        left, right = launch_window(self.spec.mask, *self.bounds, self.seq, self.seq)
        extra = {}
        if mods:
            extra["mod_tensors"] = mods[0].tensors
            if mods[0].mask_mod is not None:
                extra["mod_blocks"] = mods[0].block_table(self.batch, self.heads_q, self.seq, self.seq, config.block_m,
                                                          config.block_n, q.device)
        launcher.launch(
            q, k, v, out, out if lse is None else lse, scale=self.scale, softcap=self.softcap or 0.0,
            window_left=left, window_right=right, **extra, **config.to_dict(),
        )

    def check(self, inputs, outputs) -> tuple[float, float]:
        """Against the reference; heads are independent, so it covers as many leading KV groups of
        batch 0 as the budget allows, and past one group only the last rows, which see the same keys
        as in the full problem because the diagonal is bottom-right aligned."""
        q, k, v, *mods = inputs
        out, lse = outputs
        # The NaN poison is checked everywhere: the reference covers only part of the output, and an element the
        # kernel never wrote outside that part would otherwise pass.
        if torch.isnan(out).any() or (lse is not None and torch.isnan(lse).any()):
            return math.inf, math.inf
        n, g = self.seq, self.spec.q_per_kv
        groups = max(1, min(self.heads_kv, _REFERENCE_BUDGET // (g * n * n)))
        rows = min(n, max(1, _REFERENCE_BUDGET // (g * n)))
        compute = torch.float32 if q.is_cuda else torch.float64  # float64 is slow on GPUs; float32 is ample at 1e-2
        left, right = self.bounds
        ref, ref_lse = attention_reference(
            q[:1, : groups * g, n - rows :], k[:1, :groups], v[:1, :groups], causal=self.spec.mask == "causal",
            window=None if self.spec.mask != "window" else (left, right), softcap=self.softcap, scale=self.scale,
            compute_dtype=compute, score_mod=mods[0].score_mod if mods else None,
            mask_mod=mods[0].mask_mod if mods else None, q_offset=n - rows,
        )
        error, max_error = base.relative_error(out[:1, : groups * g, n - rows :], ref)
        if lse is not None:
            error = max(error, base.lse_error(lse[:1, : groups * g, n - rows :], ref_lse)[0])
        return error, max_error

    def flops(self) -> float:
        return attention_flops(self.spec, self.batch, self.heads_q, self.seq, self.seq, *self.bounds)

    def bytes_moved(self) -> float:
        """Q, K and V read once and the output written once: the least traffic any kernel needs."""
        elt = self.torch_dtype().itemsize
        dims = self.spec.head_dim + self.spec.dv
        return float(self.batch * self.seq * (self.heads_q + self.heads_kv) * dims * elt)
