"""Lowering of the RoPE family: every decision, as plain template values."""

from __future__ import annotations

from typing import Any

import triton

from tilegen.families.rope.spec import RopeSpec

__all__ = ["MAX_BLOCK_ELEMENTS", "lower"]

#: Elements of one program's [BLOCK_R, head_dim / 2] half-block (both halves and both tables are live).
MAX_BLOCK_ELEMENTS = 8 * 1024


def lower(spec: RopeSpec) -> dict[str, Any]:
    half = spec.head_dim // 2
    half_pad = triton.next_power_of_2(half)
    return {
        "kernel_name": f"_{spec.name}_kernel",
        "head_dim": spec.head_dim,
        "half": half,
        "half_pad": half_pad,
        "masked_d": half_pad != half,
        "max_block_elements": MAX_BLOCK_ELEMENTS,
    }
