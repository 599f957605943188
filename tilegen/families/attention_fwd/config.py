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

__all__ = ["Config", "TileConfig", "search_space", "feasible", "default_rule", "has_tma"]

# Rough per-thread register budget for the fp32 score tile and accumulator; past
# it the kernel spills and is never the winner, so it is not worth compiling.
_MAX_FP32_REGS_PER_THREAD = 160


@dataclass(frozen=True, order=True)
class TileConfig(base.Config):
    """Tiles, warps and stages: what every attention-forward kernel takes (the ragged and paged ones too)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"BM{self.block_m}-BN{self.block_n}-w{self.num_warps}-s{self.num_stages}"


@dataclass(frozen=True, order=True)
class Config(TileConfig):
    """Launch parameters of one dense attention-forward kernel."""

    # 1: Q, K and V are read through TMA tensor descriptors (Hopper and later) where the tensors
    # allow one (16-byte aligned base and strides, contiguous head dim); else through pointers.
    tma: int = 0

    switches = frozenset({"tma"})

    def __str__(self) -> str:
        return super().__str__() + ("-tma" if self.tma else "")


def search_space(spec: AttentionSpec, device: DeviceInfo) -> dict[str, list[int]]:
    if device.is_interpreter:
        # The interpreter ignores warps and stages; keep the space small so a CPU tune is quick.
        # The TMA path runs under the interpreter too, but a CPU tune need not try it: tests do.
        return {"block_m": [16, 32, 64], "block_n": [16, 32, 64], "num_warps": [4], "num_stages": [1], "tma": [0]}
    return {
        "block_m": [64, 128, 256],
        "block_n": [32, 64, 128],
        "num_warps": [4, 8],
        "num_stages": [2, 3, 4],
        "tma": [0, 1] if has_tma(device) else [0],
    }


def has_tma(device: DeviceInfo) -> bool:
    """Whether the device has the Tensor Memory Accelerator (sm90 and later); the interpreter
    runs the descriptor path too, so CPU tests cover it."""
    return device.is_interpreter or device.capability >= (9, 0)


def feasible(spec: AttentionSpec, config: Config, device: DeviceInfo) -> str | None:
    if config.tma not in (0, 1):
        return f"tma={config.tma}: expected 0 or 1"
    if config.tma and not has_tma(device):
        return f"tma=1: {device.name} (sm{device.capability[0]}{device.capability[1]}) has no TMA; it needs sm90"
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
    """The GPU rules come from exhaustive grids of bf16 attention on an H200 (BENCHMARKS.md): up to
    1k, few query tiles per head, so smaller tiles keep more SMs busy; from 2k on the largest tiles
    that do not spill win. The tiles were fitted on pointer-load grids from 512 to 32k (within 4%
    of each grid's best); the TMA switch and the 1k tiles on later measurements, below.
    """
    if device.is_interpreter:
        return [(None, Config(32, 32, 4, 1))]
    if spec.dtype == "fp32":
        return [(None, Config(64, 32, 4, 2))]
    dim = max(spec.head_dim, spec.dv)
    # TMA from 512 keys on: on the H200 it matched or beat pointer loads at every shape tried (d128
    # causal 1k 348 against 298 TFLOP/s, 16k 499 against 478). Up to 256 keys it was never measured;
    # small calls keep pointers in the launcher anyway (TMA_MIN_WORK), as descriptors cost host time.
    tma = int(has_tma(device))
    if dim <= 64:
        return [(256, Config(64, 64, 4, 3)), (1024, Config(64, 64, 4, 3, tma)), (None, Config(128, 64, 8, 3, tma))]
    if dim <= 128:
        # Up to 1k keys BM64-BN64 with TMA: the best of all 60 configs at d128 1k, causal (359 TFLOP/s) and
        # full (466, against 413 for BN32).
        return [(256, Config(64, 32, 4, 3)), (1024, Config(64, 64, 4, 3, tma)), (None, Config(128, 128, 8, 3, tma))]
    return [(None, Config(64, 32, 4, 2))]
