"""The row-softmax family's knobs: rows per program and warps; their search space, feasibility and defaults."""

from __future__ import annotations

from dataclasses import dataclass

from row_softmax_family.spec import RowSoftmaxSpec
from tilegen.device import DeviceInfo
from tilegen.families import Config


@dataclass(frozen=True, order=True)
class RowSoftmaxConfig(Config):
    block_rows: int
    num_warps: int


def search_space(spec: RowSoftmaxSpec, device: DeviceInfo) -> dict[str, list[int]]:
    return {"block_rows": [1, 2, 4, 8], "num_warps": [1] if device.is_interpreter else [1, 2, 4, 8]}


def feasible(spec: RowSoftmaxSpec, config: RowSoftmaxConfig, device: DeviceInfo) -> str | None:
    # Mirrors the kernel: a config it would reject is never compiled, and a stored row with one is skipped.
    if config.block_rows & (config.block_rows - 1):
        return f"block_rows={config.block_rows}: tl.arange needs a power of two"
    return None


def default_rule(spec: RowSoftmaxSpec, device: DeviceInfo) -> list[tuple[int | None, RowSoftmaxConfig]]:
    return [(None, RowSoftmaxConfig(2, 1 if device.is_interpreter else 4))]
