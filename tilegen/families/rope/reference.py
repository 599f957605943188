"""Plain torch RoPE that defines the family's semantics; tests and the tuner's gate use it.

Rotate-half form (Llama's, GPT-NeoX's): with ``x = [x1, x2]`` split at ``head_dim / 2``,
``rotate_half(x) = [-x2, x1]`` and ``out = x * cos + rotate_half(x) * sin``, the tables holding
each token's ``cos`` and ``sin`` over the whole head (Llama's tables repeat their
``head_dim / 2`` angles twice, but any table is taken as it is).
"""

from __future__ import annotations

import torch

__all__ = ["rope_reference", "rope_tables"]


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``out`` in float64 for ``x`` ``[..., heads, head_dim]`` and ``cos``, ``sin`` ``[..., head_dim]``."""
    xd = x.double()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xd[..., half:], xd[..., :half]), dim=-1)
    return xd * cos.double()[..., None, :] + rotated * sin.double()[..., None, :]


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's fp32 ``cos`` and ``sin`` ``[*positions.shape, head_dim]``, the angles in float64."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.double()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()
