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


def sequence_lengths(indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> list[int]:
    """Tokens per sequence that the page table describes, as host ints."""
    pages = (indptr[1:] - indptr[:-1]).tolist()
    return [(n - 1) * page_size + int(last) if n > 0 else 0 for n, last in zip(pages, last_page_len.tolist())]


def target_slots(indptr, indices, last_page_len, cu_seqlens, page_size: int) -> list[tuple[int, int, int]]:
    """``(token, page, slot)`` for every new token, in token order."""
    lens = sequence_lengths(indptr, last_page_len, page_size)
    cu, ptr, idx = cu_seqlens.tolist(), indptr.tolist(), indices.tolist()
    slots = []
    for b, seq_len in enumerate(lens):
        n_new = cu[b + 1] - cu[b]
        if n_new > seq_len:
            raise ValueError(f"cu_seqlens: sequence {b} appends {n_new} tokens but holds only {seq_len}")
        for j in range(n_new):
            pos = seq_len - n_new + j
            slots.append((cu[b] + j, idx[ptr[b] + pos // page_size], pos % page_size))
    return slots


def append_reference(k_pages, v_pages, indptr, indices, last_page_len, k, v, cu_seqlens):
    """Return ``(k_pages, v_pages, written)``: float64 copies of the pages with the new tokens written,
    and a bool ``[num_pages, page_size]`` that is True exactly at the slots the append writes."""
    page_size = k_pages.shape[1]
    k_out = k_pages.detach().to("cpu", torch.float64).clone()
    v_out = v_pages.detach().to("cpu", torch.float64).clone()
    written = torch.zeros(k_pages.shape[:2], dtype=torch.bool)
    k64, v64 = k.detach().to("cpu", torch.float64), v.detach().to("cpu", torch.float64)
    host = [t.detach().cpu() for t in (indptr, indices, last_page_len, cu_seqlens)]
    for token, page, slot in target_slots(*host, page_size):
        if written[page, slot]:
            raise ValueError(f"indices: page {page} slot {slot} is the target of two tokens")
        written[page, slot] = True
        k_out[page, slot] = k64[token]
        v_out[page, slot] = v64[token]
    return k_out, v_out, written
