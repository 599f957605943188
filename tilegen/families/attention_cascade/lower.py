"""Lowering of the cascade family into ``templates/attention_cascade.py.jinja``."""

from __future__ import annotations

from typing import Any

from tilegen.families.attention_cascade.spec import CascadeSpec
from tilegen.families.attention_fwd.lower import attention_values

__all__ = ["lower"]


def lower(spec: CascadeSpec) -> dict[str, Any]:
    return {**attention_values(spec), "layout": "paged", "page_size": spec.page_size}
