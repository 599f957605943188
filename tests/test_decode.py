"""Batch decode over a paged cache against the float64 reference on gathered pages.

Contexts of 0, 1, page_size - 1, page_size + 1 and 1000 tokens share a batch; pages are
shuffled, unused pages and slots are NaN; split counts 1, 2 and 7 are forced through
``plan(num_splits=...)`` and must agree with a single pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import assert_guard_bands, compile_for_sm90, inside
from test_varlen import PAGE, PAGE_TABLE_FAULTS, PAGED_K_LENS, guarded_cache, make_cache, paged_reference

import tilegen
from tilegen.families import relative_error


def _contexts(page_size):
    return [0, 1, max(1, page_size - 1), page_size + 1, 1000]


def _check(out, lse, ref, ref_lse, dtype):
    assert not torch.isnan(out).any(), "output elements never written"
    error, _ = relative_error(out.cpu(), ref)
    assert error < (1e-4 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"
    if lse is not None:
        lse = lse.cpu()
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse must be -inf exactly on empty contexts"
        seen = torch.isfinite(ref_lse)
        if seen.any():  # a batch of empty contexts has no finite LSE to compare
            assert (lse.double()[seen] - ref_lse[seen]).abs().max() < 1e-4


@pytest.mark.parametrize("splits", [1, 2, 7])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"gqa{g}")
def test_decode_matches_reference(page_size, group, splits, device):
    gen = torch.Generator().manual_seed(page_size + group + splits)
    dtype = torch.bfloat16 if group == 4 else torch.float32
    cache = make_cache(_contexts(page_size), page_size, 2 if group != 8 else 1, 32, dtype, device, gen)
    heads_q = cache.kv_heads * group
    q = torch.randn(cache.batch, heads_q, 32, generator=gen).to(device=device, dtype=dtype)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=heads_q, return_lse=True, num_splits=splits)
    assert decode.num_splits == splits
    out = torch.full((cache.batch, heads_q, 32), math.nan, dtype=dtype, device=device)
    result, lse = decode.run(q, cache, out=out)
    assert result is out
    ref, ref_lse = paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32))
    _check(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("splits", [1, 2])
def test_a_plan_under_another_default_dtype_makes_the_same_buffers_and_run(splits, device):
    """Under torch.set_default_dtype(torch.float64) a plan's buffers are the fp32 ones it makes otherwise (an unsplit
    plan's placeholders took the default dtype, a float64 pointer in the kernel's signature), and its run is the run
    made outside."""
    gen = torch.Generator().manual_seed(31 + splits)
    cache = make_cache(_contexts(16), 16, 2, 32, torch.bfloat16, device, gen)
    q = torch.randn(cache.batch, 8, 32, generator=gen).to(device=device, dtype=torch.bfloat16)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=8, return_lse=True, num_splits=splits)
    want = decode.run(q, cache)
    dtypes = (decode._plan.part_o.dtype, decode._plan.part_lse.dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        decode.plan(cache, heads_q=8, return_lse=True, num_splits=splits)
        got = decode.run(q, cache)
    finally:
        torch.set_default_dtype(previous)
    assert (decode._plan.part_o.dtype, decode._plan.part_lse.dtype) == dtypes == (torch.float32, torch.float32)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g.nan_to_num(), w.nan_to_num())


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_reads_a_head_major_cache(splits, device):
    """Pages stored [num_pages, kv_heads, page_size, dim] (FlashInfer's HND layout), handed over as
    their [num_pages, page_size, kv_heads, dim] view: the kernel follows the strides, so each
    head's page is one contiguous run."""
    gen = torch.Generator().manual_seed(11 + splits)
    nhd = make_cache(_contexts(16), 16, 2, 32, torch.bfloat16, device, gen)
    k_hnd, v_hnd = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (nhd.k_pages, nhd.v_pages))
    assert k_hnd.stride(2) == 16 * 32 and torch.equal(k_hnd.nan_to_num(), nhd.k_pages.nan_to_num())
    cache = tilegen.PagedKVCache(k_hnd, v_hnd, nhd.indptr, nhd.indices, nhd.last_page_len)
    q = torch.randn(cache.batch, 8, 32, generator=gen).to(device=device, dtype=torch.bfloat16)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=8, return_lse=True, num_splits=splits)
    out = torch.full((cache.batch, 8, 32), math.nan, dtype=torch.bfloat16, device=device)
    _, lse = decode.run(q, cache, out=out)
    ref, ref_lse = paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32))
    _check(out, lse, ref, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("kwargs", [{"window": (20, 0)}, {"softcap": 3.0, "scale": 0.2}], ids=["window", "softcap"])
def test_decode_window_and_softcap_with_splits(kwargs, device):
    gen = torch.Generator().manual_seed(9)
    cache = make_cache([300, 5, 64, 0], 16, 1, 64, torch.float32, device, gen)
    q = torch.randn(cache.batch, 32, 64, generator=gen).to(device)  # MQA: 32 query heads on one KV head
    single, split = tilegen.PagedDecode(), tilegen.PagedDecode()
    single.plan(cache, heads_q=32, num_splits=1, **kwargs)
    split.plan(cache, heads_q=32, num_splits=7, **kwargs)
    one, seven = single.run(q, cache), split.run(q, cache)
    ref, _ = paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32), causal=False,
                             **{k: v for k, v in kwargs.items()})
    for out in (one, seven):
        _check(out, None, ref, None, torch.float32)
    torch.testing.assert_close(one, seven, rtol=1e-5, atol=1e-5)  # the merge against a single pass


@st.composite
def decode_steps(draw):
    """A random decode step: contexts at and off the page edges (0 included), page sizes 1-64, MHA
    to MQA-like groups, odd head dims, the three dtypes, window and softcap, forced or ruled splits."""
    page_size = draw(st.sampled_from([1, 16, 64]))
    edge = st.sampled_from([0, 1, max(1, page_size - 1), page_size, page_size + 1])
    return {
        "k_lens": draw(st.lists(st.one_of(edge, st.integers(1, 300)), min_size=1, max_size=4)),
        "page_size": page_size,
        "kv_heads": draw(st.integers(1, 2)),
        "group": draw(st.sampled_from([1, 2, 4, 8])),
        "head_dim": draw(st.sampled_from([16, 40, 64])),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        "window": draw(st.sampled_from([None, (None, 0)]) | st.tuples(st.integers(0, 60), st.just(0))),
        "softcap": draw(st.sampled_from([None, 5.0])),
        "splits": draw(st.sampled_from([None, 1, 2, 3, 7])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=20, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(step=decode_steps())
def test_property_decode_matches_reference(step, device):
    gen = torch.Generator().manual_seed(step["seed"])
    dtype = step["dtype"]
    cache = make_cache(step["k_lens"], step["page_size"], step["kv_heads"], step["head_dim"], dtype, device, gen)
    heads_q = cache.kv_heads * step["group"]
    q = torch.randn(cache.batch, heads_q, step["head_dim"], generator=gen).to(device=device, dtype=dtype)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=heads_q, window=step["window"], softcap=step["softcap"], return_lse=True,
                num_splits=step["splits"])
    out = torch.full((cache.batch, heads_q, step["head_dim"]), math.nan, dtype=dtype, device=device)
    _, lse = decode.run(q, cache, out=out)
    ref, ref_lse = paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32),
                                   window=step["window"], softcap=step["softcap"])
    _check(out, lse, ref, ref_lse, dtype)


def test_decode_allocates_its_output_in_the_query_s_layout(device):
    # q as a head-major tensor seen [batch, heads, dim]: the output run allocates is laid out as q
    # (torch.empty_like), and q cut from a wider qkv row gets a contiguous output; both are right.
    gen = torch.Generator().manual_seed(5)
    cache = make_cache([40, 17, 3], 16, 2, 32, torch.float32, device, gen)
    ref_q = torch.randn(cache.batch, 8, 32, generator=gen).to(device)
    head_major = ref_q.transpose(0, 1).contiguous().transpose(0, 1)
    qkv = torch.cat([ref_q.reshape(cache.batch, -1), torch.randn(cache.batch, 64, generator=gen).to(device)], 1)
    sliced = qkv[:, :8 * 32].view(cache.batch, 8, 32)
    ref, _ = paged_reference(ref_q, cache, torch.arange(cache.batch + 1, dtype=torch.int32))
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=8, num_splits=2)
    out = decode.run(head_major, cache)
    assert out.stride() == head_major.stride()
    _check(out, None, ref, None, torch.float32)
    out = decode.run(sliced, cache)
    assert out.is_contiguous()
    _check(out, None, ref, None, torch.float32)


def test_one_page_table_over_each_layers_pages(device):
    """``with_pages``: the page table (and its checks) of one layer's cache over another layer's pages."""
    gen = torch.Generator().manual_seed(6)
    cache = make_cache([40, 17, 0, 3], 16, 2, 32, torch.float32, device, gen)
    layer = cache.with_pages(cache.k_pages * 2 + 1, 0.5 - cache.v_pages)
    assert layer.indices is cache.indices and layer._layout == cache._layout and cache.k_pages is not layer.k_pages
    q = torch.randn(cache.batch, 4, 32, generator=gen).to(device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=4, return_lse=True)
    one_each = torch.arange(cache.batch + 1, dtype=torch.int32)
    _check(*decode.run(q, layer), *paged_reference(q, layer, one_each), torch.float32)
    _check(*decode.run(q, cache), *paged_reference(q, cache, one_each), torch.float32)
    # Kept between layers without pages, it keeps no layer's pages alive and still takes each layer's.
    bare = cache._without_pages()
    assert bare.k_pages is None and bare.v_pages is None
    again = bare.with_pages(layer.k_pages, layer.v_pages)
    assert again.k_pages is layer.k_pages and again.indices is cache.indices
    _check(*decode.run(q, again), *paged_reference(q, layer, one_each), torch.float32)
    # Pages laid out otherwise are checked as a new cache's.
    with pytest.raises(ValueError, match="page size 3 is not supported"):
        cache.with_pages(cache.k_pages[:, :3], cache.v_pages[:, :3])
    with pytest.raises(ValueError, match="v_pages: pages, page size and heads"):
        cache.with_pages(cache.k_pages, cache.v_pages[:, :, :1])


def test_the_split_rule_fills_the_gpu_and_never_exceeds_the_key_blocks():
    from tilegen.device import DeviceInfo
    from tilegen.families.attention_decode.config import MAX_SPLITS, DecodeConfig, split_count

    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_109_880_320, 232_448)
    config = DecodeConfig(64, 4, 3, 2)
    assert split_count(config, h200, batch=1, kv_heads=8, max_context=131072) == 33  # 264 CTAs / 8
    assert split_count(config, h200, batch=64, kv_heads=8, max_context=4096) == 1
    assert split_count(config, h200, batch=1, kv_heads=8, max_context=100) == 2  # two key blocks only
    # MQA, one sequence: a single program per split, so the rule wants 264 splits and stops at the cap.
    assert split_count(config, h200, batch=1, kv_heads=1, max_context=131072) == MAX_SPLITS == 128


def test_decode_bad_input_names_the_argument(device):
    gen = torch.Generator().manual_seed(0)
    cache = make_cache([20, 3], 16, 2, 32, torch.float32, device, gen)
    decode = tilegen.PagedDecode()
    with pytest.raises(RuntimeError, match="plan"):
        decode.run(torch.randn(2, 4, 32, device=device), cache)
    with pytest.raises(ValueError, match="heads_q"):
        decode.plan(cache, heads_q=3)
    with pytest.raises(TypeError, match=r"heads_q: expected a Python int .*, got (np\.int64\()?4\)? of type int64"):
        decode.plan(cache, heads_q=np.int64(4))
    with pytest.raises(ValueError, match="num_splits"):
        decode.plan(cache, heads_q=4, num_splits=0)
    with pytest.raises(TypeError, match="cache"):
        decode.plan("pages", heads_q=4)
    decode.plan(cache, heads_q=4)
    with pytest.raises(ValueError, match=r"q: expected \[2, 4, 32\]"):
        decode.run(torch.randn(3, 4, 32, device=device), cache)
    with pytest.raises(ValueError, match="q: torch.float16"):
        decode.run(torch.randn(2, 4, 32, device=device).half(), cache)
    q = torch.randn(2, 4, 32, device=device)
    # Another page size, batch, head dim or dtype than planned, or no cache at all.
    for other in (make_cache([20, 3], 8, 2, 32, torch.float32, device, gen),
                  make_cache([20, 3, 5], 16, 2, 32, torch.float32, device, gen),
                  make_cache([20, 3], 16, 2, 64, torch.float32, device, gen),
                  make_cache([20, 3], 16, 2, 32, torch.float16, device, gen), "pages"):
        with pytest.raises(ValueError, match="cache: expected a tilegen.PagedKVCache shaped as planned"):
            decode.run(q, other)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("fault, spoiled", PAGE_TABLE_FAULTS, ids=[p.values[0] for p in PAGE_TABLE_FAULTS])
def test_a_wrong_page_table_stays_inside_the_cache(fault, spoiled, splits, device, monkeypatch):
    """Without TILEGEN_DEBUG the kernel clamps the table into the cache: the well-formed sequences
    keep their answer, nothing outside the pages, q or the table is read (NaN around each, every
    output must stay finite) and nothing outside out is written (a pattern around it)."""
    monkeypatch.delenv("TILEGEN_DEBUG", raising=False)
    good_cache = guarded_cache(PAGED_K_LENS, PAGE, 2, 32, device, torch.Generator().manual_seed(1))
    bad_cache = guarded_cache(PAGED_K_LENS, PAGE, 2, 32, device, torch.Generator().manual_seed(1), fault)
    q, _ = inside(torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(2)).to(device), 2, math.nan)
    ref, _ = paged_reference(q, good_cache, torch.arange(5, dtype=torch.int32))
    out, out_buffer = inside(torch.full_like(q, 1e3), 2, -77.0)
    decode = tilegen.PagedDecode()
    decode.plan(bad_cache, heads_q=8, max_seqlen_k=max(PAGED_K_LENS), num_splits=splits)
    decode.run(q, bad_cache, out=out)
    assert_guard_bands(out_buffer, 2, -77.0)
    assert torch.isfinite(out).all(), "a kernel read outside q, the pages or the page table"
    good = sorted(set(range(4)) - spoiled)
    error, _ = relative_error(out[good].cpu(), ref[good])
    assert error < 1e-4, f"a well-formed sequence changed: relative error {error:.2e}"


def test_a_cache_past_its_plan_is_refused_in_debug(device, monkeypatch):
    """Keys past the plan's chunks go unread: under TILEGEN_DEBUG a run on a cache of longer sequences than planned
    (the same pages, a longer page table) is an error, and so is a page table spoiled after the plan."""
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    short = make_cache([5, 9], PAGE, 2, 32, torch.float32, device, torch.Generator().manual_seed(3), spare=8)
    pages = short.k_pages.shape[0]
    long = tilegen.PagedKVCache(short.k_pages, short.v_pages, torch.tensor([0, 1, 5], dtype=torch.int32).to(device),
                                torch.arange(5, dtype=torch.int32).to(device),
                                torch.tensor([PAGE, PAGE], dtype=torch.int32).to(device))
    assert pages >= 5
    q = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4)).to(device)
    decode = tilegen.PagedDecode()
    decode.plan(short, heads_q=8)
    decode.run(q, short)
    with pytest.raises(ValueError, match=rf"cache: a sequence of {4 * PAGE} tokens, past the 9 the plan covers"):
        decode.run(q, long)
    short.indices[0] = pages + 3
    with pytest.raises(ValueError, match="indices"):
        decode.run(q, short)


@pytest.mark.parametrize("splits", [1, 3])
def test_speculative_rows_split_and_merge_like_a_single_pass(splits, device):
    from tilegen.device import device_info
    from tilegen.families import get
    from tilegen.families.attention_decode import DecodeSpec
    from tilegen.tuning.measure import measure

    family = get("attention_decode")
    spec = DecodeSpec(head_dim=32, q_per_kv=2, dtype="fp32", kv_layout="dense", mask="causal", q_tokens=5,
                      return_lse=True)
    bucket = family.buckets.of((48, 2))
    problem = family.problem(spec, bucket, on_gpu=device == "cuda", num_splits=splits)
    result = measure(problem, family.default_config(spec, device_info(), bucket), seed=1)
    assert result["status"] == "ok", result["reason"]


def test_decode_tunes_into_the_database(tmp_path, monkeypatch):
    from tilegen import dispatch
    from tilegen.db import TuningDB
    from tilegen.device import device_info
    from tilegen.families.attention_decode import DecodeSpec
    from tilegen.families.attention_decode.problem import BUCKETS
    from tilegen.tuning import Tuner

    spec = DecodeSpec(head_dim=32, q_per_kv=4, dtype="fp32", page_size=16)
    path = tmp_path / "tuning.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(path))
    with TuningDB(path) as db, Tuner(db, device_info(), trials=2) as tuner:
        result = tuner.tune(spec, BUCKETS.of((64, 4)))
    assert result.best is not None and result.statuses["ok"] == 2
    dispatch.reset()
    assert dispatch.table_for(spec, device_info()).choose((40, 3)).source == str(path)


@pytest.mark.gpu
def test_decode_run_replays_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(5)
    cache = make_cache([4000, 17, 1, 900], 16, 2, 128, torch.bfloat16, "cuda", gen)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=8, max_seqlen_k=4000)
    q = torch.randn(cache.batch, 8, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    decode.run(q, cache, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.run(q, cache, out=out)
    q.copy_(torch.randn_like(q))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32))
    _check(out, None, ref, None, torch.bfloat16)


@pytest.mark.parametrize(
    "kwargs, heads_kv, n_q",
    [
        pytest.param({}, 2, 1, id="full-gqa4"),
        pytest.param({"causal": True, "return_lse": True}, 1, 1, id="causal-mqa-lse"),
        pytest.param({"window": (40, 0), "softcap": 5.0}, 8, 1, id="window-softcap-mha"),
        pytest.param({"causal": True, "return_lse": True}, 2, 3, id="speculative-3-causal-lse"),
        pytest.param({"window": (17, 2)}, 8, 8, id="speculative-8-window"),
    ],
)
def test_dense_op_runs_a_few_query_rows_through_the_decode_kernel(kwargs, heads_kv, n_q, device):
    from helpers import check_against_reference, poisoned_like_out

    from tilegen.families.attention_decode import DecodeConfig

    gen = torch.Generator().manual_seed(heads_kv)
    q = torch.randn(3, 8, n_q, 64, generator=gen).to(device)
    k = torch.randn(3, heads_kv, 257, 64, generator=gen).to(device)
    v = torch.randn(3, heads_kv, 257, 40, generator=gen).to(device)
    call = {k_: v_ for k_, v_ in kwargs.items() if k_ != "return_lse"}
    assert isinstance(tilegen.explain(q, k, v, **kwargs).config, DecodeConfig)
    out = poisoned_like_out(q, v)
    result = tilegen.attention(q, k, v, out=out, **kwargs)
    result, lse = result if kwargs.get("return_lse") else (result, None)
    assert result is out
    check_against_reference(out, lse, q, k, v, **call)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_the_kernel_compiles_for_an_h200(layout, tmp_path):
    """What the interpreter runs, the sm90 compiler must accept: a group of 8 heads with 4 tokens
    (dense) and with 1 (paged); padded head dim, window, softcap, LSE, split and single pass."""
    import json

    pytest.importorskip("triton.backends.nvidia")
    from tilegen.families.attention_decode import DecodeSpec

    spec = DecodeSpec(head_dim=96, q_per_kv=8, dtype="bf16", kv_layout=layout, mask="window", softcap=True,
                      return_lse=True, q_tokens=4 if layout == "dense" else 1,
                      **({"page_size": 16} if layout == "paged" else {}))
    pointers = {**dict.fromkeys(("Q", "K", "V", "Out"), "*bf16"),
                **dict.fromkeys(("Lse", "PartO", "PartLse"), "*fp32"),
                **dict.fromkeys(("PageIndptr", "Pages", "LastLen"), "*i32"), "qk_scale": "fp32", "softcap_scale": "fp32"}
    configs = [{"SPLIT": True, "BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4},
               {"SPLIT": False, "BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 2}]
    request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "configs": configs}
    compile_for_sm90(request, tmp_path, kernels=len(configs))
    # The merge, as a programmatic dependent (waiting in gdc_wait) and as a plain launch.
    merges = [{"SPLITS_PAD": 64, "DV_BLOCK": 64, "PDL": True, "launch_pdl": True, "num_warps": 2},
              {"SPLITS_PAD": 8, "DV_BLOCK": 64, "PDL": False, "num_warps": 2}]
    compile_for_sm90({**request, "kernel": "kernel_merge", "configs": merges}, tmp_path, kernels=len(merges))
