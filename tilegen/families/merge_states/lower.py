"""Lowering of the merge-states family: every decision, as plain template values."""

from __future__ import annotations

from typing import Any

import triton

from tilegen.families.merge_states.spec import MergeStatesSpec

__all__ = ["lower", "MAX_BLOCK_ELEMENTS"]

#: Elements of one program's [BLOCK_R, dim] block (three are live: o_a, o_b, the result).
MAX_BLOCK_ELEMENTS = 16 * 1024


def lower(spec: MergeStatesSpec) -> dict[str, Any]:
    dim_pad = triton.next_power_of_2(spec.head_dim)
    return {
        "kernel_name": f"_{spec.name}_kernel",
        "head_dim": spec.head_dim,
        "head_dim_pad": dim_pad,
        "masked_d": dim_pad != spec.head_dim,
        "max_block_elements": MAX_BLOCK_ELEMENTS,
    }
