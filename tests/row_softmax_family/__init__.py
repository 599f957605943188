"""A small second kernel family, used only by the tests: row-wise softmax.

It goes through everything a family goes through (lower, render, tune, store, dispatch,
``tilegen db list/prune``) with nothing outside this folder but its one registration
line and its tests. docs/adding-a-family.md walks through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from row_softmax_family.problem import RowSoftmaxProblem
from row_softmax_family.spec import RowSoftmaxSpec
from tilegen.device import DeviceInfo
from tilegen.families import Config, Family, PowerOfTwoBuckets


@dataclass(frozen=True, order=True)
class RowSoftmaxConfig(Config):
    block_rows: int
    num_warps: int


class RowSoftmax(Family):
    name = "row_softmax"
    spec_type = RowSoftmaxSpec
    config_type = RowSoftmaxConfig
    template = "row_softmax.py.jinja"
    template_dir = Path(__file__).parent / "templates"
    buckets = PowerOfTwoBuckets("columns")
    presets = {"row-softmax": RowSoftmaxSpec(dtype="fp32")}

    def lower(self, spec: RowSoftmaxSpec) -> dict:
        return {"kernel_name": f"_{spec.name}_kernel", "log": spec.log}

    def search_space(self, spec, device: DeviceInfo) -> dict[str, list[int]]:
        return {"block_rows": [1, 2, 4, 8], "num_warps": [1] if device.is_interpreter else [1, 2, 4, 8]}

    def feasible(self, spec, config: RowSoftmaxConfig, device: DeviceInfo) -> str | None:
        if config.block_rows & (config.block_rows - 1):
            return f"block_rows={config.block_rows}: tl.arange needs a power of two"
        return None

    def default_rule(self, spec, device: DeviceInfo) -> list[tuple[int | None, RowSoftmaxConfig]]:
        return [(None, RowSoftmaxConfig(2, 1 if device.is_interpreter else 4))]

    def problem(self, spec, bucket: int, *, on_gpu: bool, **shape: int) -> RowSoftmaxProblem:
        return RowSoftmaxProblem.for_bucket(spec, bucket, on_gpu=on_gpu, **shape)


FAMILY = RowSoftmax()
