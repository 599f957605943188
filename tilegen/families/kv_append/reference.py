"""Plain torch append that defines the family's semantics; tests and the tuner's gate use it.

The page table describes every sequence *including* its new tokens (update it first, then
append, as FlashInfer does): sequence ``b`` holds ``seq_len[b]`` tokens and its
``n_new[b] = cu_seqlens[b + 1] - cu_seqlens[b]`` new ones go to positions
``seq_len[b] - n_new[b] .. seq_len[b] - 1``; position ``p`` lives at page
``indices[indptr[b] + p // page_size]``, slot ``p % page_size``.
"""

from __future__ import annotations

import torch

__all__ = ["append_reference", "sequence_lengths", "target_slots"]


def sequence_lengths(indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Tokens per sequence that the page table describes (int64, on the table's device)."""
    pages = (indptr[1:] - indptr[:-1]).long()
    return torch.where(pages > 0, (pages - 1) * page_size + last_page_len.long(), 0)


def target_slots(indptr, indices, last_page_len, cu_seqlens, page_size: int):
    """``(pages, slots)``: where each new token goes, in token order (int64, on the table's device)."""
    cu = cu_seqlens.long()
    n_new = cu[1:] - cu[:-1]
    lens = sequence_lengths(indptr, last_page_len, page_size)
    if bool((n_new > lens).any()) or bool((n_new < 0).any()):
        raise ValueError("cu_seqlens: a sequence appends more tokens than the page table gives it, or fewer than 0")
    seq = torch.repeat_interleave(torch.arange(len(n_new), device=cu.device), n_new)
    pos = lens[seq] - n_new[seq] + (torch.arange(len(seq), device=cu.device) - cu[seq])
    pages = indices.long()[indptr.long()[seq] + pos // page_size]
    return pages, pos % page_size


def append_reference(k_pages, v_pages, indptr, indices, last_page_len, k, v, cu_seqlens):
    """Return ``(k_pages, v_pages, written)``: float64 copies of the pages with the new tokens written,
    and a bool ``[num_pages, page_size]`` that is True exactly at the slots the append writes."""
    pages, slots = target_slots(indptr, indices, last_page_len, cu_seqlens, k_pages.shape[1])
    written = torch.zeros(k_pages.shape[:2], dtype=torch.bool, device=k_pages.device)
    written[pages, slots] = True
    if int(written.sum()) != len(pages):
        raise ValueError("indices: two new tokens share a slot")
    k_out, v_out = k_pages.double(), v_pages.double()  # copies: the inputs stay as they are
    k_out[pages, slots] = k.double()
    v_out[pages, slots] = v.double()
    return k_out, v_out, written
