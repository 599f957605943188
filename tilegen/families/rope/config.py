"""The RoPE config, its search space, what the kernel can run, and the heuristic default."""

from __future__ import annotations

import triton

from tilegen.device import DeviceInfo
from tilegen.families import base
from tilegen.families.rope.lower import MAX_BLOCK_ELEMENTS
from tilegen.families.rope.spec import RopeSpec

__all__ = ["Config", "default_rule", "feasible", "search_space"]


class Config(base.RowBlockConfig):
    """Launch parameters of one RoPE kernel: rows ((token, head) pairs) per program, and warps."""


def search_space(spec: RopeSpec, device: DeviceInfo) -> dict[str, list[int]]:
    if device.is_interpreter:
        return {"block_r": [2, 4, 8, 16], "num_warps": [1]}
    return {"block_r": [4, 8, 16, 32, 64, 128], "num_warps": [1, 2, 4, 8]}


def feasible(spec: RopeSpec, config: Config, device: DeviceInfo) -> str | None:
    if config.block_r < 1 or config.block_r & (config.block_r - 1):
        return f"block_r={config.block_r}: tl.arange needs a power of two"
    width = triton.next_power_of_2(spec.head_dim // 2)
    if config.block_r * width > MAX_BLOCK_ELEMENTS:
        return f"block_r={config.block_r}: a {config.block_r}x{width} half-block exceeds the template's bound"
    if not device.is_interpreter and config.num_warps > 1 and config.num_warps * 32 > config.block_r * width:
        return f"num_warps={config.num_warps}: more threads than the {config.block_r}x{width} elements of a half-block"
    return None


def default_rule(spec: RopeSpec, device: DeviceInfo) -> list[tuple[int | None, Config]]:
    """About 2k element pairs per program with 4 warps: 16 per thread, wide loads, and blocks small
    enough to fill the SMs from a few thousand rows on (on the H200, 32 rows of a 128-dim head
    rotated a Llama-3-8B layer's q and k at 64k tokens in 0.49 ms in all, 32 launches)."""
    if device.is_interpreter:
        return [(None, Config(8, 1))]
    width = triton.next_power_of_2(spec.head_dim // 2)
    block = max(1, min(128, 2048 // width))
    return [(None, Config(block, max(1, min(4, block * width // 32))))]
