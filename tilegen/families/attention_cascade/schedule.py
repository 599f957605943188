"""The cascade's work list: which tile of which node reads which chunk of its keys, and where
each token's partial states go. Made on the host once per plan, from the levels' page tables.

A node's query rows (tokens x a KV head's query heads) are cut into tiles; its keys into
chunks sized so that each launch's work (tiles x keys x KV heads) fills its programs per SM:
the shared levels' tiles are one launch, the last level's another. Each (tile, chunk) is a work item, and each chunk a
state of every token under the node: a token's states are numbered level by level, so the
tokens of one node (which share their ancestors) agree on the slot a chunk takes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from tilegen.families.attention_cascade.config import CascadeConfig, chunk_keys, own_block_m

__all__ = ["HostLevel", "Schedule", "schedule", "WORK_COLS"]

#: Columns of a work item (the template's glossary names them).
WORK_COLS = 9
#: Fewest keys a chunk takes: a shorter one adds a state to merge for little balance.
_MIN_CHUNK = 256


@dataclass(frozen=True)
class HostLevel:
    """One level's page table on the host: node n holds tokens ``qo_indptr[n]:qo_indptr[n + 1]`` and
    pages ``kv_indices[kv_indptr[n]:kv_indptr[n + 1]]``, the last ``last_page_len[n]`` tokens full."""

    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: torch.Tensor
    last_page_len: list[int]

    def node_of(self, token: int) -> int:
        """The node whose query tokens include ``token`` (the last that starts at or before it)."""
        return bisect.bisect_right(self.qo_indptr, token) - 1

    def keys(self, node: int, page_size: int) -> int:
        pages = self.kv_indptr[node + 1] - self.kv_indptr[node]
        return (pages - 1) * page_size + self.last_page_len[node] if pages else 0


@dataclass(frozen=True)
class Schedule:
    work: torch.Tensor  # int32 [items, WORK_COLS], on the host
    state_base: torch.Tensor  # int32 [tokens + 1]: token t's states are state_base[t]:state_base[t + 1]
    states: int
    shared_items: int  # the first ones, the shared levels'; the rest are the last level's
    direct: bool  # every token has exactly one state: items write the output, no merge
    fused: bool  # each token's last state is one unsplit last-level item's, which merges the others
    own_block_m: int
    max_states: int

    @property
    def items(self) -> int:
        return self.work.shape[0]


def schedule(levels: list[HostLevel], tokens: int, *, q_per_kv: int, kv_heads: int, page_size: int,
             config: CascadeConfig, sm_count: int) -> Schedule:
    """The work list of ``levels`` (the last one is the per-request level) for ``tokens`` query tokens."""
    last = len(levels) - 1
    qo = levels[last].qo_indptr
    own_tokens = max((b - a for a, b in zip(qo, qo[1:])), default=1)
    own_m = own_block_m(q_per_kv, own_tokens)
    nodes = []  # (level, page start, keys, first token, tokens)
    page_offset = 0
    for index, level in enumerate(levels):
        for n in range(len(level.qo_indptr) - 1):
            n_q = level.qo_indptr[n + 1] - level.qo_indptr[n]
            n_k = level.keys(n, page_size)
            if n_q and n_k:
                nodes.append((index, page_offset + level.kv_indptr[n], n_k, level.qo_indptr[n], n_q))
        page_offset += level.kv_indices.numel()

    def tile_rows(level: int) -> int:
        return own_m if level == last else config.block_m

    chunks = {}
    for kind, block_n, programs in ((False, config.block_n, sm_count * config.ctas_per_sm),
                                    (True, config.own_block_n, sm_count * config.own_ctas_per_sm)):
        work = sum(math.ceil(n_q * q_per_kv / tile_rows(lv)) * n_k
                   for lv, _, n_k, _, n_q in nodes if (lv == last) == kind) * kv_heads
        chunks[kind] = chunk_keys(block_n, work, programs, _MIN_CHUNK)

    count = [0] * tokens
    owned = [False] * tokens  # the token's last state is an unsplit last-level item's
    items = []
    for lv, page_start, n_k, q_start, n_q in nodes:
        own = lv == last
        chunk = chunks[own]
        splits = math.ceil(n_k / chunk)
        base = count[q_start]
        for t in range(q_start, q_start + n_q):
            count[t] += splits
            owned[t] = own and splits == 1
        rows = tile_rows(lv)
        for row0 in range(0, n_q * q_per_kv, rows):
            for s in range(splits):
                items.append((page_start, n_k, q_start, n_q, row0, s * chunk, min(n_k, (s + 1) * chunk), base + s,
                              int(own)))
    # Shared tiles first (the first launch takes them), long chunks first, so short items fill in behind.
    items.sort(key=lambda it: (it[8], -(it[6] - it[5])))
    # On the host whatever the default device (torch.set_default_device): the schedule is read here, then moved.
    work = torch.tensor(items, dtype=torch.int32, device="cpu").reshape(-1, WORK_COLS)
    counts = torch.tensor(count, dtype=torch.int64, device="cpu")
    state_base = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    max_states = int(counts.max()) if tokens else 0
    direct = bool(tokens) and bool((counts == 1).all())
    shared = sum(1 for it in items if not it[8])
    return Schedule(work=work, state_base=state_base, states=int(counts.sum()), shared_items=shared,
                    direct=direct, fused=not direct and all(owned), own_block_m=own_m, max_states=max_states)
