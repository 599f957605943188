"""Lowering of the dense attention-forward family: every decision, as plain template values.

``templates/attention_fwd.py.jinja`` (and the shared pieces it includes) only spells
the kernel out from these values.
"""

from __future__ import annotations

from typing import Any

from tilegen.dtypes import TORCH_DTYPES
from tilegen.families.attention_fwd.config import wgmma_unsupported
from tilegen.families.attention_fwd.spec import AttentionSpec
from tilegen.families.lowering import gluon_widths, head_dim_values
from tilegen.mods.lower import mod_values

__all__ = ["lower", "attention_values", "gluon_dims"]


def lower(spec: AttentionSpec) -> dict[str, Any]:
    if spec.kv_layout != "contiguous":
        raise NotImplementedError(
            f"kv_layout={spec.kv_layout!r}: the dense template reads contiguous [batch, heads, seq, dim] KV only; "
            "ragged and paged KV are the attention_varlen family's (tilegen.varlen_attention, tilegen.PagedAttention)"
        )
    wgmma = wgmma_unsupported(spec) is None
    return {**attention_values(spec), "layout": "dense", "tma": True, "wgmma": wgmma,
            **gluon_dims(spec),
            # Its launch takes the mask mod's block table: empty blocks skipped, whole ones unmasked.
            "mask_mod_blocks": spec.mask_mod is not None}


def gluon_dims(spec) -> dict[str, Any]:
    """The warp-specialized Gluon kernel's columns, for the families that run it (dense, ragged and paged):
    tilegen.families.lowering.gluon_widths, a QK of 192 read in three 64-column parts, each copied and multiplied
    on its own."""
    width, width_v = gluon_widths(spec.head_dim, spec.dv)
    return {"wgmma_dim": width, "wgmma_dim_v": width_v, "qk_chunks": 3 if width == 192 else 1}


def attention_values(spec) -> dict[str, Any]:
    """The values every attention template takes, from the fields every attention spec has."""
    return {
        "kernel_name": f"_{spec.name}_kernel",
        **head_dim_values(spec.head_dim, spec.dv),
        "q_per_kv": spec.q_per_kv,
        "mask": spec.mask,
        "softcap": spec.softcap,
        "return_lse": spec.return_lse,
        "heavy_tiles_first": spec.mask != "none",
        # fp32 inputs must not silently drop to tf32 inside tl.dot.
        "dot_precision_arg": ', input_precision="ieee"' if spec.dtype == "fp32" else "",
        # Only the dense forward kernel takes TMA descriptors (its config's tma knob).
        "tma": False,
        # The Gluon kernels over a packed batch (attention_varlen's layouts), and over its pages.
        "ragged": False,
        "paged": False,
        # The Gluon kernels' element type: Gluon names its dtypes as torch does.
        "wgmma_dtype": str(TORCH_DTYPES[spec.dtype]).removeprefix("torch."),
        # FP8 pages (the paged families' kv_dtype): loaded as fp8 and widened for the dots, in fp16 for a
        # bf16 query (common/kv_fp8_query). Families whose specs have no kv_dtype read none.
        "kv_fp8": getattr(spec, "kv_dtype", None) is not None,
        "fp8_dot_fp16": getattr(spec, "kv_dtype", None) is not None and spec.dtype == "bf16",
        # Families whose specs have no mods render none.
        **mod_values(getattr(spec, "score_mod", None), getattr(spec, "mask_mod", None)),
    }
