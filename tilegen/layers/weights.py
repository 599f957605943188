"""Reading a Llama-style layer's weights (a state dict or a module) and checking them against a config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tilegen.layers.config import LayerConfig

__all__ = ["as_state_dict", "check_weights", "config_from_weights"]


def as_state_dict(source: Any) -> dict[str, torch.Tensor]:
    """``source``'s tensors by Llama name: a mapping as it is, a module by its ``state_dict()``
    (a ``LlamaDecoderLayer`` gives exactly these names). Buffers such as a rotary embedding's
    ``inv_freq`` are not weights and are dropped."""
    if isinstance(source, torch.nn.Module):
        source = source.state_dict()
    if not isinstance(source, Mapping):
        raise TypeError(f"weights: expected a dict of tensors or a torch.nn.Module, got {type(source).__name__}")
    return {name: value for name, value in source.items() if not name.endswith("inv_freq")}


def check_weights(weights: Mapping[str, torch.Tensor], config: LayerConfig, *, dtype=None, device=None) -> None:
    """Raise naming the weight when one is missing, unexpected, of the wrong shape, dtype or device."""
    expected = config.weight_shapes()
    for name in weights:
        if name not in expected:
            hint = " (Llama-style layers have no projection biases)" if name.endswith("proj.bias") else ""
            raise ValueError(f"{name}: not a weight of this layer{hint}; expected: {', '.join(expected)}")
    for name, shape in expected.items():
        if name not in weights:
            raise ValueError(f"{name}: missing (norm={config.norm!r}, ffn={config.ffn!r} need it)")
        w = weights[name]
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(w).__name__}")
        if tuple(w.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} for d_model={config.d_model}, heads "
                             f"{config.heads_q}/{config.heads_kv} of dim {config.head_dim}, d_ffn={config.d_ffn}; "
                             f"got {tuple(w.shape)}")
        if dtype is not None and w.dtype != dtype:
            raise TypeError(f"{name}: dtype {w.dtype} differs from the input's {dtype}")
        if device is not None and w.device != device:
            raise ValueError(f"{name}: on {w.device} while the input is on {device}")


def config_from_weights(weights: Mapping[str, torch.Tensor], *, heads_q: int, heads_kv: int | None = None,
                        **options: Any) -> LayerConfig:
    """The config whose weights these are: widths from the shapes, the FFN kind from whether
    ``mlp.gate_proj.weight`` is there, the norm from whether the norms have a bias (unless given)."""
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.up_proj.weight"):
        if name not in weights:
            raise ValueError(f"{name}: missing; it gives the layer's widths")
        # Read for their shapes before check_weights sees them: a weight that is no matrix is named here.
        w = weights[name]
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(w).__name__}")
        if w.dim() != 2:
            raise ValueError(f"{name}: expected a 2-d weight [out, in], got shape {tuple(w.shape)}")
    q_out, d_model = weights["self_attn.q_proj.weight"].shape
    if isinstance(heads_q, bool) or not isinstance(heads_q, int) or heads_q < 1:
        raise ValueError(f"heads_q: expected a positive int, got {heads_q!r}")
    if q_out % heads_q:
        raise ValueError(f"heads_q: self_attn.q_proj.weight has {q_out} rows, not a multiple of heads_q={heads_q}")
    head_dim = q_out // heads_q
    if heads_kv is None:
        k_out = weights["self_attn.k_proj.weight"].shape[0]
        if k_out < head_dim or k_out % head_dim:
            raise ValueError(f"self_attn.k_proj.weight: {k_out} rows, not a positive multiple of the head dim "
                             f"{head_dim} (self_attn.q_proj.weight's {q_out} rows over heads_q={heads_q})")
        heads_kv = k_out // head_dim
    options.setdefault("norm", "layernorm" if "input_layernorm.bias" in weights else "rmsnorm")
    options.setdefault("ffn", "swiglu" if "mlp.gate_proj.weight" in weights else "gelu_mlp")
    return LayerConfig(d_model=d_model, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                       d_ffn=weights["mlp.up_proj.weight"].shape[0], **options)
