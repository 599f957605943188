"""What a tuning trial of the blockwise layer measures: one layer forward over a bucket of tokens.

Random weights in Llama's names (norm weights near one and biases near zero but never either,
projections scaled by ``1/sqrt(fan_in)`` so every stage stays O(1)), a window and a softcap
when the spec has them (a third of the sequence to the left, a fifth to the right; softcap 5),
checked against the float64 reference layer with the dtype's tolerance. The layer's own
contribution ``out - x`` is held to the same bound, since the residual stream would hide a
schedule that dropped attention or the MLP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from tilegen.families import base
from tilegen.layers.family.config import Config
from tilegen.layers.family.reference import layer_reference
from tilegen.layers.family.spec import BlockwiseLayerSpec
from tilegen.layers.config import LayerConfig
from tilegen.ops.attention import attention
from tilegen.ops.blockwise import blockwise_ffn
from tilegen.ops.rope import apply_rope
from tilegen.triton_internals.launch import Launcher

__all__ = ["Problem", "layer_config", "random_weights"]

#: Under the interpreter a trial has at most this many tokens, 3 short of it (no multiple of any block).
_CPU_MAX_TOKENS = 48
#: Up to this many tokens the check computes every row; past it, the first and last rows and a sample.
_CHECK_ALL = 2048
_CHECK_EDGE = 64
#: An odd stride, so the sampled rows fall at every offset within power-of-two blocks.
_CHECK_STRIDE_ROWS = 384
_EPS = 1e-5
_SOFTCAP = 5.0
_ROPE_THETA = 10000.0


def layer_config(spec: BlockwiseLayerSpec, tokens: int) -> LayerConfig:
    """The layer a trial of ``spec`` at ``tokens`` tokens runs: the spec's, with the numbers it leaves to launch."""
    window = None
    if spec.window:
        left = max(1, tokens // 3)
        window = (left, 0) if spec.causal else (left, max(1, tokens // 5))
    return LayerConfig(d_model=spec.d_model, heads_q=spec.heads_q, heads_kv=spec.heads_kv, head_dim=spec.head_dim,
                       d_ffn=spec.d_ffn, norm=spec.norm, ffn=spec.ffn, causal=spec.causal,
                       rope_theta=_ROPE_THETA if spec.rope else None, eps=_EPS, window=window,
                       softcap=_SOFTCAP if spec.softcap else None)


def random_weights(config: LayerConfig, gen: torch.Generator, device, dtype) -> dict[str, torch.Tensor]:
    """Fresh weights for ``config`` by Llama name (drawn on the CPU, then moved)."""
    weights = {}
    for name, shape in config.weight_shapes().items():
        if len(shape) == 1:
            t = torch.randn(shape, generator=gen) * 0.2 + (0.0 if name.endswith("bias") else 1.0)
        else:
            t = torch.randn(shape, generator=gen) * shape[1] ** -0.5
        weights[name] = t.to(device=device, dtype=dtype)
    return weights


@dataclass(frozen=True)
class Problem(base.Problem):
    spec: BlockwiseLayerSpec
    tokens: int
    on_gpu: bool
    # A trial launches a whole layer, milliseconds of kernels at the least, whose host side cannot
    # show; captured, its activations would be held a second time in the graph's memory pool.
    timed_from_graph: ClassVar[bool] = False

    @classmethod
    def for_bucket(cls, spec: BlockwiseLayerSpec, bucket: int, *, on_gpu: bool, tokens: int | None = None) -> Problem:
        if tokens is None:
            tokens = bucket if on_gpu else max(1, min(bucket, _CPU_MAX_TOKENS) - 3)
        return cls(spec, tokens, on_gpu)

    def layer(self) -> LayerConfig:
        return layer_config(self.spec, self.tokens)

    def inputs(self, seed: int):
        device = "cuda" if self.on_gpu else "cpu"
        gen = torch.Generator().manual_seed(seed)
        dtype = self.torch_dtype()
        x = (torch.randn(self.tokens, self.spec.d_model, generator=gen) * 1.5).to(device, dtype)
        return x, random_weights(self.layer(), gen, device, dtype)

    def outputs(self, inputs):
        return (torch.full_like(inputs[0], math.nan),)

    def launch(self, launcher: Launcher, config: Config, inputs, outputs) -> None:
        x, w = inputs
        ops = {"rope": apply_rope} if self.spec.rope else {}
        launcher.launch(x, w, outputs[0], attention=attention, blockwise_ffn=blockwise_ffn, **ops,
                      block_q=config.block_q, **self.spec.launch_args(self.layer()))

    def check_rows(self) -> torch.Tensor | None:
        """The tokens whose outputs the check compares; ``None`` for all of them."""
        n = self.tokens
        if n <= _CHECK_ALL:
            return None
        stride = (n // _CHECK_STRIDE_ROWS) | 1
        rows = set(range(_CHECK_EDGE)) | set(range(n - _CHECK_EDGE, n)) | set(range(0, n, stride))
        return torch.tensor(sorted(rows))

    def check(self, inputs, outputs) -> tuple[float, float]:
        x, w = inputs
        out = outputs[0]
        if torch.isnan(out).any():  # every row, sampled or not, must have been written
            return math.inf, math.inf
        rows = self.check_rows()
        if rows is not None:
            rows = rows.to(x.device)
            x, out = x[rows], out[rows]
        ref = layer_reference(inputs[0], w, self.layer(), rows=rows)
        error, max_error = base.relative_error(out, ref)
        own, _ = base.relative_error(out.double() - x.double(), ref - x.double())
        return max(error, own), max_error

    def attended_pairs(self) -> int:
        """(query, key) pairs the layer's attention visits."""
        left, right = self.layer().attention_bounds()
        n = self.tokens
        i = torch.arange(n, dtype=torch.int64)
        lo = torch.zeros_like(i) if left is None else i - left
        hi = torch.full_like(i, n - 1) if right is None else i + right
        return int((hi.clamp(max=n - 1) - lo.clamp(min=0) + 1).sum())

    def flops(self) -> float:
        s = self.spec
        q_width, kv_width = s.heads_q * s.head_dim, s.heads_kv * s.head_dim
        matrices = 3 if s.ffn == "swiglu" else 2
        projections = 2.0 * self.tokens * s.d_model * (2 * q_width + 2 * kv_width + matrices * s.d_ffn)
        return projections + 4.0 * s.heads_q * s.head_dim * self.attended_pairs()

    def bytes_moved(self) -> float:
        """x read, out written, each weight read once."""
        elements = 2 * self.tokens * self.spec.d_model + sum(
            math.prod(shape) for shape in self.layer().weight_shapes().values())
        return float(elements * self.torch_dtype().itemsize)
