"""Plain torch norm + FFN + residual that defines the family's semantics, in float64.

``out = x + ffn(norm(x))`` with, per row, ``rmsnorm(x) = x / sqrt(mean(x^2) + eps) * w`` or
``layernorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * w + b`` (biased variance), and
``swiglu(xn) = (silu(xn @ w_gate^T) * (xn @ w_up^T)) @ w_down^T`` or
``gelu_mlp(xn) = gelu(xn @ w_up^T) @ w_down^T`` (exact erf GELU). Weights are in
``torch.nn.Linear``'s ``[out, in]`` layout.
"""

from __future__ import annotations

import torch

__all__ = ["norm_reference", "ffn_reference"]


def norm_reference(x, weight, bias, *, norm: str, eps: float) -> torch.Tensor:
    x = x.double()
    if norm == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return y + bias.double() if norm == "layernorm" else y


def ffn_reference(x, w_norm, b_norm, w_gate, w_up, w_down, *, norm: str, ffn: str, eps: float) -> torch.Tensor:
    """``x + ffn(norm(x))`` in float64 for ``x`` [..., d_model]; ``w_gate`` is ignored (may be None) for ``gelu_mlp``."""
    xn = norm_reference(x, w_norm, b_norm, norm=norm, eps=eps)
    up = xn @ w_up.double().T
    if ffn == "swiglu":
        h = torch.nn.functional.silu(xn @ w_gate.double().T) * up
    else:
        h = torch.nn.functional.gelu(up)
    return x.double() + h @ w_down.double().T
