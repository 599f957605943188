"""The attention-forward config, its search space, what the kernel can run, and the heuristic default.

The search space reads the same kernel contract as the template's ``tl.static_assert``
lines, so Python never offers a config that breaks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from tilegen.device import DeviceInfo
from tilegen.families import base
from tilegen.families.attention_fwd.spec import AttentionSpec

__all__ = ["Config", "search_space", "feasible", "default_rule"]

# Rough per-thread register budget for the fp32 score tile and accumulator; past
# it the kernel spills and is never the winner, so it is not worth compiling.
_MAX_FP32_REGS_PER_THREAD = 160


@dataclass(frozen=True, order=True)
class Config(base.Config):
    """Launch parameters of one attention-forward kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"BM{self.block_m}-BN{self.block_n}-w{self.num_warps}-s{self.num_stages}"


def search_space(spec: AttentionSpec, device: DeviceInfo) -> dict[str, list[int]]:
    if device.is_interpreter:
        # The interpreter ignores warps and stages; keep the space small so a CPU tune is quick.
        return {"block_m": [16, 32, 64], "block_n": [16, 32, 64], "num_warps": [4], "num_stages": [1]}
    return {
        "block_m": [64, 128, 256],
        "block_n": [32, 64, 128],
        "num_warps": [4, 8],
        "num_stages": [2, 3, 4],
    }


def feasible(spec: AttentionSpec, config: Config, device: DeviceInfo) -> str | None:
    for name in ("block_m", "block_n"):
        value = getattr(config, name)
        if value % 16 or value & (value - 1):
            return f"{name}={value}: the template asserts a power of two and a multiple of 16"
    dim_pad = triton.next_power_of_2(spec.head_dim)
    dim_v_pad = triton.next_power_of_2(spec.dv)
    if config.block_m * dim_v_pad > 128 * 256:
        return f"block_m={config.block_m}: accumulator of {config.block_m}x{dim_v_pad} exceeds the template's bound"
    if device.is_interpreter:
        return None
    threads = 32 * config.num_warps
    regs = (config.block_m * dim_v_pad + config.block_m * config.block_n) / threads
    if regs > _MAX_FP32_REGS_PER_THREAD:
        return f"~{regs:.0f} fp32 registers per thread for scores and accumulator: spills"
    elt = 4 if spec.dtype == "fp32" else 2
    smem = (config.block_m * dim_pad + config.num_stages * config.block_n * (dim_pad + dim_v_pad)) * elt
    if smem > device.smem_bytes:
        return f"~{smem} bytes of shared memory against the device's {device.smem_bytes}"
    return None


def default_rule(spec: AttentionSpec, device: DeviceInfo) -> list[tuple[int | None, Config]]:
    """The GPU rules come from exhaustive grids of causal bf16 attention on an H200, 512 to 32k
    (BENCHMARKS.md): up to 1k, few query tiles per head, so smaller tiles keep more SMs busy;
    from 2k on the largest tiles that do not spill win. Each rule is within 4% of the grid's
    best at every length from 512 to 32k.
    """
    if device.is_interpreter:
        return [(None, Config(32, 32, 4, 1))]
    if spec.dtype == "fp32":
        return [(None, Config(64, 32, 4, 2))]
    dim = max(spec.head_dim, spec.dv)
    if dim <= 64:
        return [(1024, Config(64, 64, 4, 3)), (None, Config(128, 64, 8, 3))]
    if dim <= 128:
        return [(1024, Config(64, 32, 4, 3)), (None, Config(128, 128, 8, 3))]
    return [(None, Config(64, 32, 4, 2))]
