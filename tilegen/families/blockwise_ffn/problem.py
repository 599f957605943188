"""What a tuning trial of the blockwise FFN measures: ``x + ffn(norm(x))`` over a bucket of token rows.

Weights are scaled by ``1/sqrt(fan_in)`` so every stage stays O(1), and the norm's weight
(and bias) are not ones (and zeros), so a kernel that skips them shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tilegen.families import base
from tilegen.families.blockwise_ffn.config import Config
from tilegen.families.blockwise_ffn.reference import ffn_reference
from tilegen.families.blockwise_ffn.spec import BlockwiseFFNSpec
from tilegen.triton_internals.launch import Launcher

__all__ = ["Problem", "Weights", "random_weights"]

#: Under the interpreter a trial has at most this many rows, 3 short of it (no multiple of any block).
_CPU_MAX_TOKENS = 48
#: The float64 check goes this many rows at a time, so a 64k-row trial's check fits beside the trial.
_CHECK_ROWS = 4096
_EPS = 1e-5


@dataclass(frozen=True)
class Weights:
    w_norm: torch.Tensor
    b_norm: torch.Tensor | None
    w_gate: torch.Tensor | None
    w_up: torch.Tensor
    w_down: torch.Tensor


def random_weights(spec: BlockwiseFFNSpec, gen: torch.Generator, device, dtype) -> Weights:
    """Fresh weights for ``spec`` in ``torch.nn.Linear``'s layout (drawn on the CPU, then moved)."""
    d, f = spec.d_model, spec.d_ffn

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)

    return Weights(
        w_norm=randn(d, scale=0.2, shift=1.0),
        b_norm=randn(d, scale=0.2) if spec.norm == "layernorm" else None,
        w_gate=randn(f, d, scale=d ** -0.5) if spec.ffn == "swiglu" else None,
        w_up=randn(f, d, scale=d ** -0.5),
        w_down=randn(d, f, scale=f ** -0.5),
    )


@dataclass(frozen=True)
class Problem(base.Problem):
    spec: BlockwiseFFNSpec
    tokens: int
    on_gpu: bool

    @classmethod
    def for_bucket(cls, spec: BlockwiseFFNSpec, bucket: int, *, on_gpu: bool, tokens: int | None = None) -> Problem:
        if tokens is None:
            tokens = bucket if on_gpu else max(1, min(bucket, _CPU_MAX_TOKENS) - 3)
        return cls(spec, tokens, on_gpu)

    def inputs(self, seed: int):
        device = "cuda" if self.on_gpu else "cpu"
        gen = torch.Generator().manual_seed(seed)
        dtype = self.torch_dtype()
        x = (torch.randn(self.tokens, self.spec.d_model, generator=gen) * 2 + 0.5).to(device, dtype)
        return x, random_weights(self.spec, gen, device, dtype)

    def outputs(self, inputs):
        return (torch.full_like(inputs[0], math.nan),)

    def launch(self, launcher: Launcher, config: Config, inputs, outputs) -> None:
        x, w = inputs
        launcher.launch(x, w.w_norm, w.b_norm, w.w_gate, w.w_up, w.w_down, outputs[0], eps=_EPS, **config.to_dict())

    def check(self, inputs, outputs) -> tuple[float, float]:
        x, w = inputs
        out = outputs[0]
        if torch.isnan(out).any():
            return math.inf, math.inf
        err2 = ref2 = max_error = 0.0
        for start in range(0, self.tokens, _CHECK_ROWS):
            rows = slice(start, start + _CHECK_ROWS)
            ref = ffn_reference(x[rows], w.w_norm, w.b_norm, w.w_gate, w.w_up, w.w_down,
                                norm=self.spec.norm, ffn=self.spec.ffn, eps=_EPS)
            diff = out[rows].double() - ref
            err2 += float(diff.pow(2).sum())
            ref2 += float(ref.pow(2).sum())
            max_error = max(max_error, float(diff.abs().max()))
        return math.sqrt(err2) / max(math.sqrt(ref2), 1e-30), max_error

    def flops(self) -> float:
        matrices = 3 if self.spec.ffn == "swiglu" else 2
        return 2.0 * self.tokens * self.spec.d_model * self.spec.d_ffn * matrices

    def bytes_moved(self) -> float:
        """x read twice (norm and residual), out written, each weight read once."""
        matrices = 3 if self.spec.ffn == "swiglu" else 2
        elements = 3 * self.tokens * self.spec.d_model + matrices * self.spec.d_model * self.spec.d_ffn
        return float(elements * self.torch_dtype().itemsize)
