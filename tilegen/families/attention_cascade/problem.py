"""What a tuning trial of cascade attention measures: a batch of requests that share one prefix,
each with tokens of its own, one query token each (decode)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tilegen.device import DeviceInfo, device_info
from tilegen.dtypes import KV_DTYPES
from tilegen.families import base
from tilegen.families.attention_cascade.config import CascadeConfig
from tilegen.families.attention_cascade.reference import cascade_reference
from tilegen.families.attention_cascade.schedule import HostLevel, schedule
from tilegen.families.attention_cascade.spec import CascadeSpec
from tilegen.families.buckets import ContextBatchBuckets
from tilegen.triton_internals.launch import Launcher

__all__ = ["BUCKETS", "CascadeProblem", "cascade_buffers", "device_schedule"]

#: A cascade bucket packs the shared prefix's length and the requests sharing it. Tuned by default at
#: the prefixes of a system prompt (4k) to a long document (32k), and the batches where the shared pass
#: is a few rows per KV head (8) or a matrix product (64).
BUCKETS = ContextBatchBuckets("shared prefix", "requests", gpu_sizes=(4096, 32768), gpu_batches=(8, 64),
                              interpreter_batches=(3,))
_CPU_MAX_PREFIX = 40
_SPARE_PAGES = 2
_SOFTCAP = 10.0


def cascade_buffers(states: int, heads_q: int, dv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The states' partial outputs and LSEs, fp32 ``[states, heads_q, dv]`` and ``[states, heads_q]``."""
    return (torch.empty((states, heads_q, dv), dtype=torch.float32, device=device),
            torch.empty((states, heads_q), dtype=torch.float32, device=device))


def device_schedule(levels: list[HostLevel], tokens: int, *, spec: CascadeSpec, heads_q: int, kv_heads: int,
                    config: CascadeConfig, device_info: DeviceInfo, device) -> dict:
    """The launch values of a schedule, its tables on ``device`` and its state buffers."""
    plan = schedule(levels, tokens, q_per_kv=spec.q_per_kv, kv_heads=kv_heads, page_size=spec.page_size,
                    config=config, sm_count=device_info.sm_count)
    part_o, part_lse = cascade_buffers(0 if plan.direct else plan.states, heads_q, spec.dv, device)
    return {"work": plan.work.to(device), "state_base": plan.state_base.to(device), "part_o": part_o,
            "part_lse": part_lse, "shared_items": plan.shared_items, "own_items": plan.items - plan.shared_items,
            "direct": plan.direct, "fused": plan.fused,
            "states_pad": max(2, 1 << max(0, plan.max_states - 1).bit_length()), "own_block_m": plan.own_block_m}


@dataclass(frozen=True)
class CascadeProblem(base.Problem):
    """``len(own)`` requests sharing a ``prefix``-token level, request b holding ``own[b]`` more tokens
    and one query token (the last of them)."""

    spec: CascadeSpec
    prefix: int
    own: tuple[int, ...]
    heads_kv: int
    bucket: int
    on_gpu: bool
    device: DeviceInfo | None = None

    @classmethod
    def for_bucket(cls, spec, bucket: int, *, on_gpu: bool, heads_q=None, own=None, **_: object) -> CascadeProblem:
        """On a GPU each request owns a sixteenth of the prefix; under the interpreter the prefix is capped
        and the own lengths are ragged, with a single token and a page boundary among them."""
        prefix, batch = BUCKETS.unpack(bucket)
        heads = heads_q or (32 if on_gpu else 4)
        if not on_gpu:
            prefix = min(prefix, _CPU_MAX_PREFIX) + 1
        if own is None:
            own = (max(1, prefix // 16),) * batch if on_gpu else \
                tuple((1, spec.page_size + 1, prefix // 3 + 2)[b % 3] for b in range(batch))
        return cls(spec, prefix, tuple(own), max(1, heads // spec.q_per_kv), bucket, on_gpu, device_info())

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.spec.q_per_kv

    @property
    def softcap(self) -> float | None:
        return _SOFTCAP if self.spec.softcap else None

    def inputs(self, seed: int) -> dict:
        device = "cuda" if self.on_gpu else "cpu"
        gen = torch.Generator(device).manual_seed(seed)
        spec, size, dtype = self.spec, self.spec.page_size, self.torch_dtype()
        batch = len(self.own)
        prefix_pages = -(-self.prefix // size)
        own_pages = [-(-n // size) for n in self.own]
        used = prefix_pages + sum(own_pages)
        num_pages = used + _SPARE_PAGES
        k = torch.full((num_pages, size, self.heads_kv, spec.head_dim), math.nan, device=device, dtype=dtype)
        v = torch.full((num_pages, size, self.heads_kv, spec.dv), math.nan, device=device, dtype=dtype)
        order = torch.randperm(num_pages, generator=gen, device=device)[:used].cpu()
        # Fill only the slots a level holds; the rest (a partial last page, spare pages) stay NaN.
        lengths = [self.prefix, *self.own]
        firsts = [0, *(prefix_pages + sum(own_pages[:b]) for b in range(batch))]
        for n, first in zip(lengths, firsts):
            pages = order[first:first + -(-n // size)].to(device)
            slots = torch.arange(n, device=device)
            k[pages[slots // size], slots % size] = torch.randn((n, self.heads_kv, spec.head_dim), generator=gen,
                                                                device=device, dtype=dtype)
            v[pages[slots // size], slots % size] = torch.randn((n, self.heads_kv, spec.dv), generator=gen,
                                                                device=device, dtype=dtype)

        def last_len(n):
            return n - (-(-n // size) - 1) * size if n else 0

        shared = HostLevel([0, batch], [0, prefix_pages], order[:prefix_pages].to(torch.int32), [last_len(self.prefix)])
        own_indptr = [0]
        for p in own_pages:
            own_indptr.append(own_indptr[-1] + p)
        own_level = HostLevel(list(range(batch + 1)), own_indptr, order[prefix_pages:].to(torch.int32),
                              [last_len(n) for n in self.own])
        levels = [shared, own_level]
        q = torch.randn((batch, self.heads_q, spec.head_dim), generator=gen, device=device, dtype=dtype)
        indices = torch.cat([level.kv_indices for level in levels]).to(device)
        inputs = {"q": q, "k": k, "v": v, "levels": levels, "indices": indices, "schedules": {}, "scales": ()}
        if spec.kv_dtype is not None:
            # FP8 pages with a scale per KV head; the reference reads them dequantized.
            fp8 = KV_DTYPES[spec.kv_dtype]
            scales = [torch.rand(self.heads_kv, generator=gen, device=device) + 0.5 for _ in range(2)]
            inputs["k"], inputs["v"] = ((t.float() / s[:, None]).to(fp8) for t, s in zip((k, v), scales))
            inputs["scales"] = tuple(scales)
        return inputs

    def _dequantized(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if not inputs["scales"]:
            return inputs["k"], inputs["v"]
        return tuple(t.float() * s[:, None] for t, s in zip((inputs["k"], inputs["v"]), inputs["scales"]))

    def outputs(self, inputs: dict):
        q = inputs["q"]
        out = torch.full((*q.shape[:2], self.spec.dv), math.nan, device=q.device, dtype=q.dtype)
        lse = torch.full(q.shape[:2], math.nan, device=q.device) if self.spec.return_lse else None
        return out, lse

    def launch(self, launcher: Launcher, config: CascadeConfig, inputs: dict, outputs) -> None:
        out, lse = outputs
        values = inputs["schedules"].get(config)
        if values is None:  # made on the first launch, never in a captured or timed one
            values = inputs["schedules"][config] = device_schedule(
                inputs["levels"], inputs["q"].shape[0], spec=self.spec, heads_q=self.heads_q, kv_heads=self.heads_kv,
                config=config, device_info=self.device or device_info(), device=inputs["q"].device)
        launcher.launch(inputs["q"], inputs["k"], inputs["v"], out, out if lse is None else lse, values["part_o"],
                        values["part_lse"], values["state_base"], values["work"], inputs["indices"], *inputs["scales"],
                        shared_items=values["shared_items"], own_items=values["own_items"], direct=values["direct"],
                        fused=values["fused"],
                        states_pad=values["states_pad"],
                        own_block_m=values["own_block_m"], scale=1.0 / math.sqrt(self.spec.head_dim),
                        softcap=self.softcap or 0.0, **config.to_dict())

    def check(self, inputs: dict, outputs) -> tuple[float, float]:
        out, lse = outputs
        if torch.isnan(out).any() or (lse is not None and torch.isnan(lse).any()):
            return math.inf, math.inf
        compute = torch.float32 if self.on_gpu else torch.float64
        ref, ref_lse = cascade_reference(inputs["q"], *self._dequantized(inputs), inputs["levels"],
                                         causal=self.spec.mask == "causal", softcap=self.softcap,
                                         scale=1.0 / math.sqrt(self.spec.head_dim), compute_dtype=compute)
        error, worst = base.relative_error(out, ref)
        if lse is not None:
            # A request of no token sees no key, which only -inf says.
            error = max(error, base.lse_error(lse, ref_lse)[0])
        return error, worst

    def flops(self) -> float:
        keys = len(self.own) * self.prefix + sum(self.own)
        return 2.0 * self.heads_q * keys * (self.spec.head_dim + self.spec.dv)

    def bytes_moved(self) -> float:
        """The K and V read once: the shared prefix once, each request's own tokens."""
        elt = 1 if self.spec.kv_dtype else self.torch_dtype().itemsize
        return float((self.prefix + sum(self.own)) * self.heads_kv * (self.spec.head_dim + self.spec.dv) * elt)
