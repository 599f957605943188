"""What a tuning trial of batch decode measures: a batch of one-token queries over ragged paged contexts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from tilegen.device import device_info
from tilegen.families.attention_decode.config import DecodeConfig, split_count
from tilegen.families.attention_fwd.masks import launch_window
from tilegen.families.attention_varlen.problem import VarlenProblem, ragged_lengths

__all__ = ["DecodeProblem", "decode_buffers"]

#: KV tokens a GPU trial reads: enough to take the H200 to its bandwidth.
_GPU_KV_TOKENS = 1 << 18
_CPU_MAX_CONTEXT = 48


def decode_buffers(batch: int, rows: int, dv: int, num_splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split partials of ``rows`` query rows (heads x tokens) per sequence, fp32
    ``[batch, num_splits, rows, dv]`` and ``[batch, num_splits, rows]`` (empty without splits:
    the kernel then writes the output directly)."""
    if num_splits == 1:
        return torch.empty(0, device=device), torch.empty(0, device=device)
    return (torch.empty((batch, num_splits, rows, dv), dtype=torch.float32, device=device),
            torch.empty((batch, num_splits, rows), dtype=torch.float32, device=device))


@dataclass(frozen=True)
class DecodeProblem(VarlenProblem):
    """``len(k_lens)`` sequences, one query token each; ``num_splits`` forces the split count (tests)."""

    num_splits: int | None = None

    @classmethod
    def for_bucket(cls, spec, bucket: int, *, on_gpu: bool, k_lens=None, heads_q=None, num_splits=None,
                   **_: object) -> DecodeProblem:
        heads = heads_q or (32 if on_gpu else 4)
        if k_lens is None:
            longest = bucket if on_gpu else min(bucket, _CPU_MAX_CONTEXT)
            k_lens = tuple(ragged_lengths(longest, _GPU_KV_TOKENS if on_gpu else 3 * longest))
            if spec.kv_layout == "dense":
                k_lens = (longest,) * min(len(k_lens), 64)  # one length for all: dense tensors
            elif not on_gpu:
                k_lens = (*k_lens, 0, 1, spec.page_size + 1)
        return cls(spec, tuple(spec.q_tokens for _ in k_lens), tuple(k_lens), max(1, heads // spec.q_per_kv), bucket,
                   on_gpu, num_splits)

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

    def launch(self, module: ModuleType, config: DecodeConfig, inputs: dict, outputs) -> None:
        out, lse = outputs
        batch, tokens = len(self.k_lens), self.spec.q_tokens
        # Packed [batch * tokens, heads, dim] seen as the kernel's [batch, heads, tokens, dim].
        q = inputs["q"].view(batch, tokens, self.heads_q, -1).permute(0, 2, 1, 3)
        splits = self.num_splits or split_count(config, device_info(), len(self.k_lens), self.heads_kv,
                                                max(self.k_lens))
        chunk = math.ceil(max(max(self.k_lens), 1) / splits / config.block_n) * config.block_n
        part_o, part_lse = decode_buffers(batch, self.heads_q * tokens, self.spec.dv, splits, q.device)
        out = out.view(batch, tokens, self.heads_q, -1).permute(0, 2, 1, 3)
        left, right = launch_window(self.spec.mask, *self.bounds, self.spec.q_tokens, max(self.k_lens))
        table = (inputs["indptr"], inputs["indices"], inputs["last"]) if self.spec.kv_layout == "paged" else ()
        module.launch(
            q, inputs["k"], inputs["v"], out, out if lse is None else lse, part_o, part_lse, *table,
            chunk=chunk, num_splits=splits,
            scale=1.0 / math.sqrt(self.spec.head_dim), softcap=self.softcap or 0.0, window_left=left,
            window_right=right, block_n=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages,
        )

    def bytes_moved(self) -> float:
        """The K and V a decode step must read: the figure of merit of a memory-bound kernel."""
        elt = self.torch_dtype().itemsize
        return float(sum(self.k_lens) * self.heads_kv * (self.spec.head_dim + self.spec.dv) * elt)
