"""An ``out=`` that shares memory with an input is refused by name, except ``q`` itself.

Attention programs read their own query rows before writing their output, so writing over ``q``
in place is exact; writing over the keys, the values or the pages would change what other
programs still have to read, a silently wrong answer.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_varlen import _cu, make_cache

import tilegen


def _raises(prefix):
    return pytest.raises(ValueError, match="^" + re.escape(prefix))


def _randn(gen, *shape, device, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_out_over_q_in_place(causal, device):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (_randn(gen, 2, 3, 70, 32, device=device) for _ in range(3))
    expected = tilegen.attention(q.clone(), k, v, causal=causal)
    result = tilegen.attention(q, k, v, causal=causal, out=q)
    assert result is q
    assert torch.equal(result, expected)


def test_attention_out_over_an_input_is_refused(device):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (_randn(gen, 2, 2, 17, 32, device=device) for _ in range(3))
    for _ in range(2):  # the first call checks everything; the second reuses the checked plan
        with _raises("out: overlaps k in memory; pass q itself, or a tensor of its own"):
            tilegen.attention(q, k, v, out=k)
        with _raises("out: overlaps v in memory"):
            tilegen.attention(q, k, v, out=v.transpose(0, 1))
        with _raises("out: overlaps q in memory; pass q itself"):  # q's memory in another order
            tilegen.attention(q, k, v, out=q.transpose(0, 1))
        with _raises("out: overlaps itself (stride 0"):
            tilegen.attention(q, k, v, out=torch.empty(32, device=device).expand(2, 2, 17, 32))
    base = torch.full((2 * q.numel(),), float("nan"), device=device)
    beside = tilegen.attention(q, k, v, out=base[q.numel():].view(q.shape))  # one storage, no overlap: fine
    assert torch.equal(beside, tilegen.attention(q, k, v))
    assert base[: q.numel()].isnan().all()  # the other half untouched


def test_decode_out_over_q_in_place_and_over_pages_refused(device):
    gen = torch.Generator().manual_seed(3)
    cache = make_cache([40, 1, 17], 16, 2, 32, torch.float32, device, gen)
    q = _randn(gen, cache.batch, 8, 32, device=device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=8, num_splits=2)
    expected = decode.run(q.clone(), cache)
    assert torch.equal(decode.run(q, cache, out=q), expected)
    inside = cache.v_pages.view(-1)[: q.numel()].view(q.shape)
    with _raises("out: overlaps cache.v_pages in memory; pass q itself, or a tensor of its own"):
        decode.run(q, cache, out=inside)


def test_varlen_out_over_q_in_place_and_over_kv_refused(device):
    gen = torch.Generator().manual_seed(4)
    lengths = [17, 1, 40]
    q, k, v = (_randn(gen, sum(lengths), 2, 32, device=device) for _ in range(3))
    cu = _cu(lengths, device)
    expected = tilegen.varlen_attention(q.clone(), k, v, cu, cu, 40, 40, causal=True)
    assert torch.equal(tilegen.varlen_attention(q, k, v, cu, cu, 40, 40, causal=True, out=q), expected)
    with _raises("out: overlaps k in memory"):
        tilegen.varlen_attention(q, k, v, cu, cu, 40, 40, out=k)


def test_paged_attention_out_over_pages_refused(device):
    gen = torch.Generator().manual_seed(5)
    cache = make_cache([30, 5], 16, 1, 32, torch.float32, device, gen)
    cu_q = _cu([3, 5], device)
    q = _randn(gen, 8, 2, 32, device=device)
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, cache, heads_q=2, causal=True)
    expected = attn.run(q.clone(), cache)
    assert torch.equal(attn.run(q, cache, out=q), expected)
    with _raises("out: overlaps cache.k_pages in memory"):
        attn.run(q, cache, out=cache.k_pages.view(-1)[: q.numel()].view(q.shape))


WRITERS = ["attention", "attention-score-mod", "attention-over-q", "varlen_attention", "PagedDecode", "PagedAttention",
           "CascadeAttention", "merge_states", "apply_rope", "append_kv"]


def _writers(device):
    """``{name: (write, targets)}``: ``write()`` makes one call of an op that writes into the caller's ``targets``."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (_randn(gen, 1, 2, 9, 16, device=device) for _ in range(3))
    dense_out = torch.empty_like(q)
    lengths = [4, 5]
    cu = _cu(lengths, device)
    rows = [_randn(gen, 9, 2, 16, device=device) for _ in range(3)]
    ragged_out = torch.empty_like(rows[0])
    cache = make_cache([9, 20], 8, 1, 16, torch.float32, device, gen)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=2)
    decode_q, decode_out = _randn(gen, 2, 2, 16, device=device), torch.empty(2, 2, 16, device=device)
    attn = tilegen.PagedAttention()
    attn.plan(_cu([2, 1], device), cache, heads_q=2, causal=True)
    paged_q, paged_out = _randn(gen, 3, 2, 16, device=device), torch.empty(3, 2, 16, device=device)
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=2)
    cascade_out = torch.empty(2, 2, 16, device=device)
    o_a, o_b = _randn(gen, 5, 2, 16, device=device), _randn(gen, 5, 2, 16, device=device)
    lse_a, lse_b = _randn(gen, 5, 2, device=device), _randn(gen, 5, 2, device=device)
    merged, merged_lse = torch.empty_like(o_a), torch.empty_like(lse_a)
    x, cos, sin = _randn(gen, 6, 2, 16, device=device), *(_randn(gen, 6, 16, device=device) for _ in range(2))
    new_k, new_v = _randn(gen, 2, 1, 16, device=device), _randn(gen, 2, 1, 16, device=device)
    from tilegen.mods import library

    alibi = library.alibi(torch.ones(2, device=device))
    writers = [
        ("attention", lambda: tilegen.attention(q, k, v, causal=True, out=dense_out), [dense_out]),
        ("attention-score-mod", lambda: tilegen.attention(q, k, v, score_mod=alibi, out=dense_out), [dense_out]),
        ("attention-over-q", lambda: tilegen.attention(q, k, v, out=q), [q]),
        ("varlen_attention", lambda: tilegen.varlen_attention(*rows, cu, cu, 5, 5, out=ragged_out), [ragged_out]),
        ("PagedDecode", lambda: decode.run(decode_q, cache, out=decode_out), [decode_out]),
        ("PagedAttention", lambda: attn.run(paged_q, cache, out=paged_out), [paged_out]),
        ("CascadeAttention", lambda: cascade.run(decode_q, cache, out=cascade_out), [cascade_out]),
        ("merge_states", lambda: tilegen.merge_states(o_a, lse_a, o_b, lse_b, out=merged, out_lse=merged_lse),
         [merged, merged_lse]),
        ("apply_rope", lambda: tilegen.apply_rope(x, cos, sin, out=x), [x]),
        ("append_kv", lambda: tilegen.append_kv(cache, new_k, new_v, _cu([1, 1], device)),
         [cache.k_pages, cache.v_pages]),
    ]
    assert [name for name, _, _ in writers] == WRITERS
    return {name: (write, targets) for name, write, targets in writers}


@pytest.mark.parametrize("name", WRITERS)
def test_a_write_into_the_callers_tensor_counts_in_its_version(name, device):
    """Every op that writes into a tensor of the caller's (``out=``, in place, the cache's pages) counts the write in
    its version counter, as torch's in-place ops do: a graph that saved the tensor for its backward refuses to run on
    the overwritten values, where it silently took them (the kernels write through pointers, which autograd does not
    see)."""
    write, targets = _writers(device)[name]
    weight = torch.ones((), device=device, requires_grad=True)
    saved = [weight * t for t in targets]  # mul saves each target for the weight's gradient
    versions = [t._version for t in targets]
    write()
    assert all(t._version > before for t, before in zip(targets, versions)), name
    for product in saved:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            product.sum().backward()
