"""Ragged and paged attention configs: the dense family's tiles, warps and stages, and on Hopper the dense
family's warp-specialized Gluon kernel (``wgmma``), its descriptors viewing the packed tensors whole, or the
pages as one tensor of slots that the loader copies a page at a time."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from tilegen.device import DeviceInfo
from tilegen.families.attention_fwd import config as dense
from tilegen.families.attention_fwd.config import TileConfig, has_wgmma, wgmma_unsupported
from tilegen.families.lowering import gluon_widths

__all__ = ["VarlenConfig", "search_space", "feasible", "default_rule", "ragged_wgmma_unsupported"]


@dataclass(frozen=True, order=True)
class VarlenConfig(TileConfig):
    """Launch parameters of one ragged or paged attention kernel."""

    # 2: the dense family's warp-specialized Gluon kernel (a loader warp, two consumer warpgroups of 64 rows)
    # over the packed sequences or the pages, its programs taking the tiles in turns (a program a tile for long
    # causal sequences); 3: as 2, the consumers taking turns (ping-pong).
    wgmma: int = 0

    choices = MappingProxyType({"wgmma": (0, 2, 3)})

    def __str__(self) -> str:
        return super().__str__() + {0: "", 2: "-ws", 3: "-ws-pp"}[self.wgmma]


def ragged_wgmma_unsupported(spec) -> str | None:
    """Why the Gluon kernel does not run ``spec``'s ragged or paged batches, or ``None`` when it does."""
    if spec.kv_layout == "paged":
        if spec.kv_dtype is not None:
            return f"kv_dtype={spec.kv_dtype!r}: the Gluon kernel reads pages of the queries' dtype"
        if spec.page_size % 8:
            # Each page's copy lands in its rows of the key block, at whole 8-row groups of the 128-byte swizzle.
            return f"page_size={spec.page_size}: the Gluon kernel copies pages of a multiple of 8 slots"
    if spec.score_mod is not None or spec.mask_mod is not None or spec.softcap:
        return "score_mod, mask_mod, softcap: the ragged Gluon kernel takes none of them"
    in_parts = gluon_widths(spec.head_dim, spec.dv)[0] == 192 and spec.dv >= 64
    if (spec.head_dim != spec.dv or spec.head_dim > 128) and not in_parts:
        # The ragged tile's store (through pointers: its last rows may be the next sequence's) takes V's columns up
        # to 128: past that the dense kernel stages its output in Q's buffer and releases it after a TMA store.
        # A QK of 136 to 192 above such a V is read in 64-column parts, as the dense kernel reads it.
        return (f"head dims {spec.head_dim}/{spec.dv}: the ragged Gluon kernel takes equal ones from 64 to 128, or a "
                f"QK of 136 to 192 above a V of 64 to 128")
    return wgmma_unsupported(spec)


def _offered(spec, device: DeviceInfo) -> bool:
    return has_wgmma(device) and ragged_wgmma_unsupported(spec) is None


def search_space(spec, device: DeviceInfo) -> dict[str, list[int]]:
    return {**dense.tile_space(device), "wgmma": [0, 2, 3] if _offered(spec, device) else [0]}


def feasible(spec, config: VarlenConfig, device: DeviceInfo) -> str | None:
    knobs = config.to_dict()
    if config.wgmma:
        reason = ragged_wgmma_unsupported(spec)
        if reason is not None:
            return f"wgmma={config.wgmma}: {reason}"
        if config.block_m != 128:
            return f"wgmma={config.wgmma}: two consumer warpgroups of 64 rows, so BM128 with 8 warps, not {config}"
    # The dense checks of tiles, registers, shared memory and of the Gluon kernel (which reads through TMA); the
    # ragged launcher stages the output only where its buffer fits (the kernel's TMA_STORE), else stores it from
    # the accumulators, so the dense check leaves that buffer out.
    return dense.feasible(spec, dense.Config(**knobs, tma=int(config.wgmma > 0)), device, output_buffer=False)


def default_rule(spec, device: DeviceInfo) -> list[tuple[int | None, VarlenConfig]]:
    """The dense family's rule as it stood before its TMA knob, fitted on dense causal bf16 grids on
    an H200 (these kernels share that inner loop); for ragged and paged batches on Hopper from 512 tokens on, the
    dense rule's warp-specialized configs (the bucket here is the longest sequence)."""
    if device.is_interpreter:
        return [(None, VarlenConfig(32, 32, 4, 1))]
    if spec.dtype == "fp32":
        return [(None, VarlenConfig(64, 32, 4, 2))]
    dim = max(spec.head_dim, spec.dv)
    if dim <= 64:
        rule = [(1024, VarlenConfig(64, 64, 4, 3)), (None, VarlenConfig(128, 64, 8, 3))]
    elif dim <= 128:
        rule = [(1024, VarlenConfig(64, 32, 4, 3)), (None, VarlenConfig(128, 128, 8, 3))]
    elif _offered(spec, device):
        # A QK of 192 in parts above a narrower V (DeepSeek's 192/128): the dense rule's tile past 128 columns.
        return [(256, VarlenConfig(64, 32, 4, 2)), (None, VarlenConfig(128, 64, 8, 2, wgmma=2))]
    else:
        return [(None, VarlenConfig(64, 32, 4, 2))]
    if _offered(spec, device):
        ws = VarlenConfig(128, 128, 8, 2, wgmma=2)
        short = [(1024, VarlenConfig(128, 64, 8, 3, wgmma=2))] if spec.mask == "causal" and dim > 64 else []
        rule = [(256, rule[0][1]), *short, (None, ws)]
    return rule
