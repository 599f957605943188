"""Decode configs: key block, warps, stages, and how many CTAs per SM the split rule aims for."""

from __future__ import annotations

import math
from dataclasses import dataclass

import triton

from tilegen.device import DeviceInfo
from tilegen.families import base
from tilegen.families.attention_decode.spec import DecodeSpec

__all__ = ["DecodeConfig", "search_space", "feasible", "default_rule", "split_count", "query_rows_pad", "MAX_SPLITS"]

#: More splits than this only add merge work. MQA at one long sequence has a single (sequence,
#: KV head) program per split, so filling the H200's 132 SMs takes over 64 splits: on the H200,
#: 1 x 131072 MQA read 1820 GB/s of KV at 128 splits.
MAX_SPLITS = 128


@dataclass(frozen=True, order=True)
class DecodeConfig(base.Config):
    block_n: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int

    def __str__(self) -> str:
        return f"BN{self.block_n}-w{self.num_warps}-s{self.num_stages}-c{self.ctas_per_sm}"


def search_space(spec: DecodeSpec, device: DeviceInfo) -> dict[str, list[int]]:
    if device.is_interpreter:
        return {"block_n": [16, 32], "num_warps": [4], "num_stages": [1], "ctas_per_sm": [1, 2]}
    return base.with_smaller({"block_n": [32, 64, 128], "num_warps": [2, 4, 8], "num_stages": [2, 3, 4],
                              "ctas_per_sm": [1, 2, 3, 4, 6, 8]}, device, block_n=(16,), num_stages=(1,))


def query_rows_pad(spec: DecodeSpec) -> int:
    """BLOCK_M: a KV head's query heads times tokens, padded to a power of two of at least 16."""
    return max(16, triton.next_power_of_2(spec.q_per_kv * spec.q_tokens))


def feasible(spec: DecodeSpec, config: DecodeConfig, device: DeviceInfo) -> str | None:
    if config.block_n % 16 or config.block_n & (config.block_n - 1):
        return f"block_n={config.block_n}: the template asserts a power of two and a multiple of 16"
    if query_rows_pad(spec) * triton.next_power_of_2(spec.dv) > 128 * 256:
        return f"{spec.q_per_kv * spec.q_tokens} query rows per KV head: the accumulator does not fit in registers"
    if device.is_interpreter:
        return None
    dim_pad = triton.next_power_of_2(spec.head_dim)
    dim_v_pad = triton.next_power_of_2(spec.dv)
    elt = 4 if spec.dtype == "fp32" else 2
    block_m = query_rows_pad(spec)
    smem = (block_m * dim_pad + config.num_stages * config.block_n * (dim_pad + dim_v_pad)) * elt
    if smem > device.smem_bytes:
        return f"~{smem} bytes of shared memory against the device's {device.smem_bytes}"
    return None


def default_rule(spec: DecodeSpec, device: DeviceInfo) -> list[tuple[int | None, DecodeConfig]]:
    """Memory-bound: small tiles, few warps (the tile's arithmetic is tiny, and small CTAs let several
    share an SM), and splits for three CTAs per SM. On the H200 (bf16, 32/8 heads, d128, page 16)
    BN64-w2-s2-c3 read 4055-4163 GB/s of KV at 64 x 4096, 256 x 1024 and 4 x 65536, and 3806 at
    1 x 131072, against 3670-4011 and 3787 for the previous BN64-w4-s3-c2 (the best of every config and
    split count: 4081-4173 and 3823)."""
    if device.is_interpreter:
        return [(None, DecodeConfig(32, 4, 1, 1))]
    if spec.dtype == "fp32" or max(spec.head_dim, spec.dv) > 128:
        return [(None, DecodeConfig(32, 4, 2, 2))]
    return [(None, DecodeConfig(64, 2, 2, 3))]


def split_count(config: DecodeConfig, device: DeviceInfo, batch: int, kv_heads: int, max_context: int) -> int:
    """Splits per sequence so that batch x KV heads x splits reaches ``ctas_per_sm`` CTAs per SM,
    never more than the longest context has key blocks (nor ``MAX_SPLITS``)."""
    programs = max(1, batch * kv_heads)
    wanted = math.ceil(device.sm_count * config.ctas_per_sm / programs)
    blocks = max(1, math.ceil(max_context / config.block_n))
    return max(1, min(wanted, blocks, MAX_SPLITS))
