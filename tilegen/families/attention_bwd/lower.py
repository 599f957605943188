"""Lowering of the attention-backward family: the template's values."""

from __future__ import annotations

from typing import Any

from tilegen.families.attention_bwd.config import wgmma_unsupported
from tilegen.families.attention_bwd.spec import AttentionBwdSpec
from tilegen.families.attention_fwd.lower import attention_values
from tilegen.mods.grad import mod_grad_values

__all__ = ["lower"]


def lower(spec: AttentionBwdSpec) -> dict[str, Any]:
    return {**attention_values(spec), "layout": spec.layout,
            # The Gluon kernels, for the specs they implement (rendered only there, so the others' modules and
            # hashes stay as they were).
            "wgmma": wgmma_unsupported(spec) is None,
            **mod_grad_values(spec.score_mod)}
