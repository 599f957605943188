"""Lowering of the dense attention-forward family, with its config and search space.

Every decision is made here and handed to ``templates/attention_fwd.py.jinja`` as a
plain value; the template only spells the kernel out. The search space sits
beside the lowering because both read the same kernel contract (the template's
``tl.static_assert`` lines): Python never offers a config that breaks it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import triton

import tilegen
from tilegen.device import DeviceInfo
from tilegen.ir import AttentionSpec

__all__ = [
    "TEMPLATE",
    "Config",
    "ConfigError",
    "lower",
    "search_space",
    "feasible",
    "candidates",
    "default_config",
    "default_rule",
]

TEMPLATE = "attention_fwd.py.jinja"

# Rough per-thread register budget for the fp32 score tile and accumulator; past
# it the kernel spills and is never the winner, so it is not worth compiling.
_MAX_FP32_REGS_PER_THREAD = 160


class ConfigError(ValueError):
    """A config value that the kernel cannot take, naming the knob."""


@dataclass(frozen=True, order=True)
class Config:
    """Launch parameters of one attention-forward kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def to_dict(self) -> dict[str, int]:
        """The knobs by name; the names are the generated launcher's keyword arguments."""
        # Not dataclasses.asdict: its deep copy costs microseconds on the custom op's per-call path.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown knob; known: {', '.join(names)}")
        missing = [n for n in names if n not in data]
        if missing:
            raise ConfigError(f"{missing[0]}: missing")
        for n in names:
            if isinstance(data[n], bool) or not isinstance(data[n], int) or data[n] < 1:
                raise ConfigError(f"{n}: expected a positive int, got {data[n]!r}")
        return cls(**{n: data[n] for n in names})

    def __str__(self) -> str:
        return f"BM{self.block_m}-BN{self.block_n}-w{self.num_warps}-s{self.num_stages}"


def lower(spec: AttentionSpec) -> dict[str, Any]:
    """Decide everything about the generated source and return the template's values."""
    if spec.kv_layout != "contiguous":
        raise NotImplementedError(
            f"kv_layout={spec.kv_layout!r}: the dense template reads contiguous [batch, heads, seq, dim] KV only; "
            "ragged and paged KV need the serving kernels, which tilegen does not generate yet"
        )
    dim_pad = triton.next_power_of_2(spec.head_dim)
    dim_v_pad = triton.next_power_of_2(spec.dv)
    return {
        "tilegen_version": tilegen.__version__,
        "spec_json": spec.to_json(),
        "spec_json_literal": repr(spec.to_json()),
        "spec_hash": spec.hash,
        "spec_hash_literal": repr(spec.hash),
        "spec_name": spec.name,
        "kernel_name": f"_{spec.name}_kernel",
        "head_dim": spec.head_dim,
        "head_dim_v": spec.dv,
        "head_dim_pad": dim_pad,
        "head_dim_v_pad": dim_v_pad,
        "masked_d": dim_pad != spec.head_dim,
        "masked_dv": dim_v_pad != spec.dv,
        "q_per_kv": spec.q_per_kv,
        "mask": spec.mask,
        "softcap": spec.softcap,
        "return_lse": spec.return_lse,
        "heavy_tiles_first": spec.mask != "none",
        # fp32 inputs must not silently drop to tf32 inside tl.dot.
        "dot_precision_arg": ', input_precision="ieee"' if spec.dtype == "fp32" else "",
    }


def search_space(spec: AttentionSpec, device: DeviceInfo) -> dict[str, list[int]]:
    """Every knob and its values; ``feasible`` then removes what the kernel cannot run."""
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
    """``None`` when the kernel can run the config, else the reason it cannot."""
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


def candidates(spec: AttentionSpec, device: DeviceInfo) -> list[Config]:
    """The feasible part of the search space, in a stable order."""
    space = search_space(spec, device)
    configs = [
        Config(m, n, w, s)
        for m in space["block_m"]
        for n in space["block_n"]
        for w in space["num_warps"]
        for s in space["num_stages"]
    ]
    return [c for c in configs if feasible(spec, c, device) is None]


def default_rule(spec: AttentionSpec, device: DeviceInfo) -> list[tuple[int | None, Config]]:
    """The heuristic defaults as ``[(largest bucket, config), ...]``; ``None`` ends the list (every longer bucket).

    Used where the database has no tuned entry, and enqueued first by the tuner. The GPU
    rules come from exhaustive grids of causal bf16 attention on an H200, 512 to 32k
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


def default_config(spec: AttentionSpec, device: DeviceInfo, bucket: int) -> Config:
    """Heuristic config for a length bucket with no tuned entry (see ``default_rule``)."""
    for largest, config in default_rule(spec, device):
        if largest is None or bucket <= largest:
            return config
    raise AssertionError("default_rule must end with a None bound")
