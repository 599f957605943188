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
