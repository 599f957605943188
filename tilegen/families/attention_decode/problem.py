"""What a tuning trial of batch decode measures: a batch of one-token queries over ragged paged contexts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tilegen.device import DeviceInfo, device_info
from tilegen.dtypes import KV_DTYPES
from tilegen.families.attention_decode.config import DecodeConfig, split_count
from tilegen.families.attention_fwd.masks import launch_window
from tilegen.families.attention_varlen.problem import VarlenProblem, ragged_lengths
from tilegen.families.buckets import ContextBatchBuckets
from tilegen.mods.sources import sources_for
from tilegen.triton_internals.launch import Launcher

__all__ = ["BUCKETS", "DecodeProblem", "decode_buffers"]

#: What a decode bucket is: the longest context and the batch, packed into one int. Tuned by default
#: on a GPU: a context every 4x from 1k to 64k (its configs change slowly with the context, and the
#: nearest-bucket rule serves 2x either side) crossed with a batch in each regime of the split rule
#: (H200, 8 KV heads): 1 (8 programs, the most splits), 8 (64 programs, still under one per SM: a few
#: splits) and 64 (512 programs: no split, as for every larger batch). 12 buckets, 360 trials at the
#: default 30, where all 7 sizes x 5 batches would take three times as long.
BUCKETS = ContextBatchBuckets("longest context", "sequences", gpu_sizes=(1024, 4096, 16384, 65536),
                              gpu_batches=(1, 8, 64), interpreter_batches=(1, 4))
#: The interpreter is slow: its trials cap the context and the batch (a GPU trial measures both as bucketed).
_CPU_MAX_CONTEXT = 48
_CPU_MAX_BATCH = 8


def decode_buffers(batch: int, rows: int, dv: int, num_splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split partials of ``rows`` query rows (heads x tokens) per sequence, fp32
    ``[batch, num_splits, rows, dv]`` and ``[batch, num_splits, rows]`` (empty without splits:
    the kernel then writes the output directly)."""
    if num_splits == 1:
        # fp32 as the split buffers are, not the default dtype (torch.set_default_dtype): the kernel's signature.
        return torch.empty(0, dtype=torch.float32, device=device), torch.empty(0, dtype=torch.float32, device=device)
    return (torch.empty((batch, num_splits, rows, dv), dtype=torch.float32, device=device),
            torch.empty((batch, num_splits, rows), dtype=torch.float32, device=device))


@dataclass(frozen=True)
class DecodeProblem(VarlenProblem):
    """``len(k_lens)`` sequences, one query token each; ``num_splits`` forces the split count (tests).
    ``device`` is the GPU the split rule counts SMs on, read where the problem is made: a compile
    process, which asks CUDA nothing, launches it too."""

    num_splits: int | None = None
    device: DeviceInfo | None = None

    @classmethod
    def for_bucket(cls, spec, bucket: int, *, on_gpu: bool, k_lens=None, heads_q=None, num_splits=None,
                   **_: object) -> DecodeProblem:
        """The bucket's batch of sequences, the first as long as its context bucket (``BUCKETS``);
        under the interpreter both are capped small. On a GPU every context is the longest: the
        regime whose bandwidth the split rule is tuned for. Rows tuned on ragged contexts below
        the longest lost up to 14% on full ones on the H200 (BN32-w2-s3-c6 at 4096 x 64: 3580
        GB/s against the default's 4179). Under the interpreter paged contexts are ragged, mixing in
        0, 1 and page_size + 1 tokens, for the checks' sake."""
        mods = sources_for(spec)
        context, batch = BUCKETS.unpack(bucket)
        heads = heads_q or (32 if on_gpu else 4)
        if k_lens is None:
            longest = context if on_gpu else min(context, _CPU_MAX_CONTEXT)
            batch = batch if on_gpu else min(batch, _CPU_MAX_BATCH)
            if spec.kv_layout == "dense" or on_gpu:
                k_lens = (longest,) * batch
            else:
                # A ragged mix yields at least `batch` lengths when asked for `batch` full contexts' tokens;
                # small batches still meet an empty context, a single token and a page boundary.
                ragged = ragged_lengths(longest, longest * batch)
                k_lens = (longest, 0, 1, spec.page_size + 1, *ragged[1:])[:batch]
        return cls(spec, tuple(spec.q_tokens for _ in k_lens), tuple(k_lens), max(1, heads // spec.q_per_kv), bucket,
                   on_gpu, mods=mods, num_splits=num_splits, device=device_info())

    @property
    def batch(self) -> int:
        return len(self.k_lens)

    @property
    def bounds(self) -> tuple[int | None, int | None]:
        # The window is sized from the context, not from the packed bucket's integer.
        context = BUCKETS.unpack(self.bucket)[0]
        return {"none": (None, None), "causal": (None, 0), "window": (context // 4, context // 16)}[self.spec.mask]

    def inputs(self, seed: int) -> dict:
        if self.spec.kv_layout == "paged":
            return super().inputs(seed)
        # Dense: [batch, kv_heads, n_k, dim] tensors, every sequence as long as the longest.
        gen = torch.Generator("cuda" if self.on_gpu else "cpu").manual_seed(seed)
        n, batch = max(self.k_lens), len(self.k_lens)

        def randn(*shape):
            return torch.randn(shape, generator=gen, device=gen.device, dtype=self.torch_dtype())

        tokens = self.spec.q_tokens
        return {"q": randn(batch * tokens, self.heads_q, self.spec.head_dim),
                "k": randn(batch, self.heads_kv, n, self.spec.head_dim),
                "v": randn(batch, self.heads_kv, n, self.spec.dv),
                "cu_q": torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32, device=gen.device)}

    def outputs(self, inputs: dict):
        out, lse = super().outputs(inputs)
        # The kernel writes the LSE as [batch, heads, tokens]; check() reads it back packed.
        return out, None if lse is None else lse.new_full((len(self.k_lens), self.heads_q, self.spec.q_tokens),
                                                          math.nan)

    def check(self, inputs: dict, outputs):
        out, lse = outputs
        return super().check(inputs, (out, None if lse is None else lse.permute(0, 2, 1).reshape(-1, self.heads_q)))

    def key_sequences(self, inputs: dict):
        if self.spec.kv_layout == "paged":
            return super().key_sequences(inputs)
        return ([k.transpose(0, 1) for k in inputs["k"]], [v.transpose(0, 1) for v in inputs["v"]])

    def launch(self, launcher: Launcher, config: DecodeConfig, inputs: dict, outputs) -> None:
        out, lse = outputs
        batch, tokens = len(self.k_lens), self.spec.q_tokens
        # Packed [batch * tokens, heads, dim] seen as the kernel's [batch, heads, tokens, dim].
        q = inputs["q"].view(batch, tokens, self.heads_q, -1).permute(0, 2, 1, 3)
        splits = self.num_splits or split_count(config, self.device or device_info(), len(self.k_lens), self.heads_kv,
                                                max(self.k_lens))
        chunk = math.ceil(max(max(self.k_lens), 1) / splits / config.block_n) * config.block_n
        part_o, part_lse = decode_buffers(batch, self.heads_q * tokens, self.spec.dv, splits, q.device)
        out = out.view(batch, tokens, self.heads_q, -1).permute(0, 2, 1, 3)
        left, right = launch_window(self.spec.mask, *self.bounds, self.spec.q_tokens, max(self.k_lens))
        table = (inputs["indptr"], inputs["indices"], inputs["last"]) if self.spec.kv_layout == "paged" else ()
        launcher.launch(
            q, inputs["k"], inputs["v"], out, out if lse is None else lse, part_o, part_lse, *table,
            *inputs.get("scales", ()), *(inputs["mods"].tensors if "mods" in inputs else ()), chunk=chunk,
            num_splits=splits,
            scale=1.0 / math.sqrt(self.spec.head_dim), softcap=self.softcap or 0.0, window_left=left,
            window_right=right, block_n=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages,
        )

    def bytes_moved(self) -> float:
        """The K and V a decode step must read (FP8 pages: one byte a value): the figure of merit of a
        memory-bound kernel."""
        elt = KV_DTYPES[self.spec.kv_dtype].itemsize if self.spec.kv_dtype else self.torch_dtype().itemsize
        return float(sum(self.k_lens) * self.heads_kv * (self.spec.head_dim + self.spec.dv) * elt)
