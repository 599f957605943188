"""Ragged and paged attention configs: the dense family's tiles, warps and stages, without its
TMA and wgmma knobs (these kernels find each sequence's keys through cumulative lengths or a page
table, which a descriptor of one dense tensor does not describe)."""

from __future__ import annotations

from tilegen.device import DeviceInfo
from tilegen.families.attention_fwd import config as dense
from tilegen.families.attention_fwd.config import TileConfig

__all__ = ["TileConfig", "search_space", "feasible", "default_rule"]


def search_space(spec, device: DeviceInfo) -> dict[str, list[int]]:
    return dense.tile_space(device)


def feasible(spec, config: TileConfig, device: DeviceInfo) -> str | None:
    return dense.feasible(spec, dense.Config(**config.to_dict()), device)


def default_rule(spec, device: DeviceInfo) -> list[tuple[int | None, TileConfig]]:
    """The dense family's rule as it stood before its TMA knob, fitted on dense causal bf16 grids on
    an H200 (these kernels share that inner loop); the dense rule has since moved on measurements
    of the dense kernel alone."""
    if device.is_interpreter:
        return [(None, TileConfig(32, 32, 4, 1))]
    if spec.dtype == "fp32":
        return [(None, TileConfig(64, 32, 4, 2))]
    dim = max(spec.head_dim, spec.dv)
    if dim <= 64:
        return [(1024, TileConfig(64, 64, 4, 3)), (None, TileConfig(128, 64, 8, 3))]
    if dim <= 128:
        return [(1024, TileConfig(64, 32, 4, 3)), (None, TileConfig(128, 128, 8, 3))]
    return [(None, TileConfig(64, 32, 4, 2))]
