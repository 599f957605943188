"""Plain torch gradients of attention that define the backward family's semantics."""

from __future__ import annotations

import math

import torch

from tilegen.families.attention_fwd.reference import allowed_keys

__all__ = ["attention_backward_reference"]


def attention_backward_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
    causal: bool = False, window: tuple[int | None, int | None] | None = None, softcap: float | None = None,
    scale: float | None = None, dlse: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in ``compute_dtype`` for ``out, lse = attention(q, k, v)`` with output gradient
    ``dout`` and LSE gradient ``dlse`` (``None``: the LSE was not used). The derivation written out,
    not autograd, so that tests can also hold it against autograd of the forward reference:
    dV = P^T dO; dS = P * (dO V^T - rowsum(dO * O) + dLse); through the softcap, times 1 - tanh^2;
    dQ = scale dS K, dK = scale dS^T Q; GQA sums dK and dV over each group's query heads."""
    batch, heads_q, n_q, _ = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    qf, kf, vf, dof = (t.to(compute_dtype) for t in (q, k, v, dout))
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bhmd,bhnd->bhmn", qf, kf) * scale
    if softcap is not None:
        tanh = torch.tanh(s / softcap)
        s = softcap * tanh
    keep = allowed_keys(n_q, n_k, causal=causal, window=window, device=q.device)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    # Clamped so that a row with no key has p = 0; a NaN of the inputs stays NaN.
    p = torch.exp(s - lse.clamp_min(torch.finfo(compute_dtype).min))
    out = p @ vf
    dv = p.transpose(-1, -2) @ dof
    delta = (dof * out).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(compute_dtype).unsqueeze(-1)
    ds = p * (dof @ vf.transpose(-1, -2) - delta)
    if softcap is not None:
        ds = ds * (1 - tanh * tanh)
    ds = ds * scale
    dq = ds @ kf
    dk = ds.transpose(-1, -2) @ qf
    # Dims spelled out: with n_k == 0 a -1 would be ambiguous.
    dk = dk.view(batch, heads_kv, group, n_k, k.shape[-1]).sum(2)
    dv = dv.view(batch, heads_kv, group, n_k, v.shape[-1]).sum(2)
    return dq, dk, dv
