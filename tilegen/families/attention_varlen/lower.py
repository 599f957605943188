"""Lowering of the ragged-batch attention family into ``templates/attention_varlen.py.jinja``."""

from __future__ import annotations

from typing import Any

from tilegen.families.attention_fwd.lower import attention_values, gluon_dims
from tilegen.families.attention_varlen.config import ragged_wgmma_unsupported
from tilegen.families.attention_varlen.spec import VarlenAttentionSpec

__all__ = ["lower"]


def lower(spec: VarlenAttentionSpec) -> dict[str, Any]:
    paged = spec.kv_layout == "paged"
    return {**attention_values(spec), **gluon_dims(spec), "layout": spec.kv_layout, "page_size": spec.page_size,
            # The ragged launch takes the mask mod's block table, over the longest sequences' positions. The
            # paged one masks per element only: its table would follow each sequence's own bottom-right
            # positions, which the plan never reads on the host.
            "mask_mod_blocks": spec.mask_mod is not None and not paged,
            # The dense family's warp-specialized Gluon kernel over the packed sequences or the pages (wgmma 2, 3).
            "wgmma": ragged_wgmma_unsupported(spec) is None, "ragged": True, "paged": paged}
