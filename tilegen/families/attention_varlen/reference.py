"""The float64 reference of ragged and paged attention: gather each sequence, run the dense reference."""

from __future__ import annotations

import torch

from tilegen.families.attention_fwd.reference import attention_reference

__all__ = ["gather_pages", "varlen_reference"]


def gather_pages(pages: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                 b: int) -> torch.Tensor:
    """Sequence ``b``'s tokens ``[n, kv_heads, dim]``, read from its pages in order."""
    start, end = int(indptr[b]), int(indptr[b + 1])
    if end == start:
        return pages.new_empty((0, *pages.shape[2:]))
    rows = pages[indices[start:end].long()].reshape(-1, *pages.shape[2:])
    return rows[: (end - start - 1) * pages.shape[1] + int(last_page_len[b])]


def varlen_reference(q, k_seqs, v_seqs, cu_seqlens_q, *, causal=False, window=None, softcap=None, scale=None,
                     compute_dtype=torch.float64, score_mod=None, mask_mod=None, paged_positions=False):
    """``(out [total_q, heads, dv], lse [total_q, heads])`` for packed queries; ``k_seqs[b]``,
    ``v_seqs[b]`` are sequence ``b``'s keys and values ``[n_k, kv_heads, dim]``. Mods see ``b`` as the
    sequence's index and positions within it: query ``i`` at ``q_idx = i`` (``varlen_attention``'s), or
    with ``paged_positions`` at ``n_k - n_q + i``, its position among the keys (the paged ops')."""
    total, heads = q.shape[:2]
    out = torch.zeros(total, heads, v_seqs[0].shape[-1] if v_seqs else q.shape[-1], dtype=compute_dtype,
                      device=q.device)
    lse = torch.full((total, heads), float("-inf"), dtype=compute_dtype, device=q.device)
    for b in range(cu_seqlens_q.numel() - 1):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if end == start:
            continue
        k, v = k_seqs[b], v_seqs[b]
        o, s = attention_reference(
            q[start:end].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            causal=causal, window=window, softcap=softcap, scale=scale, compute_dtype=compute_dtype,
            score_mod=score_mod, mask_mod=mask_mod, batch_ids=torch.tensor([b], device=q.device),
            q_offset=k.shape[0] - (end - start) if paged_positions else 0,
        )
        out[start:end] = o[0].transpose(0, 1)
        lse[start:end] = s[0].transpose(0, 1)
    return out, lse
