"""Plain torch attention that defines the family's semantics; tests and the tuner's gate use it."""

from __future__ import annotations

import math

import torch

from tilegen.families.attention_fwd.masks import window_bounds

__all__ = ["attention_reference", "allowed_keys"]


def allowed_keys(n_q: int, n_k: int, *, causal: bool, window: tuple[int | None, int | None] | None, device=None):
    """Boolean [n_q, n_k]: which keys each query sees.

    The diagonal is bottom-right aligned (query i sits at key i + n_k - n_q), as in
    FlashAttention; ``window=(left, right)`` keeps keys within ``left`` before and
    ``right`` after it, ``None`` meaning unbounded; causal means right = 0.
    """
    left, right = window_bounds(window, causal)
    # Sides past n_q + n_k reach every key anyway; clamping keeps the index arithmetic in range.
    left = None if left is None else min(left, n_q + n_k)
    right = None if right is None else min(right, n_q + n_k)
    rows = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    cols = torch.arange(n_k, device=device)[None, :]
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if right is not None:
        keep &= cols <= rows + right
    if left is not None:
        keep &= cols >= rows - left
    return keep


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
    score_mod=None,
    mask_mod=None,
    batch_ids: torch.Tensor | None = None,
    q_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, lse)`` in ``compute_dtype``; rows that see no key give 0 and -inf.

    ``score_mod``/``mask_mod`` (``tilegen.mods``) are applied as FlexAttention's reference does: once, to the
    whole score matrix, with broadcasting int64 index tensors; ``batch_ids`` are the ``b`` values of the
    batch rows (default ``arange(batch)``; a varlen reference passes the sequence's index); the mods see
    query row ``i`` at ``q_idx = q_offset + i`` (the paged ops' positions, or a slice of the rows).
    """
    n_q, n_k = q.shape[-2], k.shape[-2]
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = (t.to(compute_dtype) for t in (q, k, v))
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bhmd,bhnd->bhmn", qf, kf) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    keep = allowed_keys(n_q, n_k, causal=causal, window=window, device=q.device)
    if score_mod is not None or mask_mod is not None:
        arange = lambda n: torch.arange(n, device=q.device)  # noqa: E731
        b = (arange(q.shape[0]) if batch_ids is None else batch_ids).view(-1, 1, 1, 1)
        idx = (b, arange(q.shape[1]).view(1, -1, 1, 1), (arange(n_q) + q_offset).view(1, 1, -1, 1), arange(n_k).view(1, 1, 1, -1))
        if score_mod is not None:
            s = torch.broadcast_to(score_mod(s, *idx), s.shape).to(compute_dtype)
        if mask_mod is not None:
            keep = keep & mask_mod(*idx)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # A row with no key has lse -inf, clamped so that its p is exp(-inf) = 0, not exp(-inf - -inf) = NaN; a NaN of
    # the inputs stays NaN, as the kernels must give it.
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(compute_dtype).min))
    out = torch.einsum("bhmn,bhnd->bhmd", p, vf)
    return out, lse
