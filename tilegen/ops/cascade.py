"""``tilegen.CascadeAttention``: attention over a prefix tree of shared pages, each prefix read once.

A batch whose requests share a prefix (a system prompt, a document asked many questions, the
samples of one prompt) already stores it once in a paged cache, where several page tables
point at the same pages; batch decode still reads it once per request. Cascade attention
(FlashInfer's multi-level cascade) describes the batch as levels: at each level a node is a
contiguous range of query tokens and the pages all of them share, the last level holding each
request's own pages. The tokens under a node read its pages in one pass (their query heads are
the rows of one tile), and each token's results over its levels are merged by their LSE.

    levels = tilegen.cascade_levels(cache)           # from page tables that share leading pages
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, levels, heads_q=32)          # once per step: the work list, on the host
    for layer in range(n_layers):
        out = cascade.run(q[layer], caches[layer])   # q [tokens, heads_q, head_dim]

``plan`` reads the levels' page tables to the host (one synchronization, as FlashInfer's plan
does) and checks them there; ``run`` allocates only its output and synchronizes nothing, so it
can be captured in a CUDA graph. Every cache a plan serves must have the planned pages' layout
(page size, heads, head dims, dtype); the levels index its pages.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tilegen import dispatch, env
from tilegen.device import device_info
from tilegen.dtypes import SPEC_DTYPES
from tilegen.families.attention_cascade import CascadeSpec
from tilegen.families.attention_cascade.problem import device_schedule
from tilegen.families.attention_cascade.schedule import HostLevel
from tilegen.families.attention_decode import DecodeSpec
from tilegen.families.attention_fwd.masks import score_scalars
from tilegen.ir import SpecError
from tilegen.ops.kv_cache import PagedKVCache, check_heads_q, page_dtypes
from tilegen.ops.planned import Planner
from tilegen.ops.tensors import check_bool, check_device, check_out, off_eager, refuse_grad

__all__ = ["CascadeAttention", "CascadeLevel", "cascade_levels"]


@dataclass(frozen=True)
class CascadeLevel:
    """One level of a prefix tree over a batch's query tokens, FlashInfer's multi-level layout.

    Node ``n`` holds query tokens ``qo_indptr[n]:qo_indptr[n + 1]`` (ranges in token order that
    cover every token) and pages ``kv_indices[kv_indptr[n]:kv_indptr[n + 1]]`` of the cache, its
    last page holding ``kv_last_page_len[n]`` tokens (1..page_size; ignored for a node without
    pages). A node of a later level lies inside one node of each earlier level. All four are
    int32 tensors, on the host or the cache's device.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


@dataclass(frozen=True)
class _Plan:
    spec: CascadeSpec
    tokens: int
    heads_q: int
    launch: Any
    launch_args: dict[str, Any]
    work: torch.Tensor
    state_base: torch.Tensor
    indices: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    choice: dispatch.Choice
    q_dtype: torch.dtype = torch.bfloat16
    cache_layout: tuple = ()
    # The cascade takes no mods: empty, as the paged plans' field is without them (tilegen.ops.planned reads it).
    mod_tensors: tuple = ()
    # The levels on the host, for run's check of its cache under TILEGEN_DEBUG
    host: tuple = ()


def _layout(cache: PagedKVCache) -> tuple:
    """What a plan fixes of a cache: page size, heads, head dims, dtype, scale kinds and page count
    (not the batch: the levels, not the cache's page table, say which pages a token reads)."""
    return cache._pages_layout + (cache.num_pages,)


class CascadeAttention(Planner):
    """Queries under a prefix tree of paged KV levels (see the module docstring)."""

    op = "tilegen.CascadeAttention.run"

    _plan: _Plan | None

    def plan(self, cache: PagedKVCache, levels: Sequence[CascadeLevel], *, heads_q: int, causal: bool = True,
             softcap: float | None = None, scale: float | None = None, return_lse: bool = False,
             q_dtype: torch.dtype | None = None) -> dispatch.Choice:
        """Fix the step's levels; returns the dispatch choice. ``causal`` masks the last level, its query
        tokens aligned bottom-right on its keys; every key of an earlier level is seen whole (it precedes
        every query token under its node). Windows are not built for levels. ``q_dtype``: the query's
        dtype, the pages' unless they are FP8 (then float16, bfloat16 or float32; bfloat16 when left out)."""
        self._refuse_plan_compiling()
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected a tilegen.PagedKVCache, got {type(cache).__name__}")
        check_heads_q(cache, heads_q)
        check_bool("causal", causal)
        check_bool("return_lse", return_lse)
        pages = cache.k_pages
        kv_dtype, q_dtype = page_dtypes(cache, q_dtype)
        device = pages.device
        check_device("cache", device, "pages")
        host = _host_levels(levels, cache)
        if causal:
            _check_causal(host, cache.page_size)
        if env.debug():
            cache.validate()
            _check_against_cache(host, cache)
        scale_value, softcap_value = score_scalars(scale, softcap, pages.shape[3])
        try:
            spec = CascadeSpec(head_dim=pages.shape[3], head_dim_v=cache.v_pages.shape[3],
                               q_per_kv=heads_q // cache.kv_heads, mask="causal" if causal else "none",
                               softcap=softcap is not None, dtype=SPEC_DTYPES[q_dtype],
                               page_size=cache.page_size, return_lse=return_lse, kv_dtype=kv_dtype)
        except SpecError as e:
            raise ValueError(f"cache: {e}") from None
        info = device_info(device.index if device.type == "cuda" else None)
        table = dispatch.table_for(spec, info)
        launcher = dispatch.launcher_for(spec)
        tokens = host[-1].qo_indptr[-1]
        indices = torch.cat([level.kv_indices for level in host]).to(device)

        def make(choice: dispatch.Choice) -> _Plan:
            values = device_schedule(host, tokens, spec=spec, heads_q=heads_q, kv_heads=cache.kv_heads,
                                     config=choice.config, device_info=info, device=device)
            launch_args = {"shared_items": values["shared_items"], "own_items": values["own_items"],
                           "direct": values["direct"], "fused": values["fused"], "states_pad": values["states_pad"],
                           "own_block_m": values["own_block_m"], "scale": scale_value, "softcap": softcap_value,
                           **choice.config.to_dict()}
            return _Plan(spec=spec, tokens=tokens, heads_q=heads_q, launch=launcher.replay(launch_args),
                         launch_args=launch_args, work=values["work"], state_base=values["state_base"],
                         indices=indices, part_o=values["part_o"], part_lse=values["part_lse"], choice=choice,
                         q_dtype=q_dtype, cache_layout=_layout(cache), host=tuple(host))

        if _shares(host):
            self._plan = dispatch.planned(table, _bucket_size(host, cache.page_size), make)
        else:
            # Nothing shared: the last level alone is batch decode's work (one launch, no merge), so it takes
            # batch decode's knobs (its tuned row, or default) rather than a cascade row tuned on the memory
            # left over beside a shared pass (on the H200, 64 x 4096 unshared took 296 us with the 64 x 4096 +
            # 256 cascade row against PagedDecode's 252).
            self._plan = make(_decode_choice(spec, table.choose(_bucket_size(host, cache.page_size)), info,
                                             host, cache.page_size))
        return self._plan.choice

    @property
    def work_items(self) -> int:
        """The planned work items (tiles x key chunks), each launched once per KV head."""
        if self._plan is None:
            raise RuntimeError("CascadeAttention: call plan(...) first")
        return self._plan.launch_args["shared_items"] + self._plan.launch_args["own_items"]

    def run(self, q: torch.Tensor, cache: PagedKVCache, *, out: torch.Tensor | None = None):
        """Attend ``q`` ``[tokens, heads_q, head_dim]`` over the planned levels of ``cache``'s pages;
        ``(out, lse)`` when planned with ``return_lse`` (LSE fp32 ``[tokens, heads_q]``, natural log). In an autocast
        region of the plan's dtype, a query of another is cast to it, as SDPA casts its inputs."""
        # Under vmap or a FakeTensorMode q has no storage to launch on: the custom op, as under compile.
        if off_eager():
            return self._compiled_run(q, cache, out)
        plan = self._plan
        if plan is None:
            raise RuntimeError("CascadeAttention.run: call plan(...) first, once per step")
        spec = plan.spec
        if not isinstance(cache, PagedKVCache) or _layout(cache) != plan.cache_layout:
            raise ValueError(f"cache: expected a tilegen.PagedKVCache shaped as planned ({spec.name}, "
                             f"{plan.cache_layout[-1]} pages)")
        if env.debug():
            # The cache as plan checked it: a request that grew since (a token appended) would have its new keys
            # go unread, the levels fixing each node's length.
            cache.validate()
            _check_against_cache(plan.host, cache)
        shape = (plan.tokens, plan.heads_q, spec.head_dim)
        if not isinstance(q, torch.Tensor) or q.shape != shape:
            raise ValueError(f"q: expected {list(shape)}, got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        pages, v_pages = cache.k_pages, cache.v_pages
        if q.dtype != plan.q_dtype or q.device != pages.device:  # cast in an autocast region of the plan's dtype
            q = self._query_as_planned(q, plan.q_dtype, pages.device)
        out_shape = (plan.tokens, plan.heads_q, spec.dv)
        if out is None:
            out = q.new_empty(out_shape)
        else:
            if not isinstance(out, torch.Tensor) or out.shape != out_shape or out.dtype != q.dtype \
                    or out.device != q.device:
                raise ValueError(f"out: expected {list(out_shape)} {q.dtype} on {q.device}")
            check_out("out", out, {"q": q, "cache.k_pages": pages, "cache.v_pages": v_pages})
        if torch.is_grad_enabled() and (q.requires_grad or out.requires_grad or pages.requires_grad
                                        or v_pages.requires_grad or cache._scales_require_grad()):
            refuse_grad("tilegen.CascadeAttention.run", q=q, out=out, **cache._named_tensors())
        lse = q.new_empty((plan.tokens, plan.heads_q), dtype=torch.float32) if spec.return_lse else None
        if plan.tokens:
            plan.launch((q.stride(), out.stride(), pages.stride(), v_pages.stride()),
                        q, pages, v_pages, out, out if lse is None else lse, plan.part_o, plan.part_lse,
                        plan.state_base, plan.work, plan.indices, *cache._scales)
        return (out, lse) if spec.return_lse else out


def cascade_levels(cache: PagedKVCache, qo_lens: Sequence[int] | torch.Tensor | None = None, *,
                   causal: bool = True) -> list[CascadeLevel]:
    """Levels from ``cache``'s own page table, for a batch whose sequences share leading pages.

    Sequences that are neighbours in the batch and list the same leading pages share them: each
    maximal run of pages that a contiguous group of two or more sequences lists at the same place
    becomes a node, nested runs become deeper levels, and what is left of each sequence is its node
    of the last level. A page is shared only when it is full and, with ``causal``, lies wholly
    before the sequence's first query token (``qo_lens[b]`` query tokens, 1 each by default, sit at
    the end of sequence ``b``), so that shared keys need no mask. Sequences that share pages but are
    not neighbours are served correctly, reading the pages once per group. Reads the page table to
    the host, checked there first (``PagedKVCache.validate``: the levels of a page table that points
    outside the cache would pass on its faults as pages of their own); the levels are on the cache's device.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a tilegen.PagedKVCache, got {type(cache).__name__}")
    check_bool("causal", causal)
    cache.validate()
    batch, size = cache.batch, cache.page_size
    indptr = cache.indptr.tolist()
    indices = cache.indices[: indptr[-1]].tolist() if batch else []
    last = cache.last_page_len.tolist()
    lens = [(indptr[b + 1] - indptr[b] - 1) * size + last[b] if indptr[b + 1] > indptr[b] else 0 for b in range(batch)]
    if qo_lens is None:
        q = [1] * batch
    else:
        # A tensor's or an array's tolist gives Python ints; a list of NumPy integers is refused below.
        q = qo_lens.tolist() if hasattr(qo_lens, "tolist") else qo_lens
        try:
            q = list(q)  # a scalar (a 0-d tensor's tolist() is one) is no list of lengths
        except TypeError:
            q = None
        if q is None or len(q) != batch or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in q):
            raise ValueError(f"qo_lens: expected {batch} ints >= 0 (one per sequence), got {qo_lens!r}")
        if any(n > k for n, k in zip(q, lens)):
            raise ValueError("qo_lens: a sequence has more query tokens than keys (its query tokens are its last keys)")
    seqs = [indices[indptr[b]:indptr[b + 1]] for b in range(batch)]
    # Pages of sequence b that may be shared: full, and (causal) before its first query token.
    shareable = [min(len(seqs[b]) if last[b] == size or not seqs[b] else len(seqs[b]) - 1,
                     (lens[b] - q[b] + 1) // size if causal else len(seqs[b])) for b in range(batch)]
    tiers: list[list[tuple[int, int, int, int]]] = []  # per depth: (first seq, end seq, first page, end page)

    # Runs of sequences sharing pages from `page` on, split at each page where they part, breadth first: a prefix
    # tree as deep as the batch is long (each sequence one page past its neighbour's) takes no recursion, and each
    # depth's nodes still come in sequence order.
    pending = collections.deque([(0, batch, 0, 0)])
    while pending:
        first, end, page, depth = pending.popleft()
        b = first
        while b < end:
            group_end = b + 1
            if page < shareable[b]:
                while group_end < end and page < shareable[group_end] and seqs[group_end][page] == seqs[b][page]:
                    group_end += 1
            if group_end - b >= 2:
                stop = page + 1
                while all(stop < shareable[s] and seqs[s][stop] == seqs[b][stop] for s in range(b, group_end)):
                    stop += 1
                while len(tiers) <= depth:
                    tiers.append([])
                tiers[depth].append((b, group_end, page, stop))
                pending.append((b, group_end, stop, depth + 1))
            b = group_end
    consumed = [0] * batch
    q_ptr = [0]
    for n in q:
        q_ptr.append(q_ptr[-1] + n)
    levels = []
    for tier in tiers:
        # The nodes of this depth, and a pageless node for each sequence between them: one node over several
        # such sequences could span two nodes of the depth above.
        qo, kv, pages, last_len = [0], [0], [], []

        def pageless(first: int, end: int) -> None:
            for s in range(first, end):
                qo.append(q_ptr[s + 1])
                kv.append(kv[-1])
                last_len.append(0)

        b = 0
        for first, end, page, stop in tier:
            pageless(b, first)
            pages.extend(seqs[first][page:stop])
            qo.append(q_ptr[end])
            kv.append(len(pages))
            last_len.append(size)
            for s in range(first, end):
                consumed[s] = stop
            b = end
        pageless(b, batch)
        levels.append((qo, kv, pages, last_len))
    own_kv, own_pages = [0], []
    for b in range(batch):
        own_pages.extend(seqs[b][consumed[b]:])
        own_kv.append(len(own_pages))
    own_last = [last[b] if own_kv[b + 1] > own_kv[b] else 0 for b in range(batch)]
    levels.append((q_ptr, own_kv, own_pages, own_last))
    device = cache.indptr.device

    def ints(values):  # on the host, not the default device (torch.set_default_device), then on the cache's
        return torch.tensor(values, dtype=torch.int32, device="cpu").to(device)

    return [CascadeLevel(ints(qo), ints(kv), ints(pages), ints(lasts)) for qo, kv, pages, lasts in levels]


def _host_levels(levels: Sequence[CascadeLevel], cache: PagedKVCache) -> list[HostLevel]:
    """The levels' tables on the host, checked: each an error naming the level and the field."""
    if isinstance(levels, CascadeLevel) or not isinstance(levels, Sequence) or not levels:
        raise TypeError(f"levels: expected a non-empty sequence of tilegen.CascadeLevel, got {type(levels).__name__}")
    size, num_pages = cache.page_size, cache.num_pages
    host = []
    tokens = None
    for i, level in enumerate(levels):
        where = f"levels[{i}]"
        if not isinstance(level, CascadeLevel):
            raise TypeError(f"{where}: expected a tilegen.CascadeLevel, got {type(level).__name__}")
        fields = {}
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
            t = getattr(level, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
                raise ValueError(f"{where}.{name}: expected a 1-d int32 tensor, got "
                                 f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
                                 f"{list(t.shape) if isinstance(t, torch.Tensor) else ''}")
            if t.device.type not in ("cpu", cache.k_pages.device.type):
                raise ValueError(f"{where}.{name}: on {t.device}, expected the host or the cache's {cache.k_pages.device}")
            fields[name] = t
        qo, kv = fields["qo_indptr"].tolist(), fields["kv_indptr"].tolist()
        last = fields["kv_last_page_len"].tolist()
        nodes = len(qo) - 1
        if nodes < 0:
            raise ValueError(f"{where}.qo_indptr: expected at least 1 entry (0, for no node), got none")
        if len(kv) != len(qo) or len(last) != nodes:
            raise ValueError(f"{where}: kv_indptr has {len(kv)} entries and kv_last_page_len {len(last)}; "
                             f"qo_indptr's {nodes} nodes need {nodes + 1} and {nodes}")
        if qo[0] != 0 or any(b < a for a, b in zip(qo, qo[1:])):
            raise ValueError(f"{where}.qo_indptr: must start at 0 and be non-decreasing, got {qo[:8]}...")
        if tokens is None:
            tokens = qo[-1]
        elif qo[-1] != tokens:
            raise ValueError(f"{where}.qo_indptr: ends at {qo[-1]} query tokens, levels[0]'s at {tokens}: every "
                             f"level covers every token")
        if kv[0] != 0 or any(b < a for a, b in zip(kv, kv[1:])) or kv[-1] != fields["kv_indices"].numel():
            raise ValueError(f"{where}.kv_indptr: must start at 0, be non-decreasing and end at kv_indices' "
                             f"{fields['kv_indices'].numel()} entries, got {kv[:8]}... ending at {kv[-1]}")
        for n in range(nodes):
            if kv[n + 1] > kv[n] and not 1 <= last[n] <= size:
                raise ValueError(f"{where}.kv_last_page_len: node {n} has pages and {last[n]} tokens in its last "
                                 f"page; expected 1..{size}")
        pages = fields["kv_indices"].cpu()
        if pages.numel() and bool(((pages < 0) | (pages >= num_pages)).any()):
            raise ValueError(f"{where}.kv_indices: page indices outside the cache's {num_pages} pages")
        if host:
            above = host[-1].qo_indptr
            for n in range(nodes):
                a, b = qo[n], qo[n + 1]
                if b > a and bisect.bisect_right(above, a) != bisect.bisect_right(above, b - 1):
                    raise ValueError(f"{where}.qo_indptr: node {n}'s tokens {a}..{b - 1} span two nodes of "
                                     f"levels[{i - 1}]; a node lies inside one node of each level above it")
        host.append(HostLevel(qo, kv, pages.to(torch.int32), last))
    return host


def _check_causal(host: list[HostLevel], page_size: int) -> None:
    """A causal plan reads a shared level's keys whole, so every query token must come after them: a node of the
    last level with q query tokens under shared keys holds at least q - 1 keys of its own (the last token is the
    query's own key)."""
    last = host[-1]
    for node in range(len(last.qo_indptr) - 1):
        start, queries = last.qo_indptr[node], last.qo_indptr[node + 1] - last.qo_indptr[node]
        own = last.keys(node, page_size)
        if queries <= own + 1:
            continue
        shared = sum(level.keys(level.node_of(start), page_size) for level in host[:-1])
        if shared:
            raise ValueError(f"levels[{len(host) - 1}]: node {node} has {queries} query tokens over {own} keys of its "
                             f"own and {shared} shared: causal, a request's query tokens lie in its own level (at "
                             f"least one key fewer than its query tokens), since a shared level is read whole")


def _check_against_cache(host: Sequence[HostLevel], cache: PagedKVCache) -> None:
    """Under ``TILEGEN_DEBUG=1``: each node of the last level with query tokens reads, level after level, the pages
    and keys of a sequence of ``cache`` of its own, one that no other node reads (a level listed over a request that
    does not hold its pages would read another request's keys; a cache that grew since the plan has keys it would
    miss). Node n is sequence n where they agree; the others pair with the sequences left, so a batch in another
    order than the cache's, or a part of it, is checked too. A node left without one is named, with sequence n's
    page table when the last level has a node per sequence."""
    last = host[-1]
    indptr, indices, lens = cache.indptr.tolist(), cache.indices.tolist(), cache.seq_lens().tolist()
    tables = [(tuple(indices[indptr[b]:indptr[b + 1]]), lens[b]) for b in range(cache.batch)]
    size = cache.page_size
    reads = {}
    for n in range(len(last.qo_indptr) - 1):
        start = last.qo_indptr[n]
        if last.qo_indptr[n + 1] == start:
            continue
        pages, keys, partial = [], 0, None
        for i, level in enumerate(host):
            node = n if level is last else level.node_of(start)
            n_k = level.keys(node, size)
            if n_k and partial is not None:
                # Only a page table's last page is partial: pages after one are no sequence's table.
                raise ValueError(f"levels[{partial[0]}]: node {partial[1]} ends in a partial page, and a later level "
                                 f"adds pages under it; a shared level's pages are full unless it holds the last")
            if n_k % size:
                partial = (i, node)
            pages += level.kv_indices[level.kv_indptr[node]:level.kv_indptr[node + 1]].tolist()
            keys += n_k
        reads[n] = (tuple(pages), keys)
    # Sequences with the same table and length are interchangeable: counted, each taken by one node.
    free = collections.Counter(tables)
    unpaired = []
    for n, read in reads.items():
        if n < cache.batch and tables[n] == read:
            free[read] -= 1
        else:
            unpaired.append(n)
    for n in unpaired:
        if free[reads[n]] > 0:
            free[reads[n]] -= 1
            continue
        pages, keys = reads[n]
        if len(last.qo_indptr) - 1 != cache.batch:
            raise ValueError(f"levels: node {n} of the last level reads {len(pages)} pages, {keys} tokens through "
                             f"the levels (pages {list(pages)}), which no sequence of the cache left holds: a level "
                             f"lists a request that does not hold its pages, or the cache changed since plan")
        table, held = tables[n]
        # Named by their ids when only the pages differ, not their count or the tokens.
        same_counts = (len(pages), keys) == (len(table), held)
        ours = f"pages {list(pages)}" if same_counts else f"{len(pages)} pages, {keys} tokens"
        theirs = f"pages {list(table)}" if same_counts else f"{len(table)} pages, {held} tokens"
        raise ValueError(f"levels: sequence {n}'s pages through the levels ({ours}) differ from the cache's page "
                         f"table ({theirs}): a level lists a request that does not hold its pages, or the cache "
                         f"changed since plan")


def _shares(host: list[HostLevel]) -> bool:
    """Whether a shared level has a node with both tokens and pages: work for the shared launch."""
    return any(level.qo_indptr[n + 1] > level.qo_indptr[n] and level.kv_indptr[n + 1] > level.kv_indptr[n]
               for level in host[:-1] for n in range(len(level.qo_indptr) - 1))


def _decode_choice(spec: CascadeSpec, cascade: dispatch.Choice, info, host: list[HostLevel],
                   page_size: int) -> dispatch.Choice:
    """``cascade`` with the last level's knobs taken from batch decode's choice for the same pages,
    context and batch (its row, or its default)."""
    last = host[-1]
    context = max((last.keys(n, page_size) for n in range(len(last.qo_indptr) - 1)), default=0)
    decode = DecodeSpec(head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, q_per_kv=spec.q_per_kv,
                        softcap=spec.softcap, dtype=spec.dtype, page_size=page_size, kv_dtype=spec.kv_dtype)
    chosen = dispatch.table_for(decode, info).choose((max(context, 1), max(1, len(last.qo_indptr) - 1)))
    c = chosen.config
    config = dataclasses.replace(cascade.config, own_block_n=c.block_n, own_warps=c.num_warps,
                                 own_stages=c.num_stages, own_ctas_per_sm=c.ctas_per_sm)
    source = f"{chosen.source} (attention_decode's {'row' if chosen.tuned_bucket is not None else 'default'})"
    return dataclasses.replace(cascade, config=config, source=source, tuned_bucket=None)


def _bucket_size(host: list[HostLevel], page_size: int) -> tuple[int, int]:
    """The call's bucket: its longest shared node's keys and the tokens under it; the last level's
    longest node and the token count when nothing is shared."""
    best = (0, 0)
    for level in host[:-1]:
        for n in range(len(level.qo_indptr) - 1):
            tokens = level.qo_indptr[n + 1] - level.qo_indptr[n]
            if tokens:
                best = max(best, (level.keys(n, page_size), tokens))
    if best[0]:
        return best
    last = host[-1]
    return (max((last.keys(n, page_size) for n in range(len(last.qo_indptr) - 1)), default=0) or 1,
            max(1, last.qo_indptr[-1]))
