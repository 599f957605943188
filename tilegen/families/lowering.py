"""Lowering values several families' templates share."""

from __future__ import annotations

from typing import Any

import triton

__all__ = ["head_dim_values", "gluon_widths"]


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


def gluon_widths(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """Columns a Gluon (wgmma) kernel reads Q and K, and V, into: powers of two, but for a QK of 129 ... 192 columns
    above a V of 128 or fewer (DeepSeek's 192/128), 192, in three 64-column parts (Triton's tiles take powers of
    two; a QK^T of three chained products spares a quarter of 256 columns' work on zeros)."""
    width, width_v = triton.next_power_of_2(head_dim), triton.next_power_of_2(head_dim_v)
    return (192 if width == 256 and head_dim <= 192 and width_v <= 128 else width), width_v
