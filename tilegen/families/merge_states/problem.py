"""What a tuning trial of merge-states measures: two partial results over [tokens, heads] rows.

The LSEs mix the cases a merge meets: both parts finite (most rows), equal, far apart (one
weight underflows), one part ``-inf`` and both ``-inf``; the output and its LSE start as NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tilegen.families import base
from tilegen.families.merge_states.config import Config
from tilegen.families.merge_states.reference import merge_reference
from tilegen.families.merge_states.spec import MergeStatesSpec
from tilegen.triton_internals.launch import Launcher

__all__ = ["Problem", "check_merge", "random_lse"]


@dataclass(frozen=True)
class Problem(base.RowsProblem):
    spec: MergeStatesSpec

    def inputs(self, seed: int):
        device = "cuda" if self.on_gpu else "cpu"
        gen = torch.Generator().manual_seed(seed)
        shape = (self.tokens, self.heads, self.spec.head_dim)
        o_a = torch.randn(shape, generator=gen).to(device, self.torch_dtype())
        o_b = torch.randn(shape, generator=gen).to(device, self.torch_dtype())
        lse_a, lse_b = random_lse((self.tokens, self.heads), gen)
        return o_a, lse_a.to(device), o_b, lse_b.to(device)

    def outputs(self, inputs):
        o_a, lse_a = inputs[0], inputs[1]
        return torch.full_like(o_a, math.nan), torch.full_like(lse_a, math.nan)

    def launch(self, launcher: Launcher, config: Config, inputs, outputs) -> None:
        launcher.launch(*inputs, *outputs, **config.to_dict())

    def check(self, inputs, outputs) -> tuple[float, float]:
        return check_merge(*inputs, *outputs)

    def flops(self) -> float:
        return 3.0 * self.rows * self.spec.head_dim  # two scaled products and their sum per element

    def bytes_moved(self) -> float:
        """Both parts read once, the merged result written once: outputs in the spec's dtype, LSEs fp32."""
        return float(3 * self.rows * (self.spec.head_dim * self.torch_dtype().itemsize + 4))


def random_lse(shape, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 LSEs (on the CPU) whose rows cycle through: finite, equal, 40 apart, a ``-inf``,
    b ``-inf``, both ``-inf``; the order is shuffled, the finite values spread around 0."""
    n = math.prod(shape)
    lse_a = torch.randn(n, generator=gen) * 4
    lse_b = torch.randn(n, generator=gen) * 4
    kind = torch.arange(n)[torch.randperm(n, generator=gen)] % 8
    lse_b = torch.where(kind == 1, lse_a, lse_b)
    lse_b = torch.where(kind == 2, lse_a - 40, lse_b)
    lse_a = torch.where((kind == 3) | (kind == 5), -math.inf, lse_a)
    lse_b = torch.where((kind == 4) | (kind == 5), -math.inf, lse_b)
    return lse_a.reshape(shape), lse_b.reshape(shape)


def check_merge(o_a, lse_a, o_b, lse_b, out, out_lse) -> tuple[float, float]:
    """``(relative error, max abs error)`` of a merge against the float64 reference, over ``out`` and
    ``out_lse``; ``inf`` for any NaN, or when ``out_lse`` is ``-inf`` on other rows than the reference's."""
    ref, ref_lse = merge_reference(o_a, lse_a, o_b, lse_b)
    error, max_error = base.relative_error(out, ref)
    lse_error, lse_max = base.lse_error(out_lse, ref_lse)
    return max(error, lse_error), max(max_error, lse_max)
