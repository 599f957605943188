"""Lowering of the batch-decode family into ``templates/attention_decode.py.jinja``."""

from __future__ import annotations

from typing import Any

from tilegen.families.attention_decode.spec import DecodeSpec
from tilegen.families.attention_fwd.lower import attention_values

__all__ = ["lower"]


def lower(spec: DecodeSpec) -> dict[str, Any]:
    return {**attention_values(spec), "layout": spec.kv_layout, "page_size": spec.page_size,
            "q_tokens": spec.q_tokens}
