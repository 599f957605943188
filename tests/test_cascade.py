"""Cascade attention over a prefix tree of shared pages, against the float64 reference on each
sequence's gathered pages (the same answer ``PagedDecode`` gives when every request reads its
whole page list).

The tree: sequences 0-4 share a root prefix, 0-2 share a deeper one beneath it, 3-4 a different
one, sequence 5 shares nothing and sequence 6 is the root prefix alone plus one token; own tails
of 1, page_size - 1, page_size + 1 and more tokens, pages shuffled, every unused slot NaN.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_varlen import paged_reference

import tilegen
from tilegen.families import relative_error

DIM = 32


def _randn(gen, *shape, dtype, device):
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def tree_cache(page_size, kv_heads, dtype, device, gen, *, tails=(1, 9, 17, 4, 30, 12, 1)):
    """Seven sequences over shared page runs (the module docstring's tree), a NaN page spare."""
    runs = {"root": 3, "deep": 2, "other": 1}
    total = sum(runs.values()) + sum(math.ceil(t / page_size) for t in tails) + 5 + 2
    order = torch.randperm(total, generator=gen).tolist()
    k_pages = torch.full((total, page_size, kv_heads, DIM), math.nan, dtype=dtype, device=device)
    v_pages = torch.full_like(k_pages, math.nan)

    def fresh(tokens):
        pages = [order.pop() for _ in range(math.ceil(tokens / page_size))]
        for i, page in enumerate(pages):
            held = min(page_size, tokens - i * page_size)
            k_pages[page, :held] = _randn(gen, held, kv_heads, DIM, dtype=dtype, device=device)
            v_pages[page, :held] = _randn(gen, held, kv_heads, DIM, dtype=dtype, device=device)
        return pages

    shared = {name: fresh(n * page_size) for name, n in runs.items()}
    heads = [shared["root"] + shared["deep"]] * 3 + [shared["root"] + shared["other"]] * 2 + [[], shared["root"]]
    indptr, indices, last = [0], [], []
    for head, tail in zip(heads, tails):
        own = fresh(tail)
        indices += head + own
        indptr.append(len(indices))
        last.append(tail - (len(own) - 1) * page_size)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return tilegen.PagedKVCache(k_pages, v_pages, ints(indptr), ints(indices), ints(last))


def _check(out, lse, ref, ref_lse, dtype):
    assert not torch.isnan(out).any(), "output elements never written"
    error, _ = relative_error(out.cpu(), ref)
    assert error < (1e-4 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    assert (lse.cpu().double()[seen] - ref_lse[seen]).abs().max() < 1e-4


@pytest.mark.parametrize("page_size,group,dtype", [(8, 4, torch.bfloat16), (16, 1, torch.float32),
                                                   (1, 2, torch.float32)], ids=["p8-gqa4-bf16", "p16-mha-fp32",
                                                                                 "p1-gqa2-fp32"])
def test_decode_over_derived_levels(page_size, group, dtype, device):
    gen = torch.Generator().manual_seed(page_size + group)
    cache = tree_cache(page_size, 2, dtype, device, gen)
    levels = tilegen.cascade_levels(cache)
    assert len(levels) == 3, "root, the deeper runs, each sequence's own pages"
    heads_q = cache.kv_heads * group
    q = _randn(gen, cache.batch, heads_q, DIM, dtype=dtype, device=device)
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, levels, heads_q=heads_q, return_lse=True)
    assert cascade._plan.launch_args["fused"], "each own item merges its tokens' shared states: no merge launch"
    out = torch.full((cache.batch, heads_q, DIM), math.nan, dtype=dtype, device=device)
    result, lse = cascade.run(q, cache, out=out)
    assert result is out
    ref, ref_lse = paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32))
    _check(out, lse, ref, ref_lse, dtype)


def test_levels_and_plan_keep_their_host_tables_off_the_default_device(device):
    """``cascade_levels`` and ``plan`` build their tables on the host whatever the default device (``with
    torch.device(...)``, ``torch.set_default_device``), then move them to the cache's: they were built on the default
    device, so a plan under a GPU default went to it and back, and one under "meta" failed (no data to copy back).
    The run made in such a context is the run made outside it."""
    gen = torch.Generator().manual_seed(21)
    cache = tree_cache(8, 2, torch.float32, device, gen)
    q = _randn(gen, cache.batch, 4, DIM, dtype=torch.float32, device=device)
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=4, return_lse=True)
    want = cascade.run(q, cache)
    with torch.device("meta"):
        levels = tilegen.cascade_levels(cache)
        cascade.plan(cache, levels, heads_q=4, return_lse=True)
        got = cascade.run(q, cache)
    assert all(t.device == cache.indptr.device for level in levels for t in dataclasses.astuple(level))
    for g, w in zip(got, want):
        assert g.device == w.device and torch.equal(g.nan_to_num(), w.nan_to_num())


def test_derived_levels_share_only_what_is_shared(device):
    gen = torch.Generator().manual_seed(3)
    cache = tree_cache(8, 1, torch.float32, device, gen)
    root, deep, own = tilegen.cascade_levels(cache)
    # Root: sequences 0-4 (five tokens) over 3 pages, then 5 and 6 each in a node without pages: 6 lists the
    # root's pages too, but is not a neighbour of 0-4 past the unrelated sequence 5, so they stay its own.
    assert root.qo_indptr.tolist() == [0, 5, 6, 7]
    assert root.kv_indptr.tolist() == [0, 3, 3, 3]
    assert deep.qo_indptr.tolist() == [0, 3, 5, 6, 7]
    assert deep.kv_indptr.tolist() == [0, 2, 3, 3, 3]
    assert own.qo_indptr.tolist() == list(range(8))
    pages = (cache.indptr[1:] - cache.indptr[:-1]).tolist()
    shared = [5, 5, 5, 4, 4, 0, 0]
    assert (own.kv_indptr[1:] - own.kv_indptr[:-1]).tolist() == [p - s for p, s in zip(pages, shared)]


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_queries_over_levels(causal, device):
    """Several query tokens per request (chunked prefill, speculative decoding): the shared pages stop
    before each request's first query token, and the last level is masked bottom-right."""
    gen = torch.Generator().manual_seed(5 + causal)
    cache = tree_cache(8, 2, torch.float32, device, gen, tails=(3, 9, 17, 4, 41, 12, 2))
    # 30 x 3 rows of sequence 4: two tiles of the last level, the first ending mid-token at key block 32
    qo_lens = [3, 5, 1, 4, 30, 0, 2]
    levels = tilegen.cascade_levels(cache, qo_lens, causal=causal)
    # The lengths as a tensor or a NumPy array say the same.
    for same in (torch.tensor(qo_lens), np.array(qo_lens)):
        again = tilegen.cascade_levels(cache, same, causal=causal)
        assert [[t.tolist() for t in dataclasses.astuple(level)] for level in again] == \
            [[t.tolist() for t in dataclasses.astuple(level)] for level in levels]
    heads_q = 6 if causal else 4  # 3 query heads per KV head: a tile's rows end mid-token
    q = _randn(gen, sum(qo_lens), heads_q, DIM, dtype=torch.float32, device=device)
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, levels, heads_q=heads_q, causal=causal, return_lse=True, softcap=5.0, scale=0.3)
    out, lse = cascade.run(q, cache)
    cu = torch.tensor([0, *qo_lens]).cumsum(0).to(torch.int32)
    ref, ref_lse = paged_reference(q, cache, cu, causal=causal, softcap=5.0, scale=0.3)
    _check(out, lse, ref, ref_lse, torch.float32)


def test_no_sharing_writes_directly_and_matches_decode(device):
    """A batch that shares nothing is one level: one state per token, no merge, PagedDecode's answer."""
    gen = torch.Generator().manual_seed(8)
    cache = tree_cache(16, 2, torch.bfloat16, device, gen)
    levels = [tilegen.CascadeLevel(torch.arange(cache.batch + 1, dtype=torch.int32), cache.indptr, cache.indices,
                                   cache.last_page_len)]
    q = _randn(gen, cache.batch, 8, DIM, dtype=torch.bfloat16, device=device)
    cascade = tilegen.CascadeAttention()
    choice = cascade.plan(cache, levels, heads_q=8)
    assert "attention_decode" in choice.source, "nothing shared: batch decode's knobs"
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=8)
    expected = decode.run(q, cache)
    assert cascade._plan.launch_args["direct"]
    torch.testing.assert_close(cascade.run(q, cache), expected, atol=2e-2, rtol=2e-2)


def test_causal_queries_reaching_into_a_shared_level_are_refused(device):
    """A shared level is read whole: causal, a request's query tokens must lie in its own level, else its earlier
    tokens would see later keys. Levels derived without causal share pages past such tokens."""
    gen = torch.Generator().manual_seed(5)
    pages = [_randn(gen, 2, 8, 1, DIM, dtype=torch.float32, device=device) for _ in "kv"]

    def ints(*values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    # Two requests on one shared full page and one page of their own each, of `own` keys, two query tokens each.
    for own, refused in ((0, True), (1, False)):
        cache = tilegen.PagedKVCache(*pages, ints(0, 2, 4), ints(0, 1, 0, 1), ints(own or 8, own or 8))
        if own == 0:
            cache = tilegen.PagedKVCache(*pages, ints(0, 1, 2), ints(0, 0), ints(8, 8))
        root = tilegen.CascadeLevel(ints(0, 4), ints(0, 1), ints(0), ints(8))
        mine = tilegen.CascadeLevel(ints(0, 2, 4), ints(0, 0, 0) if own == 0 else ints(0, 1, 2),
                                    ints() if own == 0 else ints(1, 1), ints(0, 0) if own == 0 else ints(own, own))
        if refused:
            with pytest.raises(ValueError, match=r"levels\[1\]: node 0 has 2 query tokens over 0 keys of its own"):
                tilegen.CascadeAttention().plan(cache, [root, mine], heads_q=2)
            tilegen.CascadeAttention().plan(cache, [root, mine], heads_q=2, causal=False)
        else:
            tilegen.CascadeAttention().plan(cache, [root, mine], heads_q=2)


def _levels(cache):
    return tilegen.cascade_levels(cache)


@pytest.mark.parametrize("fault,match", [
    ("qo-short", r"levels\[1\]\.qo_indptr: ends at"),
    ("kv-indptr-length", r"levels\[0\]: kv_indptr has"),
    ("page-outside", r"levels\[0\]\.kv_indices: page indices outside"),
    ("last-len", r"levels\[2\]\.kv_last_page_len: node 0"),
    ("not-nested", r"levels\[1\]\.qo_indptr: node 0's tokens .* span two nodes"),
    ("dtype", r"levels\[0\]\.qo_indptr: expected a 1-d int32 tensor"),
    ("empty", r"levels: expected a non-empty sequence"),
])
def test_bad_levels_are_named(fault, match, device):
    gen = torch.Generator().manual_seed(1)
    cache = tree_cache(8, 1, torch.float32, device, gen)
    levels = _levels(cache)
    root, deep, own = levels
    if fault == "qo-short":
        deep = tilegen.CascadeLevel(deep.qo_indptr[:-1], deep.kv_indptr[:-1], deep.kv_indices, deep.kv_last_page_len[:-1])
    elif fault == "kv-indptr-length":
        root = tilegen.CascadeLevel(root.qo_indptr, root.kv_indptr[:-1], root.kv_indices, root.kv_last_page_len)
    elif fault == "page-outside":
        root = tilegen.CascadeLevel(root.qo_indptr, root.kv_indptr, root.kv_indices + cache.num_pages,
                                    root.kv_last_page_len)
    elif fault == "last-len":
        own = tilegen.CascadeLevel(own.qo_indptr, own.kv_indptr, own.kv_indices, own.kv_last_page_len * 0)
    elif fault == "not-nested":
        deep = tilegen.CascadeLevel(torch.tensor([0, 6, 7], dtype=torch.int32, device=device),
                                    deep.kv_indptr[[0, 1, 2]], deep.kv_indices, deep.kv_last_page_len[:2])
    elif fault == "dtype":
        root = tilegen.CascadeLevel(root.qo_indptr.long(), root.kv_indptr, root.kv_indices, root.kv_last_page_len)
    levels = [] if fault == "empty" else [root, deep, own]
    with pytest.raises((ValueError, TypeError), match=match):
        tilegen.CascadeAttention().plan(cache, levels, heads_q=2)


def test_a_level_over_requests_that_do_not_hold_it_is_refused_in_debug(device, monkeypatch):
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    gen = torch.Generator().manual_seed(2)
    cache = tree_cache(8, 1, torch.float32, device, gen)
    root, deep, own = _levels(cache)
    # The deeper node of sequences 0-2 claims sequence 3 too, which holds other pages there.
    deep = tilegen.CascadeLevel(torch.tensor([0, 4, 5, 6, 7], dtype=torch.int32, device=device), deep.kv_indptr,
                                deep.kv_indices, deep.kv_last_page_len)
    with pytest.raises(ValueError, match=r"sequence 3's pages through the levels"):
        tilegen.CascadeAttention().plan(cache, [root, deep, own], heads_q=2)
    # Other pages, as many: the message names them, since the counts agree.
    root, deep, own = _levels(cache)
    root = tilegen.CascadeLevel(root.qo_indptr, root.kv_indptr, (root.kv_indices + 1) % cache.num_pages,
                                root.kv_last_page_len)
    with pytest.raises(ValueError, match=r"sequence 0's pages through the levels \(pages \[.*\) differ from the "
                                         r"cache's page table \(pages \["):
        tilegen.CascadeAttention().plan(cache, [root, deep, own], heads_q=2)


def _reordered(cache, order):
    """``cache``'s sequences in ``order`` (a permutation, or a part of them): the same pages, other page tables."""
    indptr, indices, last = cache.indptr.tolist(), cache.indices.tolist(), cache.last_page_len.tolist()
    rows = [indices[indptr[b]:indptr[b + 1]] for b in order]
    starts = [0]
    for row in rows:
        starts.append(starts[-1] + len(row))

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=cache.indptr.device)

    return tilegen.PagedKVCache(cache.k_pages, cache.v_pages, ints(starts), ints([p for row in rows for p in row]),
                                ints([last[b] for b in order]))


def test_levels_over_a_cache_in_another_order_or_larger_pass_the_debug_check(device, monkeypatch):
    """The debug check pairs a last-level node with any sequence that holds its pages: levels made for one batch
    serve a cache that lists the same sequences in another order, or more of them (the check ran before only when
    the last level had a node per sequence, and paired node n with sequence n)."""
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    gen = torch.Generator().manual_seed(21)
    cache = tree_cache(8, 1, torch.float32, device, gen)
    levels = _levels(cache)
    q = _randn(gen, cache.batch, 2, DIM, dtype=torch.float32, device=device)
    ref, ref_lse = paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32))
    for other in (_reordered(cache, [6, 5, 4, 3, 2, 1, 0]), _reordered(cache, [0, 1, 2, 3, 4, 5, 6, 2])):
        cascade = tilegen.CascadeAttention()
        cascade.plan(other, levels, heads_q=2, return_lse=True)
        _check(*cascade.run(q, other), ref, ref_lse, torch.float32)
    # A last level that is not one node per sequence, whose node reads pages no sequence holds: named by its node.
    root, deep, own = levels
    own = tilegen.CascadeLevel(own.qo_indptr, own.kv_indptr, own.kv_indices.flip(0), own.kv_last_page_len)
    with pytest.raises(ValueError, match=r"levels: node \d of the last level reads .* which no sequence of the "
                                         r"cache left holds"):
        tilegen.CascadeAttention().plan(_reordered(cache, [0, 1, 2, 3, 4, 5, 6, 2]), [root, deep, own], heads_q=2)


def _pages_of_8(count, gen, device):
    """K and V pages of 8 slots, one KV head, and a maker of int32 tensors on their device."""
    def ints(*values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return (*(_randn(gen, count, 8, 1, DIM, dtype=torch.float32, device=device) for _ in range(2)), ints)


def test_the_debug_check_pairs_each_node_with_a_sequence_of_its_own(device, monkeypatch):
    """Two nodes reading one sequence's pages, or two identical sequences of which one grew since plan: a node is
    left without a sequence, though the pages it reads are some sequence's."""
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    gen = torch.Generator().manual_seed(23)
    k_pages, v_pages, ints = _pages_of_8(8, gen, device)

    two = tilegen.PagedKVCache(k_pages, v_pages, ints(0, 2, 4), ints(0, 1, 2, 3), ints(3, 3))
    both_read_one = tilegen.CascadeLevel(ints(0, 1, 2), ints(0, 2, 4), ints(2, 3, 2, 3), ints(3, 3))
    with pytest.raises(ValueError, match=r"sequence 0's pages through the levels \(pages \[2, 3\]\) differ"):
        tilegen.CascadeAttention().plan(two, [both_read_one], heads_q=2)
    # Sequences 0 and 1 hold the same pages and 10 tokens; then sequence 0 has 11.
    twins = tilegen.PagedKVCache(k_pages, v_pages, ints(0, 2, 4, 6), ints(0, 1, 0, 1, 2, 3), ints(2, 2, 3))
    cascade = tilegen.CascadeAttention()
    cascade.plan(twins, tilegen.cascade_levels(twins), heads_q=2)
    grown = tilegen.PagedKVCache(k_pages, v_pages, ints(0, 2, 4, 6), ints(0, 1, 0, 1, 2, 3), ints(3, 2, 3))
    q = _randn(gen, 3, 2, DIM, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=r"sequence 0's pages through the levels \(2 pages, 10 tokens\) differ from "
                                         r"the cache's page table \(2 pages, 11 tokens\)"):
        cascade.run(q, grown)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.lists(st.integers(0, 6), min_size=1, max_size=10))
def test_the_debug_check_passes_a_cache_exactly_when_it_holds_every_request(order, device, monkeypatch):
    """Levels of seven distinct requests over a cache listing any of them, in any order, some twice: the debug
    check passes when every request is there, and names a node otherwise."""
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    cache = tree_cache(8, 1, torch.float32, device, torch.Generator().manual_seed(24))
    levels = _levels(cache)
    other = _reordered(cache, order)
    if set(order) == set(range(cache.batch)):
        tilegen.CascadeAttention().plan(other, levels, heads_q=2)
    else:
        with pytest.raises(ValueError, match=r"levels: (sequence|node) \d+"):
            tilegen.CascadeAttention().plan(other, levels, heads_q=2)


def test_a_shared_level_may_end_in_a_partial_page_when_it_holds_the_last(device, monkeypatch):
    """Samples of one prompt listing the same pages, the last partial: one shared node holds all their keys and
    their own nodes none. Valid, and the debug check passes it; a later level's pages after that partial page are
    refused by name."""
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    gen = torch.Generator().manual_seed(25)
    k_pages, v_pages, ints = _pages_of_8(3, gen, device)

    cache = tilegen.PagedKVCache(k_pages, v_pages, ints(0, 2, 4), ints(0, 1, 0, 1), ints(5, 5))  # 13 keys each
    shared = tilegen.CascadeLevel(ints(0, 2), ints(0, 2), ints(0, 1), ints(5))
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, [shared, tilegen.CascadeLevel(ints(0, 1, 2), ints(0, 0, 0), ints(), ints(1, 1))], heads_q=2,
                 return_lse=True)
    q = _randn(gen, 2, 2, DIM, dtype=torch.float32, device=device)
    ref, ref_lse = paged_reference(q, cache, torch.arange(3, dtype=torch.int32))
    _check(*cascade.run(q, cache), ref, ref_lse, torch.float32)
    longer = tilegen.PagedKVCache(k_pages, v_pages, ints(0, 3, 6), ints(0, 1, 2, 0, 1, 2), ints(1, 1))
    own = tilegen.CascadeLevel(ints(0, 1, 2), ints(0, 1, 2), ints(2, 2), ints(1, 1))
    with pytest.raises(ValueError, match=r"levels\[0\]: node 0 ends in a partial page, and a later level adds"):
        tilegen.CascadeAttention().plan(longer, [shared, own], heads_q=2)


def test_run_refuses_a_cache_that_grew_since_plan_in_debug(device, monkeypatch):
    """The levels fix each request's length: a token appended after plan would go unread, and run says so under
    TILEGEN_DEBUG (as PagedDecode.run does for a sequence past its plan's chunks)."""
    gen = torch.Generator().manual_seed(22)
    cache = tree_cache(8, 1, torch.float32, device, gen)
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, _levels(cache), heads_q=2)
    q = _randn(gen, cache.batch, 2, DIM, dtype=torch.float32, device=device)
    last = cache.last_page_len.clone()
    last[0] += 1  # sequence 0's own one token, and now a second on its page
    grown = tilegen.PagedKVCache(cache.k_pages, cache.v_pages, cache.indptr, cache.indices, last)
    cascade.run(q, grown)  # not checked without the flag: run reads no page table
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    cascade.run(q, cache)
    with pytest.raises(ValueError, match=r"sequence 0's pages through the levels \(6 pages, 41 tokens\) differ from "
                                         r"the cache's page table \(6 pages, 42 tokens\).*changed since plan"):
        cascade.run(q, grown)


def test_run_checks_its_arguments(device):
    gen = torch.Generator().manual_seed(4)
    cache = tree_cache(8, 1, torch.float32, device, gen)
    cascade = tilegen.CascadeAttention()
    with pytest.raises(RuntimeError, match="plan"):
        cascade.run(torch.zeros(7, 2, DIM, device=device), cache)
    with pytest.raises(ValueError, match="heads_q"):
        cascade.plan(cache, _levels(cache), heads_q=0)
    cascade.plan(cache, _levels(cache), heads_q=2)
    with pytest.raises(ValueError, match=r"q: expected \[7, 2, 32\]"):
        cascade.run(torch.zeros(6, 2, DIM, device=device), cache)
    with pytest.raises(ValueError, match="q: torch.float16"):
        cascade.run(torch.zeros(7, 2, DIM, device=device, dtype=torch.float16), cache)
    with pytest.raises(ValueError, match="windows|window"):
        tilegen.families.attention_cascade.CascadeSpec(head_dim=32, mask="window")


def test_split_chunks_merge_to_the_same_answer(device, monkeypatch):
    """Every node cut into chunks of one key block: many states per token, merged by their LSE."""
    from tilegen.families.attention_cascade import schedule

    monkeypatch.setattr(schedule, "chunk_keys", lambda block_n, work, programs, floor: block_n)
    gen = torch.Generator().manual_seed(12)
    # Own tails past 128 keys: split at any key block a config takes, on the interpreter's 16 or a GPU row's 128.
    cache = tree_cache(8, 2, torch.float32, device, gen, tails=(1, 9, 140, 4, 133, 12, 1))
    q = _randn(gen, cache.batch, 4, DIM, dtype=torch.float32, device=device)
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=4, return_lse=True)
    assert cascade._plan.launch_args["states_pad"] >= 4
    assert not cascade._plan.launch_args["fused"], "split last-level chunks: the merge launch combines them"
    out, lse = cascade.run(q, cache)
    ref, ref_lse = paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32))
    _check(out, lse, ref, ref_lse, torch.float32)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_pages_over_levels(fmt, device):
    """FP8 pages with a scale per KV head: the cascade reads what PagedDecode reads, within bf16 noise
    of the float64 reference on the dequantized pages."""
    gen = torch.Generator().manual_seed(21)
    base = tree_cache(8, 2, torch.float32, device, gen)
    k_scale, v_scale = (torch.rand(2, generator=gen).to(device) + 0.5 for _ in range(2))
    k8, v8 = ((t / s[:, None]).to(fmt) for t, s in ((base.k_pages, k_scale), (base.v_pages, v_scale)))
    cache = tilegen.PagedKVCache(k8, v8, base.indptr, base.indices, base.last_page_len, k_scale=k_scale,
                                 v_scale=v_scale)
    q = _randn(gen, cache.batch, 8, DIM, dtype=torch.bfloat16, device=device)
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=8, return_lse=True)
    out, lse = cascade.run(q, cache)
    dequantized = tilegen.PagedKVCache(k8.float() * k_scale[:, None], v8.float() * v_scale[:, None], base.indptr,
                                       base.indices, base.last_page_len)
    ref, ref_lse = paged_reference(q.double(), dequantized, torch.arange(cache.batch + 1, dtype=torch.int32))
    _check(out, lse, ref, ref_lse, torch.bfloat16)
    with pytest.raises(ValueError, match="q_dtype"):
        cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=8, q_dtype=torch.float8_e4m3fn)


def test_tuning_problem_checks_fp8_and_causal(device):
    """The tuner's problem (one shared level over ragged own tails) passes its own check, FP8 included."""
    from tilegen.families import get
    from tilegen.families.attention_cascade import CascadeSpec
    from tilegen.tuning.measure import measure

    family = get("attention_cascade")
    for spec in (CascadeSpec(head_dim=32, q_per_kv=2, dtype="fp32", page_size=8, mask="causal", return_lse=True),
                 CascadeSpec(head_dim=32, q_per_kv=2, dtype="bf16", page_size=8, kv_dtype="fp8e4m3")):
        problem = family.problem(spec, family.buckets.of((40, 3)), on_gpu=device == "cuda")
        config = family.default_rule(spec, problem.device)[0][1]
        assert measure(problem, config, 0)["status"] == "ok"
        assert measure(problem, config, 0, perturb=True)["status"] == "wrong"


@pytest.mark.parametrize("row, value", [(0, 0.0), (0, math.inf), (0, math.nan), (1, -math.inf), (1, math.nan)],
                         ids=["finite-for-no-key", "inf-for-no-key", "nan-for-no-key", "minus-inf-for-keys", "nan"])
def test_tuning_check_holds_a_row_without_keys_to_minus_inf(row, value):
    """Request 0 holds no token at all, so its LSE is -inf: only exactly -inf passes there, only a finite value
    elsewhere, and NaN nowhere (a -inf row compared by relative error is NaN, which no tolerance catches)."""
    from tilegen.families import get
    from tilegen.families.attention_cascade import CascadeSpec
    from tilegen.families.attention_cascade.reference import cascade_reference

    family = get("attention_cascade")
    spec = CascadeSpec(head_dim=DIM, q_per_kv=2, dtype="fp32", page_size=8, return_lse=True)
    problem = dataclasses.replace(family.problem(spec, family.buckets.of((40, 3)), on_gpu=False), prefix=0,
                                  own=(0, 3, 9))
    inputs = problem.inputs(seed=0)
    ref, ref_lse = cascade_reference(inputs["q"], inputs["k"], inputs["v"], inputs["levels"], causal=False,
                                     scale=1.0 / math.sqrt(DIM))
    assert torch.isneginf(ref_lse[0]).all() and torch.isfinite(ref_lse[1:]).all()
    lse = ref_lse.float()
    assert problem.check(inputs, (ref.float(), lse))[0] < problem.tolerance
    lse[row, 1] = value
    assert problem.check(inputs, (ref.float(), lse))[0] == math.inf


@st.composite
def _shared_batches(draw):
    """A batch of sequences that share runs of pages with their neighbours: each sequence starts by
    re-listing the first pages of the one before it (any number of them, none included), then adds pages
    and a partial last page of its own."""
    page_size = draw(st.sampled_from([1, 8]))
    batch = draw(st.integers(1, 5))
    sequences, lasts = [], []
    next_page = 0
    for b in range(batch):
        prev = sequences[-1] if sequences else []
        full_prev = prev if not prev or lasts[-1] == page_size else prev[:-1]
        keep = draw(st.integers(0, len(full_prev)))
        own = draw(st.integers(0 if keep else 1, 3))
        pages = full_prev[:keep] + list(range(next_page, next_page + own))
        next_page += own
        sequences.append(pages)
        lasts.append(draw(st.integers(1, page_size)) if own else page_size)
    return page_size, sequences, lasts, draw(st.integers(1, 3)), draw(st.booleans())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_shared_batches())
def test_any_shared_batch_matches_decode_over_its_page_tables(case, device):
    """Whatever the neighbours share, the derived levels give the answer of each sequence over its whole
    page list (the float64 reference on gathered pages)."""
    page_size, sequences, lasts, group, fp32 = case
    dtype = torch.float32 if fp32 else torch.bfloat16
    gen = torch.Generator().manual_seed(len(sequences) * 31 + page_size)
    num_pages = max([p for s in sequences for p in s], default=0) + 2
    k_pages = _randn(gen, num_pages, page_size, 1, DIM, dtype=dtype, device=device)
    v_pages = _randn(gen, num_pages, page_size, 1, DIM, dtype=dtype, device=device)
    indptr = [0]
    for s in sequences:
        indptr.append(indptr[-1] + len(s))

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    cache = tilegen.PagedKVCache(k_pages, v_pages, ints(indptr), ints([p for s in sequences for p in s]), ints(lasts))
    q = _randn(gen, cache.batch, group, DIM, dtype=dtype, device=device)
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=group, return_lse=True)
    out, lse = cascade.run(q, cache)
    ref, ref_lse = paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32))
    _check(out, lse, ref, ref_lse, dtype)


def test_levels_of_a_prefix_chain_deeper_than_pythons_recursion_limit(device):
    """Sequence i shares pages 0..i with sequence i + 1 (requests that each extend the one before, as a beam or a
    tree search makes them): a tree of one level per sequence, deeper than Python's recursion limit."""
    import sys

    batch = sys.getrecursionlimit() + 50
    seqs = [list(range(i + 1)) + [batch + i] for i in range(batch)]
    indptr = [0]
    for s in seqs:
        indptr.append(indptr[-1] + len(s))
    pages = torch.zeros(2 * batch, 1, 1, 16, device=device)
    cache = tilegen.PagedKVCache(pages, pages.clone(), *(torch.tensor(x, dtype=torch.int32, device=device) for x in
                                                          (indptr, [p for s in seqs for p in s], [1] * batch)))
    levels = tilegen.cascade_levels(cache)
    # A level per shared page (batch - 1 of them: page i is the last batch - i sequences'), then the last level's
    # own pages: each sequence's one, and the last sequence's final shared page beside it.
    assert len(levels) == batch
    assert levels[0].kv_indptr.tolist() == [0, 1] and levels[-1].kv_indptr[-1].item() == batch + 1


@pytest.mark.parametrize("qo_lens", [1, torch.tensor(1), torch.tensor([[1]])], ids=["int", "0-d", "2-d"])
def test_qo_lens_that_is_no_list_of_lengths_is_refused_by_name(device, qo_lens):
    pages = torch.zeros(2, 1, 1, 16, device=device)
    cache = tilegen.PagedKVCache(pages, pages.clone(), *(torch.tensor(x, dtype=torch.int32, device=device) for x in
                                                          ([0, 1], [0], [1])))
    with pytest.raises(ValueError, match="qo_lens: expected 1 ints >= 0"):
        tilegen.cascade_levels(cache, qo_lens=qo_lens)

