"""What a tuning trial of the append family measures: a ragged batch appended into shuffled pages.

Every page starts as NaN, so the check sees both halves of the contract: the target slots
hold the new tokens' values, and every other slot (the sequences' earlier tokens, the
spare pages) still holds its poison. A kernel that writes outside its slots fails. With FP8
pages (``spec.page_dtype``) the new tokens come with per-KV-head scales, and the reference is
torch's own quantization of them (divide, saturate, round to nearest even).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from tilegen.dtypes import FP8_MAX, KV_DTYPES
from tilegen.families import base
from tilegen.families.kv_append.config import Config
from tilegen.families.kv_append.reference import append_reference
from tilegen.families.kv_append.spec import KVAppendSpec
from tilegen.triton_internals.launch import Launcher

__all__ = ["Problem", "AppendInputs"]

#: On a GPU a bucket appends exactly its token count, over this many sequences at most (a
#: decode step of a large batch at the small end, chunks of prefill at the large end).
_GPU_BATCH = 64
_GPU_KV_HEADS = 8
#: Under the interpreter a trial stays small: a few heads and tokens, and a token count 3 short
#: of the bucket so that it is no multiple of any block.
_CPU_BATCH = 5
_CPU_KV_HEADS = 2
_CPU_MAX_TOKENS = 40
#: Pages no sequence owns: they must come out of the append still poisoned.
_SPARE_PAGES = 3


@dataclass(frozen=True)
class AppendInputs:
    """One batch: the page table (counting the new tokens), the new K and V, and cu_seqlens."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    num_pages: int
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    scales: tuple[torch.Tensor, ...] = ()  # FP8 pages: k_scale and v_scale, fp32 [kv_heads]


@dataclass(frozen=True)
class Problem(base.Problem):
    """Append ``new_tokens[b]`` tokens to sequences that hold ``context[b]`` tokens before it."""

    spec: KVAppendSpec
    kv_heads: int
    new_tokens: tuple[int, ...]
    context: tuple[int, ...]
    on_gpu: bool

    @classmethod
    def for_bucket(
        cls, spec: KVAppendSpec, bucket: int, *, on_gpu: bool, batch: int | None = None,
        kv_heads: int | None = None, context: int | None = None,
    ) -> Problem:
        """``batch`` sequences share the bucket's tokens evenly on a GPU, raggedly (some get none)
        under the interpreter; earlier context is drawn per sequence, up to a few pages, unless
        ``context`` fixes it."""
        rng = random.Random(bucket)
        if on_gpu:
            total = bucket
            batch = batch or min(bucket, _GPU_BATCH)
            new = [total // batch + (b < total % batch) for b in range(batch)]
        else:
            total = max(1, min(bucket, _CPU_MAX_TOKENS) - 3)
            batch = batch or _CPU_BATCH
            cuts = sorted(rng.randint(0, total) for _ in range(batch - 1))
            new = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, total])]
        if context is None:
            ctx = [rng.randint(0, 4 * spec.page_size) for _ in range(batch)]
        else:
            ctx = [context] * batch
        heads = kv_heads or (_GPU_KV_HEADS if on_gpu else _CPU_KV_HEADS)
        return cls(spec, heads, tuple(new), tuple(ctx), on_gpu)

    @property
    def total_new(self) -> int:
        return sum(self.new_tokens)

    @property
    def pages_written(self) -> int:
        """Pages the new tokens land in: the page-table entries the kernel must read."""
        size = self.spec.page_size
        return sum((c + n - 1) // size - c // size + 1 for c, n in zip(self.context, self.new_tokens) if n)

    def inputs(self, seed: int) -> AppendInputs:
        inputs = self.placeholder_inputs()
        gen = torch.Generator().manual_seed(seed)  # on the CPU: the page order is drawn there
        size = self.spec.page_size
        lens = torch.tensor([c + n for c, n in zip(self.context, self.new_tokens)], dtype=torch.int64)
        pages = (lens + size - 1) // size
        # Pages in shuffled order: a kernel that assumes a sequence's pages are adjacent fails.
        inputs.indices.copy_(torch.randperm(inputs.num_pages, generator=gen)[: inputs.indices.numel()])
        inputs.indptr[1:].copy_(torch.cumsum(pages, 0))
        inputs.indptr[0] = 0
        inputs.last_page_len.copy_(torch.where(pages > 0, lens - (pages - 1) * size, 0))
        inputs.cu_seqlens[1:].copy_(torch.cumsum(torch.tensor(self.new_tokens, dtype=torch.int64), 0))
        inputs.cu_seqlens[0] = 0
        inputs.k.copy_(torch.randn(inputs.k.shape, generator=gen))
        inputs.v.copy_(torch.randn(inputs.v.shape, generator=gen))
        for scale in inputs.scales:
            # Scales that put the inputs' tails beyond 2 to 6 sigma past the format's largest value, so that
            # saturation is exercised as well as rounding.
            scale.copy_((0.5 + torch.rand(scale.shape, generator=gen)) * 4 / FP8_MAX[self.spec.page_dtype])
        return inputs

    def placeholder_inputs(self) -> AppendInputs:
        """The inputs' tensors, sized from the lengths on the host and holding no values yet: no
        page table is drawn, so they build on the meta device too."""
        device = "cuda" if self.on_gpu else "cpu"
        size, batch = self.spec.page_size, len(self.context)
        used = sum(-(-(c + n) // size) for c, n in zip(self.context, self.new_tokens))
        dtype = self.torch_dtype()

        def ints(n):
            return torch.empty(n, dtype=torch.int32, device=device)

        k = torch.empty(self.total_new, self.kv_heads, self.spec.head_dim, dtype=dtype, device=device)
        v = torch.empty(self.total_new, self.kv_heads, self.spec.dv, dtype=dtype, device=device)
        scales = () if self.spec.page_dtype is None else tuple(
            torch.empty(self.kv_heads, dtype=torch.float32, device=device) for _ in "kv")
        return AppendInputs(ints(batch + 1), ints(used), ints(batch), used + _SPARE_PAGES, k, v, ints(batch + 1),
                            scales)

    def outputs(self, inputs: AppendInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pages, all NaN (FP8 has a NaN too)."""
        shape = (inputs.num_pages, self.spec.page_size, self.kv_heads)
        dtype = KV_DTYPES.get(self.spec.page_dtype, inputs.k.dtype)
        k_pages = torch.full((*shape, self.spec.head_dim), math.nan, dtype=dtype, device=inputs.k.device)
        v_pages = torch.full((*shape, self.spec.dv), math.nan, dtype=dtype, device=inputs.k.device)
        return k_pages, v_pages

    def launch(self, launcher: Launcher, config: Config, inputs: AppendInputs, outputs) -> None:
        k_pages, v_pages = outputs
        launcher.launch(
            inputs.k, inputs.v, inputs.cu_seqlens, k_pages, v_pages, inputs.indptr, inputs.indices,
            inputs.last_page_len, *inputs.scales, **config.to_dict(),
        )

    @property
    def tolerance(self) -> float:
        """An append copies: every target must hold its value bit for bit."""
        return 0.0

    def check(self, inputs: AppendInputs, outputs) -> tuple[float, float]:
        k, v = inputs.k, inputs.v
        if inputs.scales:
            k, v = (quantize(x, scale, outputs[0].dtype) for x, scale in zip((k, v), inputs.scales))
        return check_pages(*outputs, inputs.indptr, inputs.indices, inputs.last_page_len, k, v, inputs.cu_seqlens)

    def flops(self) -> float:
        return 0.0

    def bytes_moved(self) -> float:
        """The new K and V read once and written once, plus cu_seqlens, the per-sequence page-table
        entries and the page indices of the pages written, read once."""
        rows = self.total_new * self.kv_heads * (self.spec.head_dim + self.spec.dv)
        written = rows * (1 if self.spec.page_dtype else self.torch_dtype().itemsize)
        batch = len(self.new_tokens)
        table = 4 * (2 * (batch + 1) + batch + self.pages_written)
        return float(rows * self.torch_dtype().itemsize + written + table)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's quantization of ``x`` ``[tokens, kv_heads, dim]`` into FP8 ``dtype`` with one scale per
    KV head (or one for all): divide, saturate at the largest finite value, round to nearest even."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale.reshape(1, -1, 1)).clamp(-limit, limit).to(dtype)


def check_pages(k_pages, v_pages, indptr, indices, last_page_len, k, v, cu_seqlens) -> tuple[float, float]:
    """``(relative error, max abs error)`` of poisoned pages after an append: ``inf`` when a slot
    outside the targets lost its NaN poison or a target holds NaN."""
    k_ref, v_ref, written = append_reference(
        k_pages, v_pages, indptr, indices, last_page_len, k, v, cu_seqlens
    )
    got_k, got_v = k_pages.double(), v_pages.double()
    for got in (got_k, got_v):
        if not torch.isnan(got[~written]).all():
            return math.inf, math.inf
    got = torch.cat([got_k[written].flatten(), got_v[written].flatten()])
    ref = torch.cat([k_ref[written].flatten(), v_ref[written].flatten()])
    return base.relative_error(got, ref)
