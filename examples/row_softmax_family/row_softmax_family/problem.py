"""What a tuning trial of the row-softmax family measures."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from row_softmax_family.reference import softmax_reference
from row_softmax_family.spec import RowSoftmaxSpec
from tilegen.families import Problem, relative_error

_CPU_ROWS, _GPU_ROWS = 6, 8192  # not a multiple of any block of rows
_CPU_MAX_COLS = 64


@dataclass(frozen=True)
class RowSoftmaxProblem(Problem):
    spec: RowSoftmaxSpec
    rows: int
    cols: int
    on_gpu: bool

    @classmethod
    def for_bucket(cls, spec: RowSoftmaxSpec, bucket: int, *, on_gpu: bool, rows: int | None = None):
        cols = bucket if on_gpu else min(bucket, _CPU_MAX_COLS) - 3  # -3: not a power of two
        return cls(spec, rows or (_GPU_ROWS if on_gpu else _CPU_ROWS), cols, on_gpu)

    def inputs(self, seed: int) -> torch.Tensor:
        gen = torch.Generator("cuda" if self.on_gpu else "cpu").manual_seed(seed)
        return torch.randn(self.rows, self.cols, generator=gen, device=gen.device, dtype=self.torch_dtype()) * 3

    def outputs(self, inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.full_like(inputs, math.nan),)

    def launch(self, launcher, config, inputs, outputs) -> None:
        launcher.launch(inputs, outputs[0], **config.to_dict())

    def check(self, inputs, outputs) -> tuple[float, float]:
        return relative_error(outputs[0], softmax_reference(inputs, log=self.spec.log))

    def flops(self) -> float:
        return 5.0 * self.rows * self.cols  # max, subtract, exp, sum, divide

    def bytes_moved(self) -> float:
        return 2.0 * self.rows * self.cols * self.torch_dtype().itemsize
