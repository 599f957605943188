"""What a tuning trial of RoPE measures: a [tokens, heads, head_dim] tensor rotated out of place.

The positions are spread over a long context (up to 128k) so that the tables hold angles of
every size; the output starts as NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tilegen.families import base
from tilegen.families.rope.config import Config
from tilegen.families.rope.reference import rope_reference, rope_tables
from tilegen.families.rope.spec import RopeSpec
from tilegen.triton_internals.launch import Launcher

__all__ = ["Problem", "check_rope"]


@dataclass(frozen=True)
class Problem(base.RowsProblem):
    spec: RopeSpec

    def inputs(self, seed: int):
        device = "cuda" if self.on_gpu else "cpu"
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(self.tokens, self.heads, self.spec.head_dim, generator=gen).to(device, self.torch_dtype())
        positions = torch.randint(0, 1 << 17, (self.tokens,), generator=gen)
        cos, sin = rope_tables(positions, self.spec.head_dim, theta=500000.0)
        return x, cos.to(device), sin.to(device)

    def outputs(self, inputs):
        return (torch.full_like(inputs[0], math.nan),)

    def launch(self, launcher: Launcher, config: Config, inputs, outputs) -> None:
        launcher.launch(*inputs, outputs[0], **config.to_dict())

    def check(self, inputs, outputs) -> tuple[float, float]:
        return check_rope(*inputs, outputs[0])

    def flops(self) -> float:
        return 3.0 * self.rows * self.spec.head_dim  # two products and a sum per element

    def bytes_moved(self) -> float:
        """The tensor read once and written once, the fp32 tables read once per token."""
        return float(2 * self.rows * self.spec.head_dim * self.torch_dtype().itemsize
                     + 2 * self.tokens * self.spec.head_dim * 4)


def check_rope(x, cos, sin, out) -> tuple[float, float]:
    """``(relative error, max abs error)`` of a rotation against the float64 reference; ``inf`` for any NaN."""
    return base.relative_error(out, rope_reference(x, cos, sin))
