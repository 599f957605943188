"""Lowering of the blockwise FFN family: every decision, as plain template values."""

from __future__ import annotations

from typing import Any

import triton

from tilegen.families.blockwise_ffn.spec import BlockwiseFFNSpec

__all__ = ["lower", "GROUP_M"]

#: Tile rows that sweep the columns together (L2 reuse of weight tiles); 8 is what Triton's
#: matmul tutorial settles on for large GEMMs, and it cannot hurt small ones.
GROUP_M = 8


def lower(spec: BlockwiseFFNSpec) -> dict[str, Any]:
    d_model_pad = triton.next_power_of_2(spec.d_model)
    return {
        "norm_kernel": f"_{spec.name}_norm_kernel",
        "up_kernel": f"_{spec.name}_up_kernel",
        "down_kernel": f"_{spec.name}_down_kernel",
        "d_model": spec.d_model,
        "d_ffn": spec.d_ffn,
        "d_model_pad": d_model_pad,
        "norm_kind": spec.norm,
        "layernorm": spec.norm == "layernorm",
        "swiglu": spec.ffn == "swiglu",
        "group_m": GROUP_M,
        # A row of the norm kernel is about 16 fp32 values per thread: wide loads, no spills.
        "norm_warps": max(1, min(16, d_model_pad // 512)),
        # fp32 inputs keep fp32 products (not TF32), as the fp32 tolerance assumes.
        "dot_precision_arg": ', input_precision="ieee"' if spec.dtype == "fp32" else "",
    }
