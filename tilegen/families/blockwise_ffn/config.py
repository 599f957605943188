"""The blockwise FFN config, its search space, what the kernels can run, and the heuristic default.

``block_tokens`` is the fusion block: the rows whose normalized input and FFN intermediate
exist at once (``xn`` [block_tokens, d_model] and ``h`` [block_tokens, d_ffn]). It trades
memory for fewer, larger launches, so its GPU range stops at 4096 rows (h of a 14336-wide
FFN in bf16: 117 MB). Inside ``tilegen.blockwise_layer`` it splits each query block further; the
query block is the ``blockwise_layer`` family's own knob.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilegen.device import DeviceInfo
from tilegen.dtypes import TORCH_DTYPES
from tilegen.families import base
from tilegen.families.blockwise_ffn.spec import BlockwiseFFNSpec

__all__ = ["Config", "search_space", "feasible", "default_rule"]

#: fp32 accumulator values per thread the up kernel may hold (gate and up tiles for SwiGLU);
#: past this the registers spill.
_MAX_ACC_PER_THREAD = 128


@dataclass(frozen=True, order=True)
class Config(base.Config):
    """Fusion block rows; the matmul tiles: rows and reduction step shared by the up and down kernels,
    columns of each (the up kernel holds two accumulators for SwiGLU, so it wants narrower tiles);
    warps and pipeline stages."""

    block_tokens: int
    block_m: int
    block_n_up: int
    block_n_down: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return (f"T{self.block_tokens}-{self.block_m}x{self.block_n_up}/{self.block_n_down}x{self.block_k}"
                f"-w{self.num_warps}-s{self.num_stages}")


def search_space(spec: BlockwiseFFNSpec, device: DeviceInfo) -> dict[str, list[int]]:
    if device.is_interpreter:
        return {"block_tokens": [16, 32, 64], "block_m": [16, 32], "block_n_up": [16, 32], "block_n_down": [16, 32],
                "block_k": [16, 32], "num_warps": [1], "num_stages": [1]}
    return {"block_tokens": [1024, 2048, 4096], "block_m": [64, 128], "block_n_up": [64, 128, 256],
            "block_n_down": [64, 128, 256], "block_k": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3, 4]}


def feasible(spec: BlockwiseFFNSpec, config: Config, device: DeviceInfo) -> str | None:
    for knob in ("block_tokens", "block_m", "block_n_up", "block_n_down", "block_k"):
        value = getattr(config, knob)
        if value & (value - 1):
            return f"{knob}={value}: tl.arange needs a power of two"
    if min(config.block_k, config.block_m, config.block_n_up, config.block_n_down) < 16:
        return "block_m, block_n_up, block_n_down and block_k must be at least 16: tl.dot's smallest operand"
    if config.block_tokens < config.block_m:
        return f"block_tokens={config.block_tokens}: smaller than one tile of block_m={config.block_m} rows"
    if device.is_interpreter:
        return None
    itemsize = TORCH_DTYPES[spec.dtype].itemsize
    up_accumulators = 2 if spec.ffn == "swiglu" else 1
    for kernel, block_n, accumulators in (("up", config.block_n_up, up_accumulators),
                                          ("down", config.block_n_down, 1)):
        per_thread = config.block_m * block_n * accumulators // (32 * config.num_warps)
        if per_thread > _MAX_ACC_PER_THREAD:
            return (f"{kernel} kernel: {config.block_m}x{block_n} tiles ({accumulators} accumulators) hold "
                    f"{per_thread} fp32 values per thread with {config.num_warps} warps; more than "
                    f"{_MAX_ACC_PER_THREAD} spill")
        stage = (config.block_m + accumulators * block_n) * config.block_k * itemsize
        if config.num_stages * stage > device.smem_bytes:
            return (f"{kernel} kernel: {config.num_stages} stages of {stage} bytes exceed the "
                    f"{device.smem_bytes} bytes of shared memory")
    return None


def default_rule(spec: BlockwiseFFNSpec, device: DeviceInfo) -> list[tuple[int | None, Config]]:
    """Small tiles for a few hundred rows (more programs than SMs), else 128x256x64 tiles with 8 warps
    and 3 stages, the shape Triton's own H100 matmul configs favour for large bf16 GEMMs (128x128
    for SwiGLU's up kernel, whose two accumulators make it as wide). The fusion block is the largest
    allowed: it bounds memory, and fewer blocks mean fewer launches."""
    if device.is_interpreter:
        return [(None, Config(32, 16, 16, 32, 16, 1, 1))]
    stages = 3 if spec.dtype != "fp32" else 2
    up = 128 if spec.ffn == "swiglu" else 256
    return [
        (512, Config(1024, 64, 64, 64, 64, 4, stages)),
        (None, Config(4096, 128, up, 256, 64, 8, stages)),
    ]
