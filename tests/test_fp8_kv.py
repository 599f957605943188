"""FP8 KV pages (e4m3fn and e5m2) with per-tensor or per-KV-head scales.

Decode and paged prefill are checked against the float64 reference on the *dequantized* pages
(value * scale), so the error measured is the kernels' alone, not the quantization's; outputs
start as NaN, contexts are 0, 1, 17 and 257 tokens (no block multiple), GQA groups of 4.
append_kv is checked against torch's own quantization, bit for bit, and for saturation.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import compile_for_sm90
from test_varlen import _cu, make_cache, paged_reference

import tilegen
from tilegen.families import relative_error
from tilegen.families.attention_decode import DecodeSpec
from tilegen.families.attention_varlen import VarlenAttentionSpec
from tilegen.families.kv_append import KVAppendSpec
from tilegen.ir import SpecError

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
CONTEXTS = [0, 1, 17, 257]
KV_HEADS, DIM, GROUP = 2, 32, 4


def _scales(per_head: bool, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh scales; per head they differ, so a kernel that reads the wrong head's scale fails."""
    n = KV_HEADS if per_head else 1
    return tuple((0.01 + 0.05 * torch.rand(n, generator=gen)).to(device) for _ in "kv")


def _quantize(pages: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (pages.float() / scale.view(1, 1, -1, 1)).clamp(-limit, limit).to(dtype)  # NaN slots stay NaN


def fp8_cache(k_lens, fmt: str, per_head: bool, device, gen, page_size=16):
    """``(fp8 cache, the same page table over its dequantized pages in float64)``."""
    dtype = FORMATS[fmt]
    base = make_cache(k_lens, page_size, KV_HEADS, DIM, torch.float32, device, gen)
    k_scale, v_scale = _scales(per_head, gen, device)
    k_pages, v_pages = _quantize(base.k_pages, k_scale, dtype), _quantize(base.v_pages, v_scale, dtype)
    cache = tilegen.PagedKVCache(k_pages, v_pages, base.indptr, base.indices, base.last_page_len, k_scale, v_scale)
    dequantized = tilegen.PagedKVCache(
        k_pages.double() * k_scale.double().view(1, 1, -1, 1), v_pages.double() * v_scale.double().view(1, 1, -1, 1),
        base.indptr, base.indices, base.last_page_len)
    return cache, dequantized


def _check(out, ref, dtype, lse=None, ref_lse=None):
    assert not torch.isnan(out).any(), "output elements never written"
    error, _ = relative_error(out.cpu(), ref)
    assert error < TOL[dtype], f"relative error {error:.2e} against the dequantized reference"
    if lse is not None:
        assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse)), "lse -inf exactly on empty contexts"
        seen = torch.isfinite(ref_lse)
        assert (lse.cpu().double()[seen] - ref_lse[seen]).abs().max() < 1e-4


@pytest.mark.parametrize("fmt, per_head, splits, q_dtype", [
    pytest.param("e4m3", True, 1, torch.bfloat16, id="e4m3-per-head-bf16"),
    pytest.param("e4m3", False, 3, torch.float32, id="e4m3-per-tensor-3-splits-fp32"),
    pytest.param("e5m2", True, 2, torch.float16, id="e5m2-per-head-2-splits-fp16"),
    pytest.param("e5m2", False, 1, torch.bfloat16, id="e5m2-per-tensor-bf16"),
])
def test_decode_reads_fp8_pages(fmt, per_head, splits, q_dtype, device):
    gen = torch.Generator().manual_seed(len(fmt) * 10 + 2 * splits + per_head)
    cache, dequantized = fp8_cache(CONTEXTS, fmt, per_head, device, gen)
    heads_q = KV_HEADS * GROUP
    q = torch.randn(cache.batch, heads_q, DIM, generator=gen).to(device=device, dtype=q_dtype)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=heads_q, return_lse=True, num_splits=splits, q_dtype=q_dtype)
    assert decode.num_splits == splits
    out = torch.full_like(q, math.nan)
    result, lse = decode.run(q, cache, out=out)
    assert result is out
    ref, ref_lse = paged_reference(q, dequantized, torch.arange(cache.batch + 1, dtype=torch.int32))
    _check(out, ref, q_dtype, lse, ref_lse)


def test_decode_fp8_with_window_and_softcap(device):
    """With a softcap the kernel's qk_scale is the plain softmax scale (no log2(e)): K's scale folds
    into it all the same."""
    gen = torch.Generator().manual_seed(21)
    cache, dequantized = fp8_cache(CONTEXTS, "e4m3", True, device, gen)
    q = torch.randn(cache.batch, KV_HEADS * GROUP, DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
    kwargs = {"window": (20, 0), "softcap": 3.0, "scale": 0.2}
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=q.shape[1], num_splits=2, **kwargs)
    out = torch.full_like(q, math.nan)
    decode.run(q, cache, out=out)
    ref, _ = paged_reference(q, dequantized, torch.arange(cache.batch + 1, dtype=torch.int32), **kwargs)
    _check(out, ref, torch.bfloat16)


def test_one_decode_plan_runs_every_layers_scales(device):
    """The scales are kernel arguments, not constants of the plan: a second layer with the same page
    table and other scales reuses the plan (and its recorded launch) and gets its own answer."""
    gen = torch.Generator().manual_seed(5)
    first, first_ref = fp8_cache([40, 17, 5], "e4m3", True, device, gen)
    k_scale, v_scale = _scales(True, gen, device)
    second = tilegen.PagedKVCache(first.k_pages, first.v_pages, first.indptr, first.indices, first.last_page_len,
                                  k_scale, v_scale)
    second_ref = tilegen.PagedKVCache(first_ref.k_pages / first.k_scale.double().view(1, 1, -1, 1)
                                      * k_scale.double().view(1, 1, -1, 1),
                                      first_ref.v_pages / first.v_scale.double().view(1, 1, -1, 1)
                                      * v_scale.double().view(1, 1, -1, 1),
                                      first.indptr, first.indices, first.last_page_len)
    decode = tilegen.PagedDecode()
    decode.plan(first, heads_q=8, max_seqlen_k=40)
    q = torch.randn(3, 8, DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
    for cache, ref_cache in ((first, first_ref), (second, second_ref), (first, first_ref)):
        ref, _ = paged_reference(q, ref_cache, torch.arange(4, dtype=torch.int32))
        _check(decode.run(q, cache), ref, torch.bfloat16)
    per_tensor = tilegen.PagedKVCache(first.k_pages, first.v_pages, first.indptr, first.indices,
                                      first.last_page_len, k_scale[:1].clone(), v_scale)
    with pytest.raises(ValueError, match="^cache: expected a tilegen.PagedKVCache shaped as planned"):
        decode.run(q, per_tensor)
    with pytest.raises(ValueError, match=r"^q: torch.float16 .* differs from the plan's torch.bfloat16"):
        decode.run(q.half(), first)


@pytest.mark.gpu
def test_fp8_decode_is_capturable_in_a_cuda_graph():
    """The scales are read from their tensors at replay: new scales written in place change the answer
    with no new capture, and a split run allocates nothing inside the graph."""
    gen = torch.Generator().manual_seed(8)
    cache, _ = fp8_cache([300, 17, 64], "e4m3", True, "cuda", gen)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=8, max_seqlen_k=300, num_splits=4)
    q = torch.randn(3, 8, DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    decode.run(q, cache, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.run(q, cache, out=out)
    q.copy_(torch.randn_like(q))
    cache.k_scale.mul_(1.5)
    cache.v_scale.mul_(0.5)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    dequantized = tilegen.PagedKVCache(
        cache.k_pages.double() * cache.k_scale.double().view(1, 1, -1, 1),
        cache.v_pages.double() * cache.v_scale.double().view(1, 1, -1, 1),
        cache.indptr, cache.indices, cache.last_page_len)
    ref, _ = paged_reference(q, dequantized, torch.arange(4, dtype=torch.int32))
    _check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("fmt, per_head, q_dtype", [("e4m3", True, torch.bfloat16), ("e5m2", False, torch.float32)])
def test_paged_prefill_reads_fp8_pages(fmt, per_head, q_dtype, device):
    gen = torch.Generator().manual_seed(len(fmt) + per_head)
    cache, dequantized = fp8_cache(CONTEXTS, fmt, per_head, device, gen, page_size=8)
    q_lens = [0, 1, 5, 17]
    cu_q = _cu(q_lens, device)
    q = torch.randn(sum(q_lens), KV_HEADS * GROUP, DIM, generator=gen).to(device=device, dtype=q_dtype)
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, cache, heads_q=q.shape[1], causal=True, return_lse=True, q_dtype=q_dtype)
    out = torch.full_like(q, math.nan)
    _, lse = attn.run(q, cache, out=out)
    ref, ref_lse = paged_reference(q, dequantized, cu_q, causal=True)
    _check(out, ref, q_dtype, lse, ref_lse)
    other = tilegen.PagedKVCache(cache.k_pages, cache.v_pages, cache.indptr, cache.indices, cache.last_page_len,
                                 *(s.repeat(KV_HEADS // s.numel()) if not per_head else s[:1].clone()
                                   for s in (cache.k_scale, cache.v_scale)))
    with pytest.raises(ValueError, match="^cache: page size, heads, dims, dtype or scales differ"):
        attn.run(q, other)



def test_a_nan_in_a_bf16_query_gives_its_row_nan(device):
    """A bf16 query over FP8 pages is narrowed to fp16 by a clamp: a NaN element must stay NaN (its row's
    answer is NaN, as the reference's), where a clamp that drops NaN made it -65504 and the row finite."""
    gen = torch.Generator().manual_seed(13)
    cache, dequantized = fp8_cache([1, 17], "e4m3", True, device, gen)
    q = torch.randn(2, KV_HEADS * GROUP, DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
    q[1, 5, 3] = math.nan
    cu = torch.arange(3, dtype=torch.int32)
    ref, _ = paged_reference(q, dequantized, cu)
    ref[1, 5] = math.nan  # softmax over NaN scores (the reference zeroes rows of NaN weights, meant for empty ones)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=q.shape[1])
    prefill = tilegen.PagedAttention()
    prefill.plan(cu.to(device), cache, heads_q=q.shape[1], causal=True)
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=q.shape[1])
    for op in (decode, prefill, cascade):
        out = op.run(q, cache).cpu()
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), type(op).__name__
        _check(torch.nan_to_num(out), torch.nan_to_num(ref), torch.bfloat16)


# ----------------------------------------------------------------------------------------- append_kv

def _append_batch(fmt, per_head, device, gen, k_scale=None):
    """Two sequences whose page tables already count their new tokens (9 and 5), in pages of 8."""
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=device)
    k_scale_, v_scale = _scales(per_head, gen, device)
    cache = tilegen.PagedKVCache.empty(5, 8, KV_HEADS, DIM, table, torch.tensor([9, 5]), head_dim_v=24,
                                       dtype=FORMATS[fmt], device=device,
                                       k_scale=k_scale_ if k_scale is None else k_scale, v_scale=v_scale)
    cache.k_pages.fill_(math.nan)
    cache.v_pages.fill_(math.nan)
    k = torch.randn(14, KV_HEADS, DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
    v = torch.randn(14, KV_HEADS, 24, generator=gen).to(device=device, dtype=torch.bfloat16)
    return cache, k, v, _cu([9, 5], device)


@pytest.mark.parametrize("fmt, per_head", [("e4m3", True), ("e5m2", False)])
def test_append_quantizes_as_torch_does(fmt, per_head, device):
    """Divide, saturate, round to nearest even: the pages hold torch's quantization bit for bit, and the
    round trip is within half a unit in the last place of the format (2^-4 / 2^-3 relative)."""
    gen = torch.Generator().manual_seed(7 + per_head)
    cache, k, v, cu = _append_batch(fmt, per_head, device, gen)
    k[0, 0, :4] = torch.tensor([-0.0, -1e-30, -1e-9, 1e-30])  # -0, and negatives that round to it, keep their sign
    tilegen.append_kv(cache, k, v, cu)
    rows = torch.cat([cache.k_pages[2], cache.k_pages[0, :1], cache.k_pages[1, :5]])
    expected = _quantize(k[:, None], cache.k_scale, FORMATS[fmt])[:, 0]
    assert torch.equal(rows.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu())
    back = rows.double() * cache.k_scale.double().view(1, -1, 1)
    rel = ((back - k.double()).abs() / k.double().abs().clamp_min(1e-30))
    normal = k.double().abs() / cache.k_scale.double().view(1, -1, 1) >= (2.0 ** -6 if fmt == "e4m3" else 2.0 ** -14)
    assert rel[normal].max() <= (2.0 ** -4 if fmt == "e4m3" else 2.0 ** -3)
    assert torch.isnan(cache.k_pages[0, 1:]).all() and torch.isnan(cache.k_pages[4]).all(), "slots no token owns"
    assert torch.isnan(cache.v_pages[4]).all() and not torch.isnan(cache.v_pages[1, :5]).any()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_append_saturates_instead_of_overflowing(fmt, device):
    gen = torch.Generator().manual_seed(3)
    scale = torch.tensor([0.5, 2.0], device=device)
    cache, k, v, cu = _append_batch(fmt, True, device, gen, k_scale=scale)
    limit = torch.finfo(FORMATS[fmt]).max
    k[0, 0, :4] = torch.tensor([1e30, -1e30, math.inf, -math.inf])
    k[1, 1, :2] = torch.tensor([limit * 2.0 * 1.5, -limit * 2.0 * 100])  # past the largest value once scaled
    tilegen.append_kv(cache, k, v, cu)
    dequantized = cache.k_pages.double() * scale.double().view(1, 1, -1, 1)
    assert dequantized[2, 0, 0, :4].tolist() == [limit * 0.5, -limit * 0.5, limit * 0.5, -limit * 0.5]
    assert dequantized[2, 1, 1, :2].tolist() == [limit * 2.0, -limit * 2.0]
    assert torch.isfinite(dequantized[2]).all()


def test_append_then_decode_round_trip(device):
    """Tokens appended in bf16 come back through decode as the dequantized pages' attention."""
    gen = torch.Generator().manual_seed(11)
    cache, k, v, cu = _append_batch("e4m3", True, device, gen)
    tilegen.append_kv(cache, k, v, cu)
    q = torch.randn(2, KV_HEADS * GROUP, DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=q.shape[1])
    out = decode.run(q, cache)
    dequantized = tilegen.PagedKVCache(
        cache.k_pages.double() * cache.k_scale.double().view(1, 1, -1, 1),
        cache.v_pages.double() * cache.v_scale.double().view(1, 1, -1, 1),
        cache.indptr, cache.indices, cache.last_page_len)
    ref, _ = paged_reference(q, dequantized, torch.arange(3, dtype=torch.int32))
    _check(out, ref, torch.bfloat16)


# ----------------------------------------------------------------------------------------- bad input

def _pages(device, dtype=torch.float8_e4m3fn):
    k = torch.zeros(2, 8, KV_HEADS, DIM, device=device).to(dtype)
    table = (torch.tensor([0, 1], dtype=torch.int32, device=device), torch.tensor([0], dtype=torch.int32, device=device),
             torch.tensor([3], dtype=torch.int32, device=device))
    return k, k.clone(), table


ONE = torch.ones(1)


@pytest.mark.parametrize("dtype, k_scale, v_scale, needle", [
    (torch.float8_e4m3fn, None, ONE, "k_scale: torch.float8_e4m3fn pages need a float32 scale"),
    (torch.float8_e5m2, ONE, None, "v_scale: torch.float8_e5m2 pages need a float32 scale"),
    (torch.bfloat16, ONE, None, "k_scale: torch.bfloat16 pages take no scale"),
    (torch.float32, None, ONE, "v_scale: torch.float32 pages take no scale"),
    (torch.float8_e4m3fn, torch.ones(3), ONE, r"k_scale: expected a float32 tensor of shape \(1,\) \(per tensor\) "
                                               r"or \(2,\) \(per KV head\), got torch.float32 tensor of shape \(3,\)"),
    (torch.float8_e4m3fn, ONE, torch.ones(1, 2), r"v_scale: expected a float32 tensor of shape"),
    (torch.float8_e4m3fn, ONE.double(), ONE, r"k_scale: expected a float32 tensor .* got torch.float64"),
    (torch.float8_e4m3fn, 0.5, ONE, "k_scale: expected a float32 tensor .* got float"),
    (torch.float8_e4m3fn, ONE, torch.ones(2, device="meta"), "v_scale: on meta while the pages are on"),
    (torch.float8_e4m3fn, torch.ones(4)[::2], ONE, "k_scale: expected a contiguous tensor"),
    (torch.float8_e4m3fn, torch.tensor([1.0, math.nan]), ONE, r"k_scale: expected finite positive scales, got \[1.0, nan\]"),
    (torch.float8_e4m3fn, ONE, torch.tensor([math.inf]), "v_scale: expected finite positive scales"),
    (torch.float8_e4m3fn, torch.zeros(1), ONE, r"k_scale: expected finite positive scales, got \[0.0\]"),
    (torch.float8_e5m2, ONE, torch.tensor([0.5, -0.5]), "v_scale: expected finite positive scales"),
], ids=lambda v: None)
def test_cache_refuses_bad_scales_naming_them(dtype, k_scale, v_scale, needle):
    k, v, table = _pages("cpu", dtype)
    with pytest.raises(ValueError, match="^" + needle):
        tilegen.PagedKVCache(k, v, *table, k_scale, v_scale)


def test_validate_checks_scales_changed_in_place():
    k, v, table = _pages("cpu")
    cache = tilegen.PagedKVCache(k, v, *table, torch.ones(KV_HEADS), torch.ones(1))
    cache.validate()
    cache.v_scale.zero_()
    with pytest.raises(ValueError, match=r"^v_scale: expected finite positive scales, got \[0.0\]"):
        cache.validate()


def test_fp8_plans_and_appends_refuse_bad_dtypes(device):
    gen = torch.Generator().manual_seed(1)
    cache, k, v, cu = _append_batch("e4m3", False, device, gen)
    with pytest.raises(TypeError, match="^k: dtype torch.float8_e4m3fn cannot be quantized into"):
        tilegen.append_kv(cache, k.to(torch.float8_e4m3fn), v, cu)
    with pytest.raises(TypeError, match="^v: dtype torch.float16 differs from k's torch.bfloat16"):
        tilegen.append_kv(cache, k, v.half(), cu)
    with pytest.raises(ValueError, match="^q_dtype: expected float16, bfloat16 or float32 for torch.float8_e4m3fn"):
        tilegen.PagedDecode().plan(cache, heads_q=8, q_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="^q_dtype: expected float16, bfloat16 or float32"):
        tilegen.PagedAttention().plan(cu, cache, heads_q=8, q_dtype=torch.float64)
    plain = make_cache([3], 8, 1, DIM, torch.float16, device, gen)
    with pytest.raises(ValueError, match="^q_dtype: expected torch.float16 for torch.float16 pages"):
        tilegen.PagedDecode().plan(plain, heads_q=2, q_dtype=torch.bfloat16)


def test_specs_keep_fp8_rows_apart():
    plain = DecodeSpec(head_dim=128, q_per_kv=4, dtype="bf16", page_size=16)
    fp8 = plain.replace(kv_dtype="fp8e4m3")
    assert "kv_dtype" not in plain.to_dict(), "specs tuned before FP8 keep their hashes"
    assert fp8.name.endswith("_kvfp8e4m3") and fp8.hash != plain.hash != fp8.replace(kv_dtype="fp8e5m2").hash
    append = KVAppendSpec(head_dim=128, page_size=16, dtype="bf16")
    assert append.replace(page_dtype="fp8e5m2").name.endswith("_fp8e5m2")
    assert append.replace(page_dtype="fp8e5m2").hash != append.hash and "page_dtype" not in append.to_dict()
    with pytest.raises(SpecError, match="^kv_dtype"):
        plain.replace(kv_dtype="int8")
    with pytest.raises(SpecError, match="^kv_dtype.*paged"):
        VarlenAttentionSpec(head_dim=64, dtype="bf16", kv_dtype="fp8e4m3")
    with pytest.raises(SpecError, match="^kv_dtype.*paged"):
        DecodeSpec(head_dim=64, dtype="bf16", kv_layout="dense", kv_dtype="fp8e4m3")
    with pytest.raises(SpecError, match="^page_dtype"):
        append.replace(page_dtype="fp8")


def test_bench_decode_fp8_case_and_arguments(monkeypatch, device):
    """The benchmark's FP8 decode on a small CPU case: it reads FP8 bytes and agrees with SDPA on the dequantized
    K and V; its argument checks run before any GPU work."""
    from tilegen.bench import decode as bench

    monkeypatch.setattr(bench, "HQ", 4)
    monkeypatch.setattr(bench, "HKV", 1)
    monkeypatch.setattr(bench, "D", DIM)
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(1, 1, 48, DIM, generator=gen).bfloat16().to(device) for _ in "kv")
    q = torch.randn(1, 4, 1, DIM, generator=gen).bfloat16().to(device)
    cache = tilegen.PagedKVCache.from_block_table(k[0].transpose(0, 1).reshape(3, 16, 1, DIM),
                                                  v[0].transpose(0, 1).reshape(3, 16, 1, DIM),
                                                  torch.tensor([[0, 1, 2]], dtype=torch.int32, device=device),
                                                  torch.tensor([48], device=device))
    row, run, gb = bench._fp8_decode(q, k, v, cache, "fp8e4m3")
    assert row["fp8e4m3_rel_err"] < 1e-2
    assert gb == pytest.approx(2 * 48 * DIM / 1e9)  # one byte a value
    assert torch.equal(run(), run())
    with pytest.raises(SystemExit):
        bench.main(["--kv-dtype", "fp4"])
    with pytest.raises(SystemExit):
        bench.main(["--kv-dtype", "fp8", "--q-tokens", "2"])


@pytest.mark.parametrize("which", ["decode-e4m3", "append-e5m2"])
def test_fp8_kernels_compile_for_an_h200(which, tmp_path):
    """What the interpreter runs, the sm90 compiler must accept: fp8 loads widened for a bf16 dot (no
    fp8 x bf16 dot on Hopper), and the append's rounding on the bits and its fp8 stores."""
    import json

    pytest.importorskip("triton.backends.nvidia")
    if which == "decode-e4m3":
        spec = DecodeSpec(head_dim=128, q_per_kv=4, dtype="bf16", page_size=16, kv_dtype="fp8e4m3", return_lse=True)
        pointers = {**dict.fromkeys(("Q", "Out"), "*bf16"), **dict.fromkeys(("K", "V"), "*fp8e4nv"),
                    **dict.fromkeys(("Lse", "PartO", "PartLse", "KScale", "VScale"), "*fp32"),
                    **dict.fromkeys(("PageIndptr", "Pages", "LastLen"), "*i32"),
                    "qk_scale": "fp32", "softcap_scale": "fp32"}
        configs = [{"SPLIT": True, "BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 2}]
    else:
        spec = KVAppendSpec(head_dim=128, page_size=16, dtype="bf16", page_dtype="fp8e5m2")
        pointers = {**dict.fromkeys(("K", "V"), "*bf16"), **dict.fromkeys(("KPages", "VPages"), "*fp8e5"),
                    **dict.fromkeys(("KScale", "VScale"), "*fp32"),
                    **dict.fromkeys(("CuSeqlens", "Indptr", "Indices", "LastPageLen"), "*i32")}
        configs = [{"BLOCK_T": 4, "BLOCK_H": 2, "num_warps": 2}]
    request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "configs": configs}
    compile_for_sm90(request, tmp_path, kernels=len(configs))
