"""Lowering of the ragged-batch attention family into ``templates/attention_varlen.py.jinja``."""

from __future__ import annotations

from typing import Any

import triton

from tilegen.families.attention_varlen.spec import VarlenAttentionSpec

__all__ = ["lower"]


def lower(spec: VarlenAttentionSpec) -> dict[str, Any]:
    dim_pad = triton.next_power_of_2(spec.head_dim)
    dim_v_pad = triton.next_power_of_2(spec.dv)
    return {
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
        "layout": spec.kv_layout,
        "page_size": spec.page_size,
        "dot_precision_arg": ', input_precision="ieee"' if spec.dtype == "fp32" else "",
    }
