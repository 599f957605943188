"""Cascade configs: two launches' knobs. The shared levels' tiles (many rows: a matrix product)
and the last level's (a few rows: a memory-bound read, decode's shape) take their own key
block, warps, stages and programs per SM: one kernel for both would hold the large tile's
registers in every program, and the last level's reads would run at a third of the occupancy
(on the H200, 64 x 4096 unshared decode took 281 us in one launch against PagedDecode's 251)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import triton

from tilegen.device import DeviceInfo
from tilegen.families import base
from tilegen.families.attention_cascade.spec import CascadeSpec

__all__ = ["CascadeConfig", "search_space", "feasible", "default_rule", "own_block_m", "MAX_OWN_ROWS"]

#: The last level's tile holds a node's query rows (tokens x a KV head's query heads) up to this many;
#: a node with more rows takes several tiles. Decode's 1 x 4 rows pad to 16, the least a dot takes.
MAX_OWN_ROWS = 64


@dataclass(frozen=True, order=True)
class CascadeConfig(base.Config):
    block_m: int  # query rows per shared tile: many requests' heads of one KV head
    block_n: int  # keys per block of a shared tile
    num_warps: int
    num_stages: int
    ctas_per_sm: int  # the shared launch's key chunks aim for this many programs per SM
    own_block_n: int  # the same four for the last level, whose tiles have few rows
    own_warps: int
    own_stages: int
    own_ctas_per_sm: int

    def __str__(self) -> str:
        return (f"M{self.block_m}-N{self.block_n}-w{self.num_warps}-s{self.num_stages}-c{self.ctas_per_sm}"
                f"/N{self.own_block_n}-w{self.own_warps}-s{self.own_stages}-c{self.own_ctas_per_sm}")


def search_space(spec: CascadeSpec, device: DeviceInfo) -> dict[str, list[int]]:
    if device.is_interpreter:
        return {"block_m": [16, 32], "block_n": [16, 32], "num_warps": [4], "num_stages": [1], "ctas_per_sm": [1, 2],
                "own_block_n": [16], "own_warps": [4], "own_stages": [1], "own_ctas_per_sm": [1, 2]}
    space = {"block_m": [64, 128], "block_n": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3],
             "ctas_per_sm": [1, 2, 3, 4], "own_block_n": [32, 64, 128], "own_warps": [2, 4], "own_stages": [2, 3, 4],
             "own_ctas_per_sm": [1, 2, 3, 4]}
    return base.with_smaller(space, device, block_m=(32,), block_n=(16,), num_stages=(1,), own_block_n=(16,),
                             own_stages=(1,))


def own_block_m(q_per_kv: int, max_tokens: int) -> int:
    """Rows of the last level's tile: its nodes' query rows, a power of two from 16 to ``MAX_OWN_ROWS``."""
    return min(MAX_OWN_ROWS, max(16, triton.next_power_of_2(max(1, q_per_kv * max_tokens))))


def feasible(spec: CascadeSpec, config: CascadeConfig, device: DeviceInfo) -> str | None:
    for knob in ("block_m", "block_n", "own_block_n"):  # own_block_m is the plan's, always a power of two
        value = getattr(config, knob)
        if value % 16 or value & (value - 1):
            return f"{knob}={value}: the template asserts a power of two and a multiple of 16"
    if device.is_interpreter:
        return None
    dim_pad = triton.next_power_of_2(spec.head_dim)
    dim_v_pad = triton.next_power_of_2(spec.dv)
    if config.block_m * dim_v_pad > 128 * 256:
        return f"block_m={config.block_m}: the accumulator does not fit in registers at head dim {spec.dv}"
    elt = 4 if spec.dtype == "fp32" else 2
    for rows, block_n, stages in ((config.block_m, config.block_n, config.num_stages),
                                  (MAX_OWN_ROWS, config.own_block_n, config.own_stages)):
        smem = (rows * dim_pad + stages * block_n * (dim_pad + dim_v_pad)) * elt
        if smem > device.smem_bytes:
            return f"~{smem} bytes of shared memory against the device's {device.smem_bytes}"
    return None


def default_rule(spec: CascadeSpec, device: DeviceInfo) -> list[tuple[int | None, CascadeConfig]]:
    """The last level's knobs are decode's default (``attention_decode.config.default_rule``)."""
    if device.is_interpreter:
        return [(None, CascadeConfig(16, 16, 4, 1, 1, 16, 4, 1, 1))]
    if spec.dtype == "fp32" or max(spec.head_dim, spec.dv) > 128:
        return [(None, CascadeConfig(64, 32, 4, 2, 2, 32, 4, 2, 2))]
    return [(None, CascadeConfig(64, 64, 4, 3, 3, 64, 2, 2, 3))]


def chunk_keys(block_n: int, work: float, programs: int, floor: int) -> int:
    """Keys per work item: the launch's key-block work spread over ``programs``, a multiple of
    ``block_n`` and at least ``floor`` (fewer keys per item add merge work for little balance)."""
    chunk = max(floor, math.ceil(work / max(1, programs)))
    return math.ceil(chunk / block_n) * block_n
