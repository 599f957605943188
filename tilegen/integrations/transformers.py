"""tilegen attention inside Hugging Face transformers models, through their ``AttentionInterface``.

    from tilegen.integrations import transformers as tilegen_hf
    tilegen_hf.register()   # once per process, before the model's first forward
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="tilegen")

transformers is imported by ``register()`` only, never when tilegen is.
"""

from __future__ import annotations

from typing import Any

import torch

from tilegen.ops.attention import attention

__all__ = ["NAME", "attention_forward", "register"]

#: The ``attn_implementation`` name ``register()`` uses by default.
NAME = "tilegen"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function contract: ``query`` ``[batch, heads, n_q, head_dim]``, ``key`` and
    ``value`` ``[batch, kv_heads, n_k, head_dim]`` (not repeated: GQA from the head counts); returns
    ``(output [batch, n_q, heads, head_dim], None)``.

    Causal when the module is (``module.is_causal``, or an ``is_causal`` keyword), aligned bottom-right.
    The mask builder ``register()`` installs (SDPA's) gives ``attention_mask=None`` when the mask is the
    plain causal one (no padding, no packed sequences); any mask tensor (padding, packed sequences, a
    static cache's) raises ``NotImplementedError``, as do dropout and attention sinks.
    """
    if attention_mask is not None:
        raise NotImplementedError(
            "attention_mask: tilegen's transformers attention runs without a mask tensor; this batch needs "
            "one (padding, packed sequences or a static cache). Drop the padding (or use "
            "tilegen.varlen_attention on the packed tokens), or use attn_implementation='sdpa'")
    if dropout:
        raise NotImplementedError(f"dropout: tilegen attention has no attention dropout (got {dropout})")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("s_aux: tilegen attention has no attention sinks")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = None
    if sliding_window is not None:
        if not causal:
            raise NotImplementedError("sliding_window: tilegen's transformers attention takes it on causal layers only")
        # transformers keeps keys with kv_idx > q_idx - sliding_window.
        window = (sliding_window - 1, 0)
    out = attention(query, key, value, causal=causal, window=window, softcap=softcap, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` run ``attention_forward`` in every transformers model that
    dispatches through ``AttentionInterface``; returns ``name``.

    It also registers SDPA's mask builder under ``name``: transformers builds no mask at all for a name
    without one (so padding would be ignored silently), while SDPA's gives ``None`` for the plain
    causal mask, which ``attention_forward`` runs as ``causal=True``, and a tensor otherwise, which it refuses.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError as error:
        raise ImportError("tilegen.integrations.transformers.register: needs transformers with AttentionInterface "
                          "and masking_utils.AttentionMaskInterface") from error
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name
