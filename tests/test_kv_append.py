"""``tilegen.append_kv``: the new tokens of a ragged batch written into a paged cache in one launch.

Every page starts as NaN and the check (the family's own, over the float64 reference) wants
the target slots to hold the new values exactly and every other slot (earlier tokens, the
unused slots of last pages, spare pages) to keep its poison: a kernel that writes outside
its slots fails. Pages sit in shuffled order; prefix lengths 0, 1, page_size - 1, page_size,
page_size + 1 and a long one share a batch; token counts are no multiple of any block.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from helpers import assert_guard_bands, compile_for_sm90, inside, kernel_globals_are_constexpr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import tilegen
from tilegen import dispatch
from tilegen.cli import app
from tilegen.codegen import module_for, source_for
from tilegen.db import TuningDB, tuned_rows
from tilegen.device import device_info
from tilegen.families import family_of, get
from tilegen.families.kv_append import KVAppendSpec
from tilegen.families.kv_append.problem import check_pages
from tilegen.families.kv_append.reference import target_slots
from tilegen.families.kv_append.spec import PAGE_SIZES
from tilegen.ir import SpecError
from tilegen.families import spec_from_json
from tilegen.key import TuningKey
from tilegen.ops.append import explain_append
from tilegen.ops.kv_cache import PAGE_SIZES as CACHE_PAGE_SIZES
from tilegen.ops.kv_cache import PagedKVCache
from tilegen.tuning import Tuner

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = device_info()


def make_batch(context, new, *, page_size, kv_heads=2, dim=40, dim_v=None, dtype=torch.float32, device="cpu",
               seed=0, spare_pages=3, strided=False):
    """A poisoned cache whose page table already counts the new tokens, and the new K, V, cu_seqlens.

    ``strided``: K and V pages are halves of one [num_pages, 2, page_size, heads, dim] tensor and the
    new K and V slices of wider tensors, so that no stride is the contiguous one.
    """
    dim_v = dim if dim_v is None else dim_v
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(context, new)]
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + spare_pages
    order = torch.randperm(num_pages, generator=gen)  # shuffled: a sequence's pages are not adjacent
    indices = order[: sum(pages)].to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    total = sum(new)
    if strided:
        assert dim_v == dim
        kv = torch.full((num_pages, 2, page_size, kv_heads, dim), math.nan, dtype=dtype, device=device)
        k_pages, v_pages = kv[:, 0], kv[:, 1]
        k = torch.randn(total, kv_heads, dim + 8, generator=gen).to(device, dtype)[..., 3 : 3 + dim]
        v = torch.randn(kv_heads, total, dim, generator=gen).to(device, dtype).transpose(0, 1)
    else:
        k_pages = torch.full((num_pages, page_size, kv_heads, dim), math.nan, dtype=dtype, device=device)
        v_pages = torch.full((num_pages, page_size, kv_heads, dim_v), math.nan, dtype=dtype, device=device)
        k = torch.randn(total, kv_heads, dim, generator=gen).to(device, dtype)
        v = torch.randn(total, kv_heads, dim_v, generator=gen).to(device, dtype)
    cache = PagedKVCache(k_pages, v_pages, indptr.to(device), indices.to(device), last.to(device))
    return cache, k, v, cu.to(device)


def check(cache, k, v, cu):
    """The family's check: inf when a slot outside the targets changed or a target holds NaN."""
    return check_pages(cache.k_pages, cache.v_pages, cache.indptr, cache.indices, cache.last_page_len, k, v, cu)


def assert_appended(cache, k, v, cu):
    error, max_error = check(cache, k, v, cu)
    assert error == 0.0 and max_error == 0.0, (error, max_error)  # a copy: exact


def prefixes(page_size):
    """Prefix lengths the issue asks for, in one batch: 0, 1, p - 1, p, p + 1 and a long one."""
    return [0, 1, page_size - 1, page_size, page_size + 1, 20 * page_size + 3]


# ---------------------------------------------------------------------------- against the reference

@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mixed_prefixes_in_one_batch(page_size, dtype, device):
    context = prefixes(page_size)
    new = [3, 1, 2, 0, page_size + 2, 5]  # one sequence gets nothing; one crosses pages
    cache, k, v, cu = make_batch(context, new, page_size=page_size, kv_heads=3, dim=40, dim_v=24,
                                 dtype=DTYPES[dtype], device=device)
    tilegen.append_kv(cache, k, v, cu)
    assert_appended(cache, k, v, cu)


def test_the_check_sees_a_write_outside_the_targets_and_an_unwritten_target(device):
    cache, k, v, cu = make_batch([5, 0, 17], [2, 3, 4], page_size=16, device=device)
    assert check(cache, k, v, cu) == (math.inf, math.inf)  # nothing written yet
    tilegen.append_kv(cache, k, v, cu)
    assert_appended(cache, k, v, cu)
    pages, slots = target_slots(cache.indptr, cache.indices, cache.last_page_len, cu, 16)
    page, slot = int(pages[0]), int(slots[0])
    targets = set(zip(pages.tolist(), slots.tolist()))
    stray = next(s for s in range(16) if (page, s) not in targets)
    saved = cache.v_pages[page, stray].clone()
    cache.v_pages[page, stray] = 1.0  # a neighbouring slot of a target, in V only
    assert check(cache, k, v, cu) == (math.inf, math.inf)
    cache.v_pages[page, stray] = saved
    cache.k_pages[page, slot, 1, 7] = math.nan  # one element of one target not written
    assert check(cache, k, v, cu) == (math.inf, math.inf)


def test_strided_pages_and_inputs(device):
    # vLLM keeps K and V as halves of one tensor; new K, V often come out of a fused projection.
    cache, k, v, cu = make_batch([3, 16, 40], [5, 1, 9], page_size=16, dim=32, strided=True, device=device)
    assert not k.is_contiguous() and not v.is_contiguous() and not cache.k_pages.is_contiguous()
    tilegen.append_kv(cache, k, v, cu)
    assert_appended(cache, k, v, cu)


def test_a_cache_built_from_a_block_table(device):
    page_size, lens, new = 8, [9, 1, 24], [4, 1, 8]
    gen = torch.Generator().manual_seed(3)
    block_table = torch.randperm(12, generator=gen)[:12].reshape(3, 4).to(torch.int32)
    k_pages = torch.full((12, page_size, 2, 16), math.nan, device=device)
    v_pages = torch.full((12, page_size, 2, 16), math.nan, device=device)
    cache = PagedKVCache.from_block_table(k_pages, v_pages, block_table.to(device),
                                          torch.tensor(lens, device=device))
    k = torch.randn(sum(new), 2, 16, generator=gen).to(device)
    v = torch.randn(sum(new), 2, 16, generator=gen).to(device)
    cu = torch.tensor([0, 4, 5, 13], dtype=torch.int32, device=device)
    tilegen.append_kv(cache, k, v, cu)
    assert_appended(cache, k, v, cu)
    # The last new token of sequence 2 (position 23) is slot 7 of its third page.
    torch.testing.assert_close(cache.k_pages[int(block_table[2, 2]), 7], k[12], rtol=0, atol=0)


def test_decode_steps_extend_what_was_appended(device):
    """Decode: each step grows the page table by one token per sequence, then appends that token."""
    page_size, heads, dim = 8, 2, 8
    k_pages = torch.full((9, page_size, heads, dim), math.nan, device=device)
    v_pages = torch.full_like(k_pages, math.nan)
    block_table = torch.tensor([[4, 0, 7], [2, 8, 5]], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(2, 12, heads, dim, generator=gen).to(device)
    lens = torch.tensor([7, 0])
    cache = PagedKVCache.from_block_table(k_pages, v_pages, block_table, lens.to(device))
    prefill = torch.tensor([0, 7, 7], dtype=torch.int32, device=device)  # sequence 1 starts empty
    tilegen.append_kv(cache, rows[0, :7], -rows[0, :7], prefill)
    for step in range(5):
        lens += 1
        cache = PagedKVCache.from_block_table(k_pages, v_pages, block_table, lens.to(device))
        new = torch.stack([rows[0, 7 + step], rows[1, step]])
        tilegen.append_kv(cache, new, -new, torch.tensor([0, 1, 2], dtype=torch.int32, device=device))
    for b, n in enumerate(lens.tolist()):
        got = torch.stack([k_pages[int(block_table[b, t // page_size]), t % page_size] for t in range(n)])
        torch.testing.assert_close(got, rows[b, :n], rtol=0, atol=0)
    torch.testing.assert_close(v_pages[4], -rows[0, :8], rtol=0, atol=0)
    assert torch.isnan(k_pages[[1, 3, 5, 6, 7, 8]]).all()  # pages no sequence owns
    assert torch.isnan(k_pages[0, 4:]).all() and torch.isnan(v_pages[2, 5:]).all()  # last pages' free slots


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    page_size=st.sampled_from([1, 8, 16, 64]),
    batch=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 9)), min_size=1, max_size=5),
    heads=st.integers(1, 3),
    dim=st.sampled_from([8, 20, 32]),
    dtype=st.sampled_from(["fp32", "bf16", "fp16"]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_ragged_batches(page_size, batch, heads, dim, dtype, seed, device):
    context, new = [c for c, _ in batch], [n for _, n in batch]
    cache, k, v, cu = make_batch(context, new, page_size=page_size, kv_heads=heads, dim=dim,
                                 dtype=DTYPES[dtype], device=device, seed=seed)
    tilegen.append_kv(cache, k, v, cu)
    assert_appended(cache, k, v, cu)


def test_nothing_to_append_launches_nothing(device):
    cache, k, v, cu = make_batch([3, 0], [0, 0], page_size=8, device=device)
    tilegen.append_kv(cache, k, v, cu)
    assert torch.isnan(cache.k_pages).all() and torch.isnan(cache.v_pages).all()


def test_a_planned_call_reads_nothing_back_to_the_host(device, monkeypatch):
    """No synchronization: once planned, a call reads no device value on the host, so a CUDA graph
    can capture it. The launch is recorded while every host read of a tensor raises, then run."""
    from tilegen.ops import append

    cache, k, v, cu = make_batch([5, 17], [3, 2], page_size=16, device=device)
    tilegen.append_kv(cache, k, v, cu)  # plans the call
    (key, plan), = append._plans.items()
    calls = []
    append._plans[key] = dataclasses.replace(plan, launch=lambda *a, **kw: calls.append((a, kw)))

    def refuse(*args, **kwargs):
        raise AssertionError("the op read a device value on the host")

    with monkeypatch.context() as patched:
        for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy"):
            patched.setattr(torch.Tensor, name, refuse)
        tilegen.append_kv(cache, k, v, cu)
    (args, kwargs), = calls
    cache.k_pages.fill_(math.nan)
    cache.v_pages.fill_(math.nan)
    plan.launch(*args, **kwargs)
    assert_appended(cache, k, v, cu)


@pytest.mark.gpu
def test_a_cuda_graph_replays_the_append():
    cache, k, v, cu = make_batch([5, 17, 0], [3, 2, 4], page_size=16, device="cuda")
    tilegen.append_kv(cache, k, v, cu)  # plan and compile outside the capture
    cache.k_pages.fill_(math.nan)
    cache.v_pages.fill_(math.nan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tilegen.append_kv(cache, k, v, cu)
    fresh_k, fresh_v = torch.randn_like(k), torch.randn_like(v)
    k.copy_(fresh_k)
    v.copy_(fresh_v)
    graph.replay()
    torch.cuda.synchronize()
    assert_appended(cache, fresh_k, fresh_v, cu)


# ------------------------------------------------------------------------------- device values

@pytest.mark.parametrize(
    "cu_values, message",
    [
        pytest.param([1, 3, 5], "cu_seqlens: must start at 0", id="not-from-0"),
        pytest.param([0, 4, 2], "cu_seqlens: must be non-decreasing", id="decreasing"),
        pytest.param([0, 2, 4], "cu_seqlens: ends at 4 but k has 5 tokens", id="short-of-k"),
        pytest.param([0, 4, 5], "cu_seqlens: sequence 0 appends 4 tokens but the page table gives it only 3",
                     id="more-new-than-held"),
    ],
)
def test_debug_mode_checks_device_values(cu_values, message, device, monkeypatch):
    cache, k, v, _ = make_batch([1, 6], [2, 3], page_size=8, device=device)
    cu = torch.tensor(cu_values, dtype=torch.int32, device=device)
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    with pytest.raises(ValueError, match="^" + message):
        tilegen.append_kv(cache, k, v, cu)
    assert torch.isnan(cache.k_pages).all()  # refused before the launch


def test_debug_mode_checks_a_page_table_changed_in_place(device, monkeypatch):
    cache, k, v, cu = make_batch([1, 6], [2, 3], page_size=8, device=device)
    cache.indices[0] = cache.num_pages  # after the cache was built
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    with pytest.raises(ValueError, match="^indices: page indices outside"):
        tilegen.append_kv(cache, k, v, cu)


def test_without_debug_mode_rows_that_do_not_fit_are_skipped_not_written_elsewhere(device):
    # Sequence 0 holds 3 tokens but cu_seqlens gives it 4 new ones: its first row has no position.
    # The page of sequence 1's new token (position 8: its second page) lies past the cache.
    # Nothing may land anywhere else.
    cache, k, v, _ = make_batch([1, 6], [2, 3], page_size=8, device=device, spare_pages=2)
    cu = torch.tensor([0, 4, 5], dtype=torch.int32, device=device)
    cache.indices[2] = cache.num_pages + 5
    tilegen.append_kv(cache, k, v, cu)
    page0 = int(cache.indices[0])
    torch.testing.assert_close(cache.k_pages[page0, :3], k[1:4], rtol=0, atol=0)  # rows 1..3 at positions 0..2
    cache.k_pages[page0, :3] = math.nan
    assert torch.isnan(cache.k_pages).all() and torch.isnan(cache.v_pages[:, 3:]).all()


APPEND_FAULTS = [
    # (fault, the sequences it spoils) for a batch of three sequences
    pytest.param("indptr-past-indices", {2}),
    pytest.param("indptr-negative", {0}),
    pytest.param("indptr-decreasing", {0, 1}),
    pytest.param("last-page-empty", {1}),
    pytest.param("last-page-too-long", {1}),
    pytest.param("page-negative", {1}),
    pytest.param("cu-past-the-rows", {2}),
    pytest.param("cu-negative", {0}),
    pytest.param("cu-decreasing", {0, 1}),
]


@pytest.mark.parametrize("fault, spoiled", APPEND_FAULTS, ids=[p.values[0] for p in APPEND_FAULTS])
def test_without_debug_mode_wrong_values_write_only_inside_the_cache(fault, spoiled, device, monkeypatch):
    """The page table and cu_seqlens wrong in value, the pages between rows of a pattern, the page
    table between entries of -1: the pattern stays, and the well-formed sequences' pages hold
    what a correct append writes."""
    monkeypatch.delenv("TILEGEN_DEBUG", raising=False)
    cache, k, v, cu = make_batch([1, 6, 20], [2, 3, 4], page_size=8, device=device, spare_pages=2)
    right = PagedKVCache(cache.k_pages.clone(), cache.v_pages.clone(), cache.indptr, cache.indices,
                         cache.last_page_len)
    tilegen.append_kv(right, k, v, cu)
    indptr, indices, last, offsets = (t.tolist() for t in (cache.indptr, cache.indices, cache.last_page_len, cu))
    if fault == "indptr-past-indices":
        indptr[-1] = len(indices) + 3
    elif fault == "indptr-negative":
        indptr[0] = -2
    elif fault == "indptr-decreasing":
        indptr[1] = -1  # sequence 1's page list now starts with sequence 0's pages
    elif fault == "last-page-empty":
        last[1] = 0
    elif fault == "last-page-too-long":
        last[1] = 8 + 3
    elif fault == "page-negative":
        indices[indptr[1]] = -1
    elif fault == "cu-past-the-rows":
        offsets[-1] += 5
    elif fault == "cu-negative":
        offsets[0] = -3
    else:
        assert fault == "cu-decreasing", fault
        offsets[1] = -1  # sequence 1 now claims sequence 0's rows too
    k_pages, k_buffer = inside(cache.k_pages, 2, -77.0)
    v_pages, v_buffer = inside(cache.v_pages, 2, -77.0)
    table = (inside(torch.tensor(x, dtype=torch.int32, device=device), 4, -1)[0] for x in (indptr, indices, last))
    bad = PagedKVCache(k_pages, v_pages, *table)
    tilegen.append_kv(bad, k, v, torch.tensor(offsets, dtype=torch.int32, device=device))
    for buffer in (k_buffer, v_buffer):
        assert_guard_bands(buffer, 2, -77.0)
    right_indptr = cache.indptr.tolist()
    for b in set(range(3)) - spoiled:
        pages = cache.indices[right_indptr[b] : right_indptr[b + 1]].long()
        for got, want in ((k_pages, right.k_pages), (v_pages, right.v_pages)):
            assert torch.equal(got[pages].nan_to_num(), want[pages].nan_to_num()), f"sequence {b} changed"


# ---------------------------------------------------------------------------------- bad input

def _raises(exc, prefix):
    import re

    return pytest.raises(exc, match="^" + re.escape(prefix))


BAD = [
    ("cache", lambda c, k, v, cu: ("not a cache", k, v, cu), TypeError, "cache: expected a tilegen.PagedKVCache"),
    ("k-rank", lambda c, k, v, cu: (c, k[0], v, cu), ValueError, "k: expected 3 dims"),
    ("k-dtype", lambda c, k, v, cu: (c, k.half(), v, cu), TypeError, "k: dtype torch.float16 differs"),
    ("v-dtype", lambda c, k, v, cu: (c, k, v.double(), cu), TypeError, "v: dtype torch.float64 differs"),
    ("k-heads", lambda c, k, v, cu: (c, k[:, :1], v, cu), ValueError, "k: 1 KV heads, the cache has 2"),
    ("v-heads", lambda c, k, v, cu: (c, k, torch.cat([v, v], 1), cu), ValueError, "v: 4 KV heads"),
    ("k-dim", lambda c, k, v, cu: (c, k[..., :32], v, cu), ValueError, "k: head_dim 32 differs from the cache's 40"),
    ("v-dim", lambda c, k, v, cu: (c, k, v[..., :8], cu), ValueError, "v: head_dim_v 8 differs from the cache's 24"),
    ("v-tokens", lambda c, k, v, cu: (c, k, v[:-1], cu), ValueError, "v: 4 tokens while k has 5"),
    ("v-not-tensor", lambda c, k, v, cu: (c, k, v.tolist(), cu), TypeError, "v: expected a torch.Tensor"),
    ("cu-dtype", lambda c, k, v, cu: (c, k, v, cu.long()), ValueError, "cu_seqlens: expected a 1-d int32 tensor"),
    ("cu-rank", lambda c, k, v, cu: (c, k, v, cu[None]), ValueError, "cu_seqlens: expected a 1-d int32 tensor"),
    ("cu-length", lambda c, k, v, cu: (c, k, v, cu[:-1]), ValueError,
     "cu_seqlens: 2 entries, expected batch + 1 = 3"),
    ("cu-list", lambda c, k, v, cu: (c, k, v, cu.tolist()), TypeError, "cu_seqlens: expected a torch.Tensor"),
]


@pytest.mark.parametrize("make, exc, prefix", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_input_names_the_argument(make, exc, prefix, device):
    cache, k, v, cu = make_batch([1, 6], [2, 3], page_size=8, dim=40, dim_v=24, device=device)
    with _raises(exc, prefix):
        tilegen.append_kv(*make(cache, k, v, cu))
    assert torch.isnan(cache.k_pages).all()


def test_bad_input_on_another_device_or_a_cache_of_no_sequence(device):
    cache, k, v, cu = make_batch([1, 6], [2, 3], page_size=8, device=device)
    with _raises(ValueError, "k: on meta while the cache is on"):
        tilegen.append_kv(cache, k.to("meta"), v, cu)
    with _raises(ValueError, "cu_seqlens: on meta"):
        tilegen.append_kv(cache, k, v, cu.to("meta"))
    empty = PagedKVCache(cache.k_pages, cache.v_pages, cache.indptr[:1], cache.indices, cache.last_page_len[:0])
    with _raises(ValueError, "k: 5 new tokens for a cache of no sequence"):
        tilegen.append_kv(empty, k, v, cu[:1])


@pytest.mark.parametrize("source", ["k", "v"])
def test_new_tokens_sharing_memory_with_the_pages_are_refused(source, device):
    # Read while the pages are written: the rows of the first sequence land on slots the second still reads.
    cache, k, v, cu = make_batch([0, 20], [30, 9], page_size=8, dim=8, spare_pages=6, device=device)
    pages = cache.k_pages if source == "k" else cache.v_pages
    pages.copy_(torch.randn_like(pages))
    alias = pages.view(-1, 2, 8)[: k.shape[0]]
    before = (cache.k_pages.clone(), cache.v_pages.clone())
    with _raises(ValueError, f"{source}: overlaps cache.{source}_pages in memory"):
        tilegen.append_kv(cache, *((alias, v) if source == "k" else (k, alias)), cu)
    assert torch.equal(cache.k_pages.nan_to_num(), before[0].nan_to_num())
    assert torch.equal(cache.v_pages.nan_to_num(), before[1].nan_to_num())
    tilegen.append_kv(cache, *((alias.clone(), v) if source == "k" else (k, alias.clone())), cu)  # a copy is taken


def test_a_head_dim_past_the_kernel_s_bound_is_refused(device):
    cache, k, v, cu = make_batch([1], [2], page_size=8, dim=520, device=device)
    with _raises(ValueError, "k: head dim 520 is not supported; expected 1..512"):
        tilegen.append_kv(cache, k, v, cu)


# ---------------------------------------------------------------------------------- the spec

def test_spec_page_sizes_follow_the_cache_and_the_json_round_trips():
    assert PAGE_SIZES == CACHE_PAGE_SIZES
    spec = KVAppendSpec(head_dim=128, head_dim_v=128, page_size=16)
    assert spec.head_dim_v is None and spec.name == "kv_append_bf16_d128_p16"
    assert spec_from_json(spec.to_json()) == spec and family_of(spec) is get("kv_append")
    assert KVAppendSpec(head_dim=128, page_size=64).hash != spec.hash  # page size is part of the key
    with pytest.raises(SpecError, match="^page_size"):
        KVAppendSpec(head_dim=128, page_size=4)
    with pytest.raises(SpecError, match="^head_dim_v"):
        KVAppendSpec(head_dim=128, head_dim_v=0, page_size=16)


def test_generated_source_specializes_the_page_arithmetic():
    source = source_for(KVAppendSpec(head_dim=40, head_dim_v=24, page_size=64, dtype="fp16"))
    assert "PAGE_SHIFT = tl.constexpr(6)" in source and "{{" not in source
    compile(source, "<generated>", "exec")
    kernel_globals_are_constexpr(source)


# -------------------------------------------------------------------- dispatch, tune, db list

SPEC = KVAppendSpec(head_dim=40, head_dim_v=24, page_size=16, dtype="fp32")


def test_the_problem_poisons_its_pages_and_its_check_fails_until_written():
    family = get("kv_append")
    problem = family.problem(SPEC, 32, on_gpu=not DEVICE.is_interpreter)
    assert problem.total_new == (32 if problem.on_gpu else 29)  # 3 short of the bucket on the CPU
    inputs = problem.inputs(seed=1)
    outputs = problem.outputs(inputs)
    assert torch.isnan(outputs[0]).all() and torch.isnan(outputs[1]).all()
    assert problem.check(inputs, outputs) == (math.inf, math.inf)
    problem.launch(module_for(SPEC), family.default_config(SPEC, DEVICE, 32), inputs, outputs)
    assert problem.check(inputs, outputs) == (0.0, 0.0) and problem.tolerance == 0.0
    outputs[1].view(-1)[torch.isfinite(outputs[1].view(-1)).nonzero()[0]] += 1  # one value wrong, by little
    error, _ = problem.check(inputs, outputs)
    assert not error <= problem.tolerance  # the tuner's gate: a copy must be exact
    pages, _ = target_slots(inputs.indptr, inputs.indices, inputs.last_page_len, inputs.cu_seqlens, 16)
    batch = len(problem.new_tokens)
    table = 4 * (2 * (batch + 1) + batch + len(set(pages.tolist())))
    assert problem.bytes_moved() == 2 * problem.total_new * problem.kv_heads * (40 + 24) * 4 + table


def test_dispatch_buckets_by_new_tokens_and_uses_the_default_untuned(device):
    cache, k, v, cu = make_batch([1, 6, 30], [20, 3, 17], page_size=16, dim=40, dim_v=24, device=device)
    choice = explain_append(cache, k, v, cu)
    assert (choice.source, choice.bucket) == ("default", 64)
    assert choice.config == get("kv_append").default_config(SPEC, DEVICE, 64)


@pytest.fixture
def tuned_db(tmp_path, monkeypatch):
    path = tmp_path / "tuning.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(path))
    with TuningDB(path) as db, Tuner(db, DEVICE, trials=3) as tuner:
        result = tuner.tune(SPEC, 64)
    assert result.best is not None and result.statuses["ok"] == 3
    return path, result


def test_a_tune_reaches_dispatch_the_op_and_db_list(tuned_db, device):
    path, result = tuned_db
    rows = tuned_rows(**TuningKey.current(SPEC, DEVICE).variant_fields())
    assert rows == {64: (result.best.config, str(path))}
    assert result.gbps is not None and result.gbps > 0
    dispatch.reset()
    cache, k, v, cu = make_batch([1, 6, 30], [20, 3, 17], page_size=16, dim=40, dim_v=24, device=device)
    choice = explain_append(cache, k, v, cu)
    assert (choice.config, choice.source, choice.tuned_bucket) == (result.best.config, str(path), 64)
    tilegen.append_kv(cache, k, v, cu)
    assert_appended(cache, k, v, cu)
    listed = CliRunner().invoke(app, ["db", "--db", str(path), "list"])
    assert listed.exit_code == 0, listed.output
    assert SPEC.name in listed.stdout and str(result.best.config) in listed.stdout


def test_the_benchmark_s_smoke_run_checks_and_times_the_append(tmp_path):
    from tilegen.bench import serving_kernels

    out = tmp_path / "bench.json"
    assert serving_kernels.main(["--smoke", "--parts", "append", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["provider"] for r in rows} >= {"tilegen", "tilegen-default", "torch-index-copy"}
    assert all(r["correct"] and r["gbps"] > 0 for r in rows)


def test_tilegen_tune_takes_the_preset(tmp_path):
    db = tmp_path / "cli.sqlite"
    result = CliRunner().invoke(app, ["tune", "--db", str(db), "--preset", "append-d128-p16", "--sizes", "20",
                                      "--trials", "1"])
    assert result.exit_code == 0, result.output
    with TuningDB(db) as opened:
        (row,) = opened.list_tuned()
    assert (row.family, row.bucket, row.variant_name) == ("kv_append", 32, "kv_append_bf16_d128_p16")


def test_paged_attention_reads_what_the_append_wrote(device):
    """Chunked prefill end to end: the page table grows, append writes the chunk, PagedAttention reads it.
    Both follow one convention for where new tokens live, or this differs from dense attention."""
    context, new, heads_q, heads_kv, dim = [0, 17, 5], [6, 3, 12], 4, 2, 32
    cache, k, v, cu = make_batch(context, new, page_size=16, kv_heads=heads_kv, dim=dim, device=device, seed=7)
    gen = torch.Generator().manual_seed(8)
    prefix_k = [torch.randn(c, heads_kv, dim, generator=gen).to(device) for c in context]
    prefix_v = [torch.randn(c, heads_kv, dim, generator=gen).to(device) for c in context]
    for b, c in enumerate(context):  # earlier tokens, written the slow way
        for t in range(c):
            page = int(cache.indices[int(cache.indptr[b]) + t // 16])
            cache.k_pages[page, t % 16] = prefix_k[b][t]
            cache.v_pages[page, t % 16] = prefix_v[b][t]
    tilegen.append_kv(cache, k, v, cu)
    q = torch.randn(sum(new), heads_q, dim, generator=gen).to(device)
    attn = tilegen.PagedAttention()
    attn.plan(cu, cache, heads_q=heads_q, causal=True)
    out = attn.run(q, cache)
    for b in range(len(new)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        keys = torch.cat([prefix_k[b], k[rows]])[None].transpose(1, 2)
        values = torch.cat([prefix_v[b], v[rows]])[None].transpose(1, 2)
        dense = tilegen.attention(q[rows][None].transpose(1, 2), keys, values, causal=True)
        torch.testing.assert_close(out[rows], dense[0].transpose(0, 1), rtol=1e-4, atol=1e-4)


def test_the_custom_op_passes_opcheck(device):
    cache, k, v, cu = make_batch([3, 17], [2, 5], page_size=16, device=device)
    cache.k_pages.normal_()  # opcheck compares runs: no NaN, which never equals itself
    cache.v_pages.normal_()
    args = (cache.k_pages, cache.v_pages, cache.indptr, cache.indices, cache.last_page_len, k, v, cu)
    torch.library.opcheck(torch.ops.tilegen.append_kv.default, args)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_fullgraph(device, backend):
    cache, k, v, cu = make_batch([3, 17, 0], [2, 5, 1], page_size=16, device=device)

    def step(cache, k, v, cu):
        tilegen.append_kv(cache, k * 1, v, cu)  # k * 1: a traced value, not just an input
        return cache.k_pages.sum()

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=backend)(cache, k, v, cu)
    assert_appended(cache, k, v, cu)


def test_the_kernel_compiles_for_an_h200(tmp_path):
    """What the interpreter runs, the sm90 compiler must accept (block shapes, types, constexprs)."""
    pytest.importorskip("triton.backends.nvidia")
    configs = [{"BLOCK_T": 1, "BLOCK_H": 8, "num_warps": 2}, {"BLOCK_T": 64, "BLOCK_H": 1, "num_warps": 8}]
    for spec, dtype in ((KVAppendSpec(head_dim=128, page_size=16), "bf16"),
                        (KVAppendSpec(head_dim=40, head_dim_v=24, page_size=1, dtype="fp32"), "fp32")):
        pointers = {**dict.fromkeys(("K", "V", "KPages", "VPages"), f"*{dtype}"),
                    **dict.fromkeys(("CuSeqlens", "Indptr", "Indices", "LastPageLen"), "*i32")}
        request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "configs": configs}
        compile_for_sm90(request, tmp_path, kernels=len(configs))
