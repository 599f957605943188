"""The append config, its search space, what the kernel can run, and the heuristic default."""

from __future__ import annotations

from dataclasses import dataclass

import triton

from tilegen.device import DeviceInfo
from tilegen.families import base
from tilegen.families.kv_append.lower import MAX_BLOCK_ELEMENTS
from tilegen.families.kv_append.spec import KVAppendSpec

__all__ = ["Config", "search_space", "feasible", "default_rule"]


@dataclass(frozen=True, order=True)
class Config(base.Config):
    """Launch parameters of one append kernel: new-token rows per program, and warps."""

    block_t: int
    num_warps: int

    def __str__(self) -> str:
        return f"T{self.block_t}-w{self.num_warps}"


def search_space(spec: KVAppendSpec, device: DeviceInfo) -> dict[str, list[int]]:
    if device.is_interpreter:
        # The interpreter ignores warps; a few row counts keep a CPU tune quick.
        return {"block_t": [2, 4, 8, 16], "num_warps": [1]}
    return {"block_t": [1, 2, 4, 8, 16, 32, 64], "num_warps": [1, 2, 4, 8]}


def feasible(spec: KVAppendSpec, config: Config, device: DeviceInfo) -> str | None:
    if config.block_t & (config.block_t - 1):
        return f"block_t={config.block_t}: tl.arange needs a power of two"
    width = triton.next_power_of_2(max(spec.head_dim, spec.dv))
    if config.block_t * width > MAX_BLOCK_ELEMENTS:
        return f"block_t={config.block_t}: a {config.block_t}x{width} block exceeds the template's bound"
    if not device.is_interpreter and config.num_warps * 32 > config.block_t * width:
        return f"num_warps={config.num_warps}: more threads than the {config.block_t}x{width} elements of a block"
    return None


def default_rule(spec: KVAppendSpec, device: DeviceInfo) -> list[tuple[int | None, Config]]:
    """Small appends (decode steps) are latency-bound: small blocks spread them over more SMs.
    Larger ones move 16 bytes per thread with one row per 16 threads, so rows of a 128-wide
    bf16 head fill 4 warps at block_t 8. A starting point until the family is tuned."""
    if device.is_interpreter:
        return [(None, Config(8, 1))]
    width = triton.next_power_of_2(max(spec.head_dim, spec.dv))
    block = max(1, min(64, 1024 // width))
    big = Config(block, max(1, min(4, block * width // 32)))
    return [(64, Config(max(1, min(64, 256 // width)), 1)), (None, big)]
