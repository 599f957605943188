"""Lowering of the paged-KV append family: every decision, as plain template values."""

from __future__ import annotations

from typing import Any

import triton

from tilegen.families.kv_append.spec import KVAppendSpec

__all__ = ["lower", "MAX_BLOCK_ELEMENTS"]

#: Elements of one program's [BLOCK_T, dim] block: past this a row block no longer fits in registers.
MAX_BLOCK_ELEMENTS = 64 * 1024


def lower(spec: KVAppendSpec) -> dict[str, Any]:
    dim_pad = triton.next_power_of_2(spec.head_dim)
    dim_v_pad = triton.next_power_of_2(spec.dv)
    return {
        "kernel_name": f"_{spec.name}_kernel",
        "head_dim": spec.head_dim,
        "head_dim_v": spec.dv,
        "head_dim_pad": dim_pad,
        "head_dim_v_pad": dim_v_pad,
        "head_dim_max_pad": max(dim_pad, dim_v_pad),
        "masked_d": dim_pad != spec.head_dim,
        "masked_dv": dim_v_pad != spec.dv,
        "page_size": spec.page_size,
        # Page sizes are powers of two: position -> (page, slot) is a shift and a mask.
        "page_shift": spec.page_size.bit_length() - 1,
        "max_block_elements": MAX_BLOCK_ELEMENTS,
    }
