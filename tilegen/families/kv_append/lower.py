"""Lowering of the paged-KV append family: every decision, as plain template values."""

from __future__ import annotations

from typing import Any

from tilegen.dtypes import FP8_MAX
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
        # FP8 pages: the new rows are quantized, saturating at the format's largest finite value.
        "quantize": spec.page_dtype is not None,
        **_fp8_values(spec.page_dtype),
    }


def _fp8_values(page_dtype: str | None) -> dict[str, Any]:
    """The FP8 format's grid, for the template's rounding: mantissa bits, the smallest normal, and the
    magic number whose fp32 ulp is the subnormal step (adding it rounds a subnormal to the grid)."""
    if page_dtype is None:
        return {}
    mant, min_exp = {"fp8e4m3": (3, -6), "fp8e5m2": (2, -14)}[page_dtype]
    return {"fp8_max": FP8_MAX[page_dtype], "fp8_mant": mant, "fp8_min_normal": repr(2.0 ** min_exp),
            "fp8_magic": repr(1.5 * 2.0 ** (min_exp - mant + 23))}
