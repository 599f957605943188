"""Lowering of the ragged-batch attention family into ``templates/attention_varlen.py.jinja``."""

from __future__ import annotations

from typing import Any

from tilegen.families.attention_fwd.lower import attention_values
from tilegen.families.attention_varlen.spec import VarlenAttentionSpec

__all__ = ["lower"]


def lower(spec: VarlenAttentionSpec) -> dict[str, Any]:
    if spec.kv_layout == "paged" and (spec.score_mod is not None or spec.mask_mod is not None):
        raise NotImplementedError("score_mod/mask_mod: paged KV (tilegen.PagedAttention) takes no mods yet; "
                                  "tilegen.varlen_attention over ragged KV does")
    return {**attention_values(spec), "layout": spec.kv_layout, "page_size": spec.page_size,
            # Its launch takes the mask mod's block table, over the longest sequences' positions.
            "mask_mod_blocks": spec.mask_mod is not None}
