"""Lowering values several families' templates share."""

from __future__ import annotations

from typing import Any

import triton

__all__ = ["head_dim_values"]


def head_dim_values(head_dim: int, head_dim_v: int) -> dict[str, Any]:
    """Head dims, padded to the power of two ``tl.arange`` needs, and whether the padding is masked."""
    dim_pad = triton.next_power_of_2(head_dim)
    dim_v_pad = triton.next_power_of_2(head_dim_v)
    return {
        "head_dim": head_dim,
        "head_dim_v": head_dim_v,
        "head_dim_pad": dim_pad,
        "head_dim_v_pad": dim_v_pad,
        "masked_d": dim_pad != head_dim,
        "masked_dv": dim_v_pad != head_dim_v,
    }
