"""What a tuning trial of ragged or paged attention measures: a mixed-length batch at a bucket.

With FP8 pages (``spec.kv_dtype``) random K and V of the query's dtype are quantized with a
scale per KV head, and the reference attends to the dequantized pages (value * scale)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tilegen.dtypes import FP8_MAX, KV_DTYPES
from tilegen.families import base
from tilegen.families.attention_fwd.config import TileConfig
from tilegen.families.attention_fwd.masks import launch_window, mask_band
from tilegen.families.attention_fwd.problem import visible_pairs
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.families.attention_varlen.reference import gather_pages, varlen_reference
from tilegen.families.attention_varlen.spec import VarlenAttentionSpec
from tilegen.mods.sources import sources_for, tuning_mods
from tilegen.mods.trace import CallRanges
from tilegen.triton_internals.launch import Launcher

__all__ = ["VarlenProblem", "ragged_lengths"]

#: Tokens a GPU trial covers (a prefill batch that fills an H200) and its query heads.
_GPU_TOKENS = 16384
_GPU_HEADS = 16
_CPU_HEADS = 2
_CPU_MAX_SEQ = 48
#: Score elements the reference may materialize per sequence; past it only the last rows are checked.
_REFERENCE_BUDGET = 1 << 26
#: Spare pages poisoned with NaN: a kernel that reads a page it was not given fails the check.
_SPARE_PAGES = 3
_SOFTCAP = 10.0


def ragged_lengths(longest: int, tokens: int) -> list[int]:
    """A deterministic mix of lengths up to ``longest`` (none of them block multiples) until ``tokens``."""
    shapes = (1.0, 0.37, 0.81, 0.13, 0.55, 0.02)
    lengths: list[int] = []
    while sum(lengths) < tokens or len(lengths) < 2:
        lengths.append(max(1, int(longest * shapes[len(lengths) % len(shapes)]) - len(lengths) % 3))
    return lengths


@dataclass(frozen=True)
class VarlenProblem(base.Problem):
    """Sequences with ``k_lens`` keys whose last ``q_lens`` tokens are the queries (prefill when equal)."""

    spec: VarlenAttentionSpec
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    heads_kv: int
    bucket: int
    on_gpu: bool
    #: The import paths of the spec's mods (``tilegen.mods.sources``): a trial imports and builds them.
    mods: tuple[str | None, str | None] = (None, None)

    @classmethod
    def for_bucket(cls, spec: VarlenAttentionSpec, bucket: int, *, on_gpu: bool,
                   q_lens: tuple[int, ...] | None = None, k_lens: tuple[int, ...] | None = None,
                   heads_q: int | None = None) -> VarlenProblem:
        mods = sources_for(spec)
        heads = heads_q or (_GPU_HEADS if on_gpu else _CPU_HEADS)
        if k_lens is None:
            longest = bucket if on_gpu else min(bucket, _CPU_MAX_SEQ)
            k_lens = tuple(ragged_lengths(longest, _GPU_TOKENS if on_gpu else 2 * longest))
            if not on_gpu:
                k_lens = (*k_lens, 0, 1)  # an empty sequence and a single token, mid-batch
        if q_lens is None:
            # Paged: chunked prefill, the second half of each sequence appended onto its first half.
            q_lens = tuple(n - n // 2 if spec.kv_layout == "paged" else n for n in k_lens)
        return cls(spec, tuple(q_lens), tuple(k_lens), max(1, heads // spec.q_per_kv), bucket, on_gpu, mods=mods)

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.spec.q_per_kv

    @property
    def bounds(self) -> tuple[int | None, int | None]:
        return {"none": (None, None), "causal": (None, 0),
                "window": (self.bucket // 4, self.bucket // 16)}[self.spec.mask]

    @property
    def softcap(self) -> float | None:
        return _SOFTCAP if self.spec.softcap else None

    @property
    def paged_positions(self) -> bool:
        """Whether the mods see a query at its position among its sequence's keys (the paged ops'), not
        at its row (``varlen_attention``'s)."""
        return self.spec.kv_layout == "paged"

    def _band(self) -> tuple[int | None, int | None] | str:
        """The mods' range check's band (``tilegen.mods.trace.TracedMod.check_ranges``): the mask's around the one
        diagonal every sequence shares, else ``"unknown"``."""
        if self.paged_positions:
            return mask_band(*self.bounds)
        diagonals = {nk - nq for nq, nk in zip(self.q_lens, self.k_lens) if nq}
        return mask_band(*self.bounds, diagonals.pop()) if len(diagonals) == 1 else "unknown"

    def inputs(self, seed: int) -> dict:
        inputs = self._paged_inputs(seed) if self.spec.kv_layout == "paged" else self._ragged_inputs(seed)
        if self.mods != (None, None):
            device = inputs["q"].device
            n_q, n_k = max(self.q_lens), max(self.k_lens)
            ranges = CallRanges(len(self.k_lens), self.heads_q, n_k if self.paged_positions else n_q, n_k,
                                self._band())
            inputs["mods"] = tuning_mods(self.spec, self.mods, ranges, batch=len(self.k_lens), heads=self.heads_q,
                                         n_q=n_q, n_k=n_k, device=device)
        return inputs

    def _ragged_inputs(self, seed: int) -> dict:
        device = "cuda" if self.on_gpu else "cpu"
        gen = torch.Generator(device).manual_seed(seed)
        dtype = self.torch_dtype()
        spec = self.spec

        def randn(*shape):
            return torch.randn(shape, generator=gen, device=device, dtype=dtype)

        return {"q": randn(sum(self.q_lens), self.heads_q, spec.head_dim), "cu_q": _cumsum(self.q_lens, device),
                "max_q": max(self.q_lens), "k": randn(sum(self.k_lens), self.heads_kv, spec.head_dim),
                "v": randn(sum(self.k_lens), self.heads_kv, spec.dv), "cu_k": _cumsum(self.k_lens, device)}

    def placeholder_inputs(self) -> dict:
        if self.spec.kv_layout != "paged":
            return self.inputs(0)
        return self._paged_buffers()

    def _paged_buffers(self) -> dict:
        """The paged inputs' tensors, allocated from the lengths alone: every slot NaN, the rest of
        no value yet. Their sizes come from the lengths on the host, so they build anywhere, the
        meta device included."""
        device = "cuda" if self.on_gpu else "cpu"
        spec, size, dtype = self.spec, self.spec.page_size, self.torch_dtype()
        kv_dtype = KV_DTYPES.get(spec.kv_dtype, dtype)
        batch, used = len(self.k_lens), sum(-(-n // size) for n in self.k_lens)
        num_pages = used + _SPARE_PAGES

        def ints(n):
            return torch.empty(n, dtype=torch.int32, device=device)

        buffers = {
            "q": torch.empty(sum(self.q_lens), self.heads_q, spec.head_dim, dtype=dtype, device=device),
            "cu_q": ints(batch + 1), "max_q": max(self.q_lens),
            "k": torch.full((num_pages, size, self.heads_kv, spec.head_dim), math.nan, device=device, dtype=kv_dtype),
            "v": torch.full((num_pages, size, self.heads_kv, spec.dv), math.nan, device=device, dtype=kv_dtype),
            "indptr": ints(batch + 1), "indices": ints(used), "last": ints(batch)}
        if spec.kv_dtype is not None:
            buffers["scales"] = tuple(torch.empty(self.heads_kv, dtype=torch.float32, device=device) for _ in "kv")
        return buffers

    def _paged_inputs(self, seed: int) -> dict:
        """Shuffled pages, NaN in every slot no sequence holds, filled in one scatter: a GPU decode
        trial at a large batch holds millions of tokens, too many pages to fill one by one."""
        inputs = self._paged_buffers()
        k_pages, v_pages, device = inputs["k"], inputs["v"], inputs["k"].device
        gen = torch.Generator(device).manual_seed(seed)
        spec, size, dtype = self.spec, self.spec.page_size, self.torch_dtype()

        def randn(*shape):
            return torch.randn(shape, generator=gen, device=device, dtype=dtype)

        lengths = torch.tensor(self.k_lens, dtype=torch.int64, device=device)
        pages_per_seq = (lengths + size - 1) // size
        used = inputs["indices"].numel()
        indices = torch.randperm(k_pages.shape[0], generator=gen, device=device)[:used]
        indptr = torch.nn.functional.pad(pages_per_seq.cumsum(0), (1, 0))
        # Token t of sequence b lies in slot t % size of page indices[indptr[b] + t // size].
        seq = torch.repeat_interleave(torch.arange(len(self.k_lens), device=device), lengths)
        first = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))[:-1]
        pos = torch.arange(seq.numel(), device=device) - first[seq]
        page = indices[indptr[seq] + pos // size]
        new_k, new_v = randn(seq.numel(), self.heads_kv, spec.head_dim), randn(seq.numel(), self.heads_kv, spec.dv)
        if spec.kv_dtype is not None:
            # Per-head scales that saturate the few-sigma tails, as a calibrated cache would now and then.
            for scale, new in zip(inputs["scales"], (new_k, new_v)):
                scale.copy_((0.5 + torch.rand(self.heads_kv, generator=gen, device=device)) * 4 / FP8_MAX[spec.kv_dtype])
            new_k, new_v = (_quantize(new, scale, k_pages.dtype) for new, scale in zip((new_k, new_v), inputs["scales"]))
        k_pages[page, pos % size] = new_k
        v_pages[page, pos % size] = new_v
        last = torch.where(pages_per_seq > 0, lengths - (pages_per_seq - 1) * size, 0)
        inputs["q"].copy_(randn(*inputs["q"].shape))
        inputs["cu_q"].copy_(torch.tensor((0, *self.q_lens), device=device).cumsum(0))
        inputs["indptr"].copy_(indptr)
        inputs["indices"].copy_(indices)
        inputs["last"].copy_(last)
        return inputs

    def outputs(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        q = inputs["q"]
        out = torch.full((*q.shape[:2], self.spec.dv), math.nan, device=q.device, dtype=q.dtype)
        lse = torch.full(q.shape[:2], math.nan, device=q.device) if self.spec.return_lse else None
        return out, lse

    def launch(self, launcher: Launcher, config: TileConfig, inputs: dict, outputs) -> None:
        out, lse = outputs
        left, right = launch_window(self.spec.mask, *self.bounds, max(self.q_lens), max(self.k_lens))
        kv = ((inputs["k"], inputs["v"], out, out if lse is None else lse, inputs["cu_q"], inputs["cu_k"])
              if self.spec.kv_layout == "ragged" else
              (inputs["k"], inputs["v"], out, out if lse is None else lse, inputs["cu_q"], inputs["indptr"],
               inputs["indices"], inputs["last"]))
        mods, extra = inputs.get("mods"), {}
        if mods is not None and self.spec.kv_layout == "ragged":
            extra["mod_tensors"] = mods.tensors
            if mods.mask_mod is not None:
                extra["mod_blocks"] = mods.block_table(len(self.k_lens), self.heads_q, max(self.q_lens),
                                                       max(self.k_lens), config.block_m, config.block_n,
                                                       inputs["q"].device)
        # The paged launch takes the mods' tensors positionally, after the scales.
        paged_mods = mods.tensors if mods is not None and self.spec.kv_layout == "paged" else ()
        launcher.launch(inputs["q"], *kv, inputs["max_q"], *inputs.get("scales", ()), *paged_mods,
                        scale=1.0 / math.sqrt(self.spec.head_dim),
                        softcap=self.softcap or 0.0, window_left=left, window_right=right, **extra, **config.to_dict())

    def key_sequences(self, inputs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each sequence's keys and values, contiguous."""
        if self.spec.kv_layout == "ragged":
            cu = inputs["cu_k"].tolist()
            return ([inputs["k"][a:b] for a, b in zip(cu, cu[1:])], [inputs["v"][a:b] for a, b in zip(cu, cu[1:])])
        table = (inputs["indptr"], inputs["indices"], inputs["last"])
        n = len(self.k_lens)
        keys = [gather_pages(inputs["k"], *table, b) for b in range(n)]
        values = [gather_pages(inputs["v"], *table, b) for b in range(n)]
        if "scales" in inputs:
            # The reference sees what the kernel should: the dequantized pages, exact in float64.
            wide = torch.float32 if self.on_gpu else torch.float64
            k_scale, v_scale = (t.to(wide)[:, None] for t in inputs["scales"])
            keys = [k.to(wide) * k_scale for k in keys]
            values = [v.to(wide) * v_scale for v in values]
        return keys, values

    def check(self, inputs: dict, outputs) -> tuple[float, float]:
        """Against the reference, sequence by sequence; a long sequence keeps its last rows within the budget."""
        out, lse = outputs
        if torch.isnan(out).any() or (lse is not None and torch.isnan(lse).any()):
            return math.inf, math.inf
        k_seqs, v_seqs = self.key_sequences(inputs)
        compute = torch.float32 if self.on_gpu else torch.float64
        cu = inputs["cu_q"].tolist()
        errors, worst = [], 0.0
        left, right = self.bounds
        for b, (start, end) in enumerate(zip(cu, cu[1:])):
            if end == start:
                continue
            # Queries sit bottom-right, so the last ``rows`` queries alone see the same keys.
            rows = min(end - start, max(1, _REFERENCE_BUDGET // (max(1, self.k_lens[b]) * self.heads_q)))
            sl = slice(end - rows, end)
            masks = {"causal": self.spec.mask == "causal",
                     "window": (left, right) if self.spec.mask == "window" else None, "softcap": self.softcap,
                     "scale": 1.0 / math.sqrt(self.spec.head_dim), "compute_dtype": compute}
            mods = inputs.get("mods")
            if mods is None:
                ref, ref_lse = varlen_reference(inputs["q"][sl], [k_seqs[b]], [v_seqs[b]], torch.tensor([0, rows]),
                                                **masks)
            else:
                # The mods see the sequence's index and the checked rows' own positions.
                first = (self.k_lens[b] if self.paged_positions else end - start) - rows
                ref, ref_lse = attention_reference(
                    inputs["q"][sl].transpose(0, 1)[None], k_seqs[b].transpose(0, 1)[None],
                    v_seqs[b].transpose(0, 1)[None], score_mod=mods.score_mod, mask_mod=mods.mask_mod,
                    batch_ids=torch.tensor([b], device=out.device), q_offset=first, **masks)
                ref, ref_lse = ref[0].transpose(0, 1), ref_lse[0].transpose(0, 1)
            error, max_error = base.relative_error(out[sl], ref)
            if lse is not None:
                error = max(error, base.lse_error(lse[sl], ref_lse)[0])
            errors.append(error)
            worst = max(worst, max_error)
        return (max(errors) if errors else 0.0), worst

    def flops(self) -> float:
        pairs = sum(visible_pairs(nq, nk, *self.bounds) for nq, nk in zip(self.q_lens, self.k_lens) if nq)
        return 2.0 * self.heads_q * pairs * (self.spec.head_dim + self.spec.dv)

    def bytes_moved(self) -> float:
        elt = self.torch_dtype().itemsize
        kv_elt = KV_DTYPES[self.spec.kv_dtype].itemsize if self.spec.kv_dtype else elt
        dims = self.spec.head_dim + self.spec.dv
        return float((sum(self.q_lens) * self.heads_q * elt + sum(self.k_lens) * self.heads_kv * kv_elt) * dims)


def _quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[tokens, kv_heads, dim]`` in FP8 ``dtype`` with one scale per KV head: torch's saturating cast."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale[None, :, None]).clamp(-limit, limit).to(dtype)


def _cumsum(lengths, device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)

