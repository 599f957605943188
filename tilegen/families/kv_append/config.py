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
    """Launch parameters of one append kernel: new-token rows and KV heads per program, and warps."""

    block_t: int
    block_h: int
    num_warps: int

    def __str__(self) -> str:
        return f"T{self.block_t}-H{self.block_h}-w{self.num_warps}"


def search_space(spec: KVAppendSpec, device: DeviceInfo) -> dict[str, list[int]]:
    if device.is_interpreter:
        # The interpreter ignores warps; a few block shapes keep a CPU tune quick.
        return {"block_t": [2, 4, 8, 16], "block_h": [1, 2], "num_warps": [1]}
    return {"block_t": [1, 2, 4, 8, 16, 32, 64], "block_h": [1, 2, 4, 8], "num_warps": [1, 2, 4, 8]}


def _elements(spec: KVAppendSpec, config: Config) -> int:
    return config.block_t * config.block_h * triton.next_power_of_2(max(spec.head_dim, spec.dv))


def feasible(spec: KVAppendSpec, config: Config, device: DeviceInfo) -> str | None:
    for name in ("block_t", "block_h"):
        value = getattr(config, name)
        if value & (value - 1):
            return f"{name}={value}: tl.arange needs a power of two"
    elements = _elements(spec, config)
    if elements > MAX_BLOCK_ELEMENTS:
        return f"block_t={config.block_t}, block_h={config.block_h}: {elements} elements exceed the template's bound"
    if not device.is_interpreter and config.num_warps > 1 and config.num_warps * 32 > elements:
        return f"num_warps={config.num_warps}: more threads than the {elements} elements of a block"
    return None


def default_rule(spec: KVAppendSpec, device: DeviceInfo) -> list[tuple[int | None, Config]]:
    """A token's KV heads are adjacent in a page, so a program takes several heads of few tokens:
    contiguous runs, and for a decode step (one token per sequence) still a program per
    sequence or more. About 1k elements per program for small appends, spread over many SMs;
    4k with 4 warps (16 bytes per thread per row) for large ones. A starting point until tuned."""
    if device.is_interpreter:
        return [(None, Config(8, 2, 1))]
    width = triton.next_power_of_2(max(spec.head_dim, spec.dv))
    heads = max(1, min(8, 1024 // width))
    small = Config(1, heads, max(1, min(2, heads * width // 32)))
    block = max(1, min(64, 4096 // (width * heads)))
    large = Config(block, heads, max(1, min(4, block * heads * width // 32)))
    return [(64, small), (None, large)]
