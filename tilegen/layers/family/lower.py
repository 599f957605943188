"""Lowering of the blockwise layer family: every decision about the schedule, as plain template values."""

from __future__ import annotations

from typing import Any

from tilegen.layers.family.spec import BlockwiseLayerSpec

__all__ = ["lower"]


def lower(spec: BlockwiseLayerSpec) -> dict[str, Any]:
    attention, ffn = spec.parts()
    if spec.window:
        keys = "causal_window" if spec.causal else "window"
    else:
        keys = "causal" if spec.causal else "full"
    return {
        "d_model": spec.d_model,
        "d_ffn": spec.d_ffn,
        "heads_q": spec.heads_q,
        "heads_kv": spec.heads_kv,
        "head_dim": spec.head_dim,
        "norm_kind": spec.norm,
        "layernorm": spec.norm == "layernorm",
        "swiglu": spec.ffn == "swiglu",
        "rope": spec.rope,
        "softcap": spec.softcap,
        # With no key after a token's own, the keys a block sees are its own and earlier ones: each
        # block projects its K and V when it comes, and no pass over the whole sequence goes first.
        "progressive": spec.causal,
        # Which keys a block sees: all ("full"), those up to its last token ("causal"), a window
        # left of it ("causal_window"), or a window on both sides ("window", where attention's
        # bottom-right alignment needs the window shifted per block).
        "keys": keys,
        "attention_spec_name": attention.name,
        "ffn_spec_name": ffn.name,
    }
