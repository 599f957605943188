"""The float64 reference of cascade attention: each token's keys are its nodes' keys, level after
level, and the mask is the ordinary bottom-right one over them (every shared key precedes the
token, so only the last level is masked)."""

from __future__ import annotations

import torch

from tilegen.families.attention_cascade.schedule import HostLevel
from tilegen.families.attention_varlen.reference import gather_pages, varlen_reference

__all__ = ["cascade_reference", "node_of"]


def node_of(level: HostLevel, token: int) -> int | None:
    for n in range(len(level.qo_indptr) - 1):
        if level.qo_indptr[n] <= token < level.qo_indptr[n + 1]:
            return n
    return None


def cascade_reference(q, k_pages, v_pages, levels: list[HostLevel], *, causal, softcap=None, scale=None,
                      compute_dtype=torch.float64):
    """``(out [tokens, heads, dv], lse [tokens, heads])``, node by node of the last level."""
    last = levels[-1]
    k_seqs, v_seqs, cu = [], [], [0]
    for n in range(len(last.qo_indptr) - 1):
        start, end = last.qo_indptr[n], last.qo_indptr[n + 1]
        ks, vs = [], []
        if end > start:
            for level in levels:
                node = node_of(level, start)
                if node is None:
                    continue
                table = (torch.tensor(level.kv_indptr), level.kv_indices, torch.tensor(level.last_page_len))
                ks.append(gather_pages(k_pages, *table, node))
                vs.append(gather_pages(v_pages, *table, node))
        k_seqs.append(torch.cat(ks) if ks else k_pages.new_empty((0, *k_pages.shape[2:])))
        v_seqs.append(torch.cat(vs) if vs else v_pages.new_empty((0, *v_pages.shape[2:])))
        cu.append(end)
    return varlen_reference(q, k_seqs, v_seqs, torch.tensor(cu), causal=causal, softcap=softcap, scale=scale,
                            compute_dtype=compute_dtype)
