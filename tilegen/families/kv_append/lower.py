"""Lowering of the paged-KV append family: every decision, as plain template values."""

from __future__ import annotations

from typing import Any

from tilegen.families.kv_append.spec import KVAppendSpec
from tilegen.families.lowering import head_dim_values

__all__ = ["lower", "MAX_BLOCK_ELEMENTS"]

#: Elements of one program's [BLOCK_T, dim] block: past this a row block no longer fits in registers.
MAX_BLOCK_ELEMENTS = 64 * 1024


def lower(spec: KVAppendSpec) -> dict[str, Any]:
    dims = head_dim_values(spec.head_dim, spec.dv)
    return {
        "kernel_name": f"_{spec.name}_kernel",
        **dims,
        "head_dim_max_pad": max(dims["head_dim_pad"], dims["head_dim_v_pad"]),
        "page_size": spec.page_size,
        # Page sizes are powers of two: position -> (page, slot) is a shift and a mask.
        "page_shift": spec.page_size.bit_length() - 1,
        "max_block_elements": MAX_BLOCK_ELEMENTS,
    }
