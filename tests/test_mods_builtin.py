"""Mods that mean a built-in option become that option (tilegen.mods.builtin): decided from the canonical
text alone, checked here against the masks themselves."""

from __future__ import annotations

import pytest
import torch

from tilegen.families.attention_fwd.masks import window_bounds
from tilegen.families.attention_fwd.reference import allowed_keys
from tilegen.mods import library
from tilegen.mods.builtin import reduce_mods
from tilegen.mods.trace import traced

MASKS = {
    "causal": library.causal(),
    "window 16": library.sliding_window(16),
    "window 16 both ways": library.sliding_window(16, causal=False),
    "kv <= q": lambda b, h, q, k: k <= q,
    "up to 3 ahead": lambda b, h, q, k: k - q <= 3,
    "2*(q-k) < 9 and k-3 <= q": lambda b, h, q, k: (2 * (q - k) < 9) & (k - 3 <= q),
    "abs(k-q) < 5": lambda b, h, q, k: torch.abs(k - q) < 5,
    "q == k": lambda b, h, q, k: q == k,
}
NOT_BANDS = {
    "global tokens": library.sliding_window(16, global_tokens=2),
    "prefix-lm": library.prefix_lm(torch.tensor([3])),
    "document": library.document_mask(torch.zeros(40, dtype=torch.int32)),
    "q > 2k": lambda b, h, q, k: q > 2 * k,
    "q - k != 3": lambda b, h, q, k: q - k != 3,
    "by head": lambda b, h, q, k: (q >= k) & (h == 0),
    "or": lambda b, h, q, k: (q >= k) | (k < 1),
    # A band, but one the built-in window cannot say: it keeps no key on the diagonal or left of it.
    "strictly past": lambda b, h, q, k: (q - k > 0) & (q - k <= 8),
    "positions alone": lambda b, h, q, k: q >= 0,
}


def _keep(fn, n_q, n_k):
    q, k = torch.arange(n_q).view(-1, 1), torch.arange(n_k).view(1, -1)
    return torch.broadcast_to(fn(torch.tensor(0), torch.tensor(0), q, k), (n_q, n_k))


@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("n_q, n_k, causal", [(37, 37, False), (37, 37, True), (5, 37, False), (37, 5, False),
                                              (21, 50, True)])
def test_a_band_mask_becomes_the_window_that_keeps_the_same_keys(name, n_q, n_k, causal):
    fn = MASKS[name]
    left, right = window_bounds(None, causal)
    reduced = reduce_mods(None, traced(fn, "mask_mod").canonical, left, right, None, n_q, n_k)
    want = _keep(fn, n_q, n_k) & allowed_keys(n_q, n_k, causal=causal, window=None)
    if reduced.mask_mod is None:
        assert torch.equal(allowed_keys(n_q, n_k, causal=False, window=reduced.window), want), reduced
    else:  # left a mod: only where the built-ins cannot say it (a band past the moved diagonal)
        assert n_q != n_k and reduced.window == (left, right)
        assert not torch.equal(want, allowed_keys(n_q, n_k, causal=causal, window=None))


def test_bands_that_agree_in_shape_are_absorbed_where_the_positions_line_up():
    for name, fn in MASKS.items():
        assert reduce_mods(None, traced(fn, "mask_mod").canonical, None, None, None, 40, 40).mask_mod is None, name


@pytest.mark.parametrize("name", NOT_BANDS)
def test_other_masks_stay_mods(name):
    text = traced(NOT_BANDS[name], "mask_mod").canonical
    reduced = reduce_mods(None, text, None, 0, None, 40, 40)
    assert reduced.mask_mod == text and reduced.window == (None, 0)


@pytest.mark.parametrize("fn, cap", [
    (library.softcap(30.0), 30.0),
    (lambda s, b, h, q, k: torch.tanh(s / 20) * 20, 20.0),
    (lambda s, b, h, q, k: s, None),
])
def test_a_softcap_score_mod_becomes_the_softcap(fn, cap):
    reduced = reduce_mods(traced(fn, "score_mod").canonical, None, None, None, None, 8, 8)
    assert reduced.score_mod is None and reduced.softcap == cap


@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, k: torch.tanh(s / 20) * 30,
    lambda s, b, h, q, k: torch.tanh(s / 20),
    lambda s, b, h, q, k: 20 * torch.tanh(s * 0.05),
    library.alibi(torch.ones(2)),
])
def test_other_score_mods_stay_mods(fn):
    text = traced(fn, "score_mod").canonical
    assert reduce_mods(text, None, None, None, None, 8, 8).score_mod == text


def test_a_softcap_mod_over_a_softcap_of_the_call_stays_a_mod():
    text = traced(library.softcap(30.0), "score_mod").canonical
    reduced = reduce_mods(text, None, None, None, 50.0, 8, 8)
    assert reduced.score_mod == text and reduced.softcap == 50.0


def test_paged_plans_run_a_band_mask_and_a_softcap_mod_as_the_built_ins(device):
    """PagedAttention and PagedDecode plans: a causal mask mod and a softcap score mod become causal=True and
    softcap (the spec holds no mod), and the output is the built-in call's."""
    import tilegen
    from tilegen.ops.kv_cache import PagedKVCache

    torch.manual_seed(0)
    page, heads_kv, dim = 8, 2, 16  # sequences of 5 and 9 keys, on shuffled pages
    k_pages, v_pages = (torch.randn(4, page, heads_kv, dim, device=device) for _ in range(2))
    indptr = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    indices = torch.tensor([3, 0, 2], dtype=torch.int32, device=device)
    last = torch.tensor([5, 1], dtype=torch.int32, device=device)
    cache = PagedKVCache(k_pages, v_pages, indptr, indices, last)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)  # 2 and 3 new tokens at the ends of 5 and 9 keys
    q = torch.randn(5, 4, dim, device=device)
    builtin, modded = tilegen.PagedAttention(), tilegen.PagedAttention()
    builtin.plan(cu, cache, heads_q=4, causal=True, softcap=20.0, q_dtype=torch.float32)
    modded.plan(cu, cache, heads_q=4, score_mod=library.softcap(20.0), mask_mod=library.causal(),
                q_dtype=torch.float32)
    assert modded._plan.spec == builtin._plan.spec
    assert torch.equal(modded.run(q, cache), builtin.run(q, cache))
    decode_builtin, decode_modded = tilegen.PagedDecode(), tilegen.PagedDecode()
    decode_builtin.plan(cache, heads_q=4, window=(3, 0), q_dtype=torch.float32)
    decode_modded.plan(cache, heads_q=4, mask_mod=library.sliding_window(3), q_dtype=torch.float32)
    assert decode_modded._plan.spec == decode_builtin._plan.spec
    q = torch.randn(2, 4, dim, device=device)
    assert torch.equal(decode_modded.run(q, cache), decode_builtin.run(q, cache))


def test_the_dense_and_ragged_ops_run_a_band_mask_and_a_softcap_mod_as_the_built_ins(device, monkeypatch):
    """tilegen.attention and varlen_attention: the absorbed call is the built-in one, to the bit (the same
    kernel), its gradients included; a ragged batch whose queries are not its keys keeps its mask mod."""
    import tilegen
    from tilegen.ops import varlen as varlen_module

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 19, 16, device=device) for _ in range(3))
    for n_k in (19, 25):  # aligned, and the mods' top-left positions shifted by 6 against the built-ins'
        kk, vv = torch.randn(1, 4, n_k, 16, device=device), torch.randn(1, 4, n_k, 16, device=device)
        shift = n_k - 19
        band = (lambda b, h, qi, ki: ki <= qi + 6) if shift else library.causal()  # both the built-in causal
        got = tilegen.attention(q, kk, vv, score_mod=library.softcap(20.0), mask_mod=band)
        assert torch.equal(got, tilegen.attention(q, kk, vv, causal=True, softcap=20.0))
    q.requires_grad_()
    got = tilegen.attention(q, k, v, mask_mod=library.sliding_window(4))
    want = tilegen.attention(q, k, v, window=(4, 0))
    assert torch.equal(torch.autograd.grad(got.sum(), q)[0], torch.autograd.grad(want.sum(), q)[0])
    q = q.detach()[0].transpose(0, 1).contiguous()  # 19 tokens of 4 heads: two sequences, 7 and 12
    cu = torch.tensor([0, 7, 19], dtype=torch.int32, device=device)
    got = tilegen.varlen_attention(q, q, q, cu, cu, 12, 12, mask_mod=library.causal())
    assert torch.equal(got, tilegen.varlen_attention(q, q, q, cu, cu, 12, 12, causal=True))
    calls = []
    real = varlen_module._with_mods
    monkeypatch.setattr(varlen_module, "_with_mods", lambda *a: calls.append(a[-1]) or real(*a))
    tilegen.varlen_attention(q, q, q, cu, cu.clone(), 12, 12, mask_mod=library.causal())
    assert calls[-1] is not None  # equal offsets in another tensor: not known without reading them
