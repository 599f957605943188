"""Score and mask mods on the paged paths (``PagedAttention``, ``PagedDecode``) against the float64
reference, which applies the same function to each request's whole score matrix with the paged
positions (query ``i`` of a request with ``n_k`` keys and ``n_q`` new tokens at ``n_k - n_q + i``):
shuffled pages of 16, a request with history and new tokens, a one-token request, GQA decode over
contexts off every block size, FP8 pages, captured tensors written between runs, range errors.
Small heads and dims: the interpreter's time grows with both, and the mods touch neither.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_fp8_kv import fp8_cache
from test_varlen import _cu, make_cache, paged_reference

import tilegen
from tilegen.families import relative_error
from tilegen.families.attention_decode import DecodeSpec
from tilegen.ir import SpecError
from tilegen.mods import library
from tilegen.mods.trace import trace

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
D = 16
# A request with history and new tokens, a one-token request, a prefill with no history.
K_LENS, Q_LENS = [40, 20, 17], [7, 1, 17]


def _check(out, lse, ref, ref_lse, dtype):
    assert not torch.isnan(out).any(), "output elements never written"
    assert relative_error(out.cpu(), ref)[0] < TOL[dtype]
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), ~seen), "lse must be -inf exactly on rows that keep no key"
    # An LSE checks the positions a score mod sees even where the softmax cancels them (ALiBi's q_idx term).
    assert (lse.cpu().double()[seen] - ref_lse[seen]).abs().max() < 1e-4


def _prefill_mods(name, device):
    """(score_mod, mask_mod, causal, dtype, fp8) of a case, its captured tensors on ``device``."""
    gen = torch.Generator().manual_seed(5)
    slopes = torch.rand(4, generator=gen).to(device)
    docs = torch.randint(0, 3, (3, 40), generator=gen).sort(1).values.to(device)
    return {
        "alibi-causal-fp32": (library.alibi(slopes), None, True, torch.float32, None),
        "document-causal-bf16": (None, library.document_mask(docs), True, torch.bfloat16, None),
        "alibi-sliding-fp8": (library.alibi(slopes), library.sliding_window(5), False, torch.bfloat16, "e4m3"),
        # Buckets that end at distance 2: blocks of keys far from a request's queries read one bias.
        "t5-far-blocks-fp32": (library.relative_bias(torch.randn(4, 4, generator=gen).to(device), 4, 2), None, True,
                               torch.float32, None),
    }[name]


@pytest.mark.parametrize("name", ["alibi-causal-fp32", "document-causal-bf16", "alibi-sliding-fp8",
                                  "t5-far-blocks-fp32"])
def test_paged_prefill_applies_mods_at_the_queries_positions(name, device):
    score_mod, mask_mod, causal, dtype, fp8 = _prefill_mods(name, device)
    gen = torch.Generator().manual_seed(7)
    if fp8:
        cache, reference_cache = fp8_cache(K_LENS, fp8, True, device, gen)
        kv_heads, dim = cache.kv_heads, cache.k_pages.shape[3]
    else:
        kv_heads, dim = 2, D
        cache = reference_cache = make_cache(K_LENS, 16, kv_heads, dim, dtype, device, gen)
    heads_q = 2 * kv_heads
    cu_q = _cu(Q_LENS, device)
    q = torch.randn(sum(Q_LENS), heads_q, dim, generator=gen).to(device, dtype)
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, cache, heads_q=heads_q, causal=causal, return_lse=True, q_dtype=dtype,
              score_mod=score_mod, mask_mod=mask_mod)
    out = torch.full_like(q, math.nan)
    _, lse = attn.run(q, cache, out=out)
    kwargs = {"causal": causal, "score_mod": score_mod, "mask_mod": mask_mod}
    ref, ref_lse = paged_reference(q, reference_cache, cu_q, paged_positions=True, **kwargs)
    _check(out, lse, ref, ref_lse, dtype)
    if mask_mod is not None:
        # The mask follows the positions: at the rows' own indices (top-left) it would keep other keys.
        top_left, _ = paged_reference(q, reference_cache, cu_q, **kwargs)
        assert relative_error(top_left, ref)[0] > 0.1


@pytest.mark.parametrize("dtype, splits", [(torch.float32, 3), (torch.bfloat16, 1)], ids=["fp32-3-splits", "bf16"])
def test_paged_decode_applies_mods_at_the_last_position(dtype, splits, device):
    gen = torch.Generator().manual_seed(11)
    contexts = [1, 17, 257, 0]
    cache = make_cache(contexts, 16, 2, D, dtype, device, gen)
    heads_q = 8  # GQA: four query heads per KV head, one tile of rows for the mods' h
    slopes = torch.rand(heads_q, generator=gen).to(device)
    score_mod, mask_mod = library.alibi(slopes), library.sliding_window(100, global_tokens=3)
    q = torch.randn(cache.batch, heads_q, D, generator=gen).to(device, dtype)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=heads_q, return_lse=True, num_splits=splits, q_dtype=dtype,
                score_mod=score_mod, mask_mod=mask_mod)
    out = torch.full_like(q, math.nan)
    _, lse = decode.run(q, cache, out=out)
    one_each = torch.arange(cache.batch + 1, dtype=torch.int32)
    ref, ref_lse = paged_reference(q, cache, one_each, score_mod=score_mod, mask_mod=mask_mod, paged_positions=True)
    _check(out, lse, ref, ref_lse, dtype)
    # The captured tensors are the plan's, read at every run: values written in place take effect.
    slopes.mul_(3)
    _, lse = decode.run(q, cache, out=out)
    ref, ref_lse = paged_reference(q, cache, one_each, score_mod=score_mod, mask_mod=mask_mod, paged_positions=True)
    _check(out, lse, ref, ref_lse, dtype)


def test_paged_decode_t5_bias_reads_one_value_in_blocks_far_from_the_query(device):
    gen = torch.Generator().manual_seed(12)
    cache = make_cache([1, 17, 257, 0], 16, 2, D, torch.float32, device, gen)
    score_mod = library.relative_bias(torch.randn(8, 8, generator=gen).to(device), 8, 3)
    q = torch.randn(cache.batch, 8, D, generator=gen).to(device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=8, return_lse=True, num_splits=2, q_dtype=torch.float32, score_mod=score_mod)
    out = torch.full_like(q, math.nan)
    _, lse = decode.run(q, cache, out=out)
    ref, ref_lse = paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32), score_mod=score_mod,
                                   paged_positions=True)
    _check(out, lse, ref, ref_lse, torch.float32)


def test_a_mod_means_the_same_in_prefill_and_decode(device):
    """One new token per request: PagedAttention's query sits where PagedDecode's does (n_k - 1)."""
    gen = torch.Generator().manual_seed(13)
    contexts = [33, 5]
    cache = make_cache(contexts, 16, 1, D, torch.float32, device, gen)
    score_mod = library.alibi(torch.rand(2, generator=gen).to(device))
    mask_mod = library.sliding_window(6)
    q = torch.randn(2, 2, D, generator=gen).to(device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=2, return_lse=True, q_dtype=torch.float32, score_mod=score_mod, mask_mod=mask_mod)
    prefill = tilegen.PagedAttention()
    prefill.plan(_cu([1, 1], device), cache, heads_q=2, return_lse=True, q_dtype=torch.float32, score_mod=score_mod,
                 mask_mod=mask_mod)
    (decoded, decoded_lse), (prefilled, prefilled_lse) = decode.run(q, cache), prefill.run(q, cache)
    assert (decoded - prefilled).abs().max() < 1e-5 and (decoded_lse - prefilled_lse).abs().max() < 1e-5


def test_paged_mods_are_range_checked_and_refused_by_name(device):
    gen = torch.Generator().manual_seed(17)
    cache = make_cache([40, 9], 16, 2, D, torch.float32, device, gen)
    cu_q = _cu([3, 9], device)
    short_docs = torch.zeros(2, 39, dtype=torch.int64, device=device)  # positions run to 39
    with pytest.raises(ValueError, match=r"mask_mod: captured tensor 'doc_ids' .*dim 1: q_idx ranges over \[0, 39\]"):
        tilegen.PagedAttention().plan(cu_q, cache, heads_q=4, q_dtype=torch.float32,
                                      mask_mod=library.document_mask(short_docs))
    with pytest.raises(ValueError, match=r"score_mod: captured tensor 'slopes' .*dim 0: h ranges over \[0, 3\]"):
        tilegen.PagedDecode().plan(cache, heads_q=4, q_dtype=torch.float32,
                                   score_mod=library.alibi(torch.rand(2, device=device)))
    with pytest.raises(ValueError, match="softcap"):
        tilegen.PagedDecode().plan(cache, heads_q=4, q_dtype=torch.float32, softcap=5.0,
                                   score_mod=library.softcap(3.0))
    text = trace(library.causal(), "mask_mod").canonical
    with pytest.raises(SpecError, match="kv_layout: mods are for paged decode"):
        DecodeSpec(head_dim=64, kv_layout="dense", mask_mod=text)
    # The fields join the spec's JSON only when set: a spec without mods keeps its hash.
    plain = DecodeSpec(head_dim=64, page_size=16)
    assert "mask_mod" not in plain.to_json() and plain.replace(mask_mod=text).hash != plain.hash
