"""Ragged and paged attention configs: the dense family's tiles, warps and stages, without its
TMA knob (these kernels find each sequence's keys through cumulative lengths or a page table,
which a descriptor of one dense tensor does not describe)."""

from __future__ import annotations

from dataclasses import dataclass

from tilegen.device import DeviceInfo
from tilegen.families import base
from tilegen.families.attention_fwd import config as dense

__all__ = ["VarlenConfig", "search_space", "feasible", "default_rule"]


@dataclass(frozen=True, order=True)
class VarlenConfig(base.Config):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"BM{self.block_m}-BN{self.block_n}-w{self.num_warps}-s{self.num_stages}"


def search_space(spec, device: DeviceInfo) -> dict[str, list[int]]:
    space = dense.search_space(spec, device)
    space.pop("tma", None)
    return space


def feasible(spec, config: VarlenConfig, device: DeviceInfo) -> str | None:
    return dense.feasible(spec, dense.Config(**config.to_dict()), device)


def default_rule(spec, device: DeviceInfo) -> list[tuple[int | None, VarlenConfig]]:
    rule = [(largest, VarlenConfig(c.block_m, c.block_n, c.num_warps, c.num_stages))
            for largest, c in dense.default_rule(spec, device)]
    # The dense rule's TMA switch splits a bound whose tiles are the same here: merge such neighbours.
    return [entry for i, entry in enumerate(rule) if i + 1 == len(rule) or rule[i + 1][1] != entry[1]]
