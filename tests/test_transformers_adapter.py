"""tilegen.integrations.transformers' attention function, without transformers: its contract (layouts, GQA,
causal from the module, scale, sliding window, softcap, padding masks, packed sequences' ids) against SDPA
and the float64 reference, and what it hands to SDPA instead. Importing tilegen must not import transformers."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import nan_outputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegen.ops.varlen as varlen_op
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.integrations import transformers as tilegen_hf


def _qkv(device, n=19, heads=4, heads_kv=2, d=16, seed=0, batch=2):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, n, d, generator=gen).to(device) for h in (heads, heads_kv, heads_kv))
    return q, k, v


def _rel(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("module_causal", [True, False])
def test_output_layout_gqa_and_causal_from_the_module(module_causal, device):
    q, k, v = _qkv(device)
    module = types.SimpleNamespace(is_causal=module_causal)
    out, weights = tilegen_hf.attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.3)
    assert weights is None and out.shape == (2, 19, 4, 16) and out.is_contiguous()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=module_causal, scale=0.3, enable_gqa=True)
    assert _rel(out, ref.transpose(1, 2)) < 1e-4


def test_the_is_causal_keyword_wins_over_the_module(device):
    q, k, v = _qkv(device)
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, None, is_causal=False)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert _rel(out, ref.transpose(1, 2)) < 1e-4


def test_sliding_window_and_softcap(device):
    q, k, v = _qkv(device)
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, None,
                                          sliding_window=4, softcap=2.0)
    # transformers keeps keys with kv_idx > q_idx - sliding_window: 3 before the diagonal.
    ref = attention_reference(q, k, v, causal=True, window=(3, 0), softcap=2.0)[0]
    assert _rel(out, ref.transpose(1, 2)) < 1e-4


def test_an_explicit_sliding_window_of_none_wins_over_the_module(device):
    """Not passed, the window is the module's; passed as None (EXAONE 4's full-attention layers, whose module holds
    the config's window), there is none."""
    q, k, v = _qkv(device)
    module = types.SimpleNamespace(is_causal=True, sliding_window=4)
    windowed = attention_reference(q, k, v, causal=True, window=(3, 0))[0].transpose(1, 2)
    full = attention_reference(q, k, v, causal=True)[0].transpose(1, 2)
    out, _ = tilegen_hf.attention_forward(module, q, k, v, None)
    assert _rel(out, windowed) < 1e-4
    out, _ = tilegen_hf.attention_forward(module, q, k, v, None, sliding_window=None)
    assert _rel(out, full) < 1e-4


def test_an_autocast_region_casts_every_path_as_sdpa_does(device):
    """In an autocast region, fp32 inputs and the mixed ones a model's fp32 static cache hands over (bf16 queries,
    fp32 keys and values) run in the region's dtype, as transformers' SDPA path and tilegen.attention run them, on
    the unmasked path as on the padded one. The unmasked path ignored the region: an fp32 output, and the mixed
    inputs refused."""
    q, k, v = _qkv(device, n=9)
    module = types.SimpleNamespace(is_causal=True)
    mask = torch.ones(2, 9, dtype=torch.bool, device=device)
    mask[0, :3] = False
    for dtype in (torch.bfloat16, torch.float16):
        for inputs in ((q, k, v), (q.to(dtype), k, v)):
            cast = [t.to(dtype) for t in inputs]
            for attention_mask in (None, mask):
                want, _ = tilegen_hf.attention_forward(module, *cast, attention_mask)
                with torch.autocast(torch.device(device).type, dtype=dtype):
                    got, _ = tilegen_hf.attention_forward(module, *inputs, attention_mask)
                assert got.dtype == dtype
                torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.fixture
def _fresh_warnings():
    tilegen_hf._warned.clear()
    yield
    tilegen_hf._warned.clear()


def _dense_reference(q, k, v, allowed):
    """SDPA on a [batch, 1, n_q, n_k] bool mask; rows that see no key are zeros, as tilegen gives them."""
    none = ~allowed.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | none, enable_gqa=True)
    return out.masked_fill(none, 0.0).transpose(1, 2)


def _causal(n_q, n_k, device, window=None):
    i = torch.arange(n_q, device=device)[:, None] + n_k - n_q
    j = torch.arange(n_k, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    return allowed[None, None]


def _poisoned(t, padding):
    """``t`` [batch, heads, n, dim] with NaN in its padded positions (the last n of the mask's)."""
    return t.masked_fill(~padding[:, None, -t.shape[2]:, None], math.nan)


@pytest.mark.parametrize("n_q", [19, 3, 1], ids=["prefill", "chunk", "decode"])
def test_a_padding_mask_runs_ragged_with_zeros_in_padded_rows(n_q, device, monkeypatch):
    """Left and right padding (and a row with no real token) are read in place: the padded positions
    hold NaN here, and reach neither a real row nor a padded one."""
    q, k, v = _qkv(device, batch=3)
    padding = torch.ones(3, 19, dtype=torch.bool, device=device)
    padding[0, :6] = False  # left
    padding[1, 15:] = False  # right
    padding[2] = False  # nothing real
    q, k, v = (_poisoned(t, padding) for t in (q[:, :, -n_q:].contiguous(), k, v))
    ran = []
    real = tilegen_hf.padded_call  # varlen_attention_padded with its offsets' key made once per layout
    monkeypatch.setattr(tilegen_hf, "padded_call", lambda *a, **kw: ran.append(a[4].tolist()) or real(*a, **kw))
    monkeypatch.setattr(torch.Tensor, "index_select", None)  # nothing gathered
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, padding)
    assert len(ran) == 1 and len(ran[0]) == 3 * 3 + 3 and out.shape == (3, n_q, 4, 16)
    allowed = _causal(n_q, 19, device) & padding[:, None, None, :]
    ref = _dense_reference(q.nan_to_num(), k.nan_to_num(), v.nan_to_num(), allowed)
    real_rows = padding[:, -n_q:]
    assert _rel(out[real_rows], ref[real_rows]) < 1e-4
    assert (out[~real_rows] == 0).all()


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 12)), min_size=1, max_size=4),
       after=st.integers(0, 4), fewer_queries=st.integers(0, 12), causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 8)), seed=st.integers(0, 99))
def test_padding_runs_in_place_property(runs, after, fewer_queries, causal, window, seed, device):
    """Any rows of one run of real tokens each (left, right, both, none at all), queries the last n_q of the keys
    (or, bidirectional, where the mask pads the keys only: every query real), a causal sliding window or none,
    NaN in every padded position."""
    window = window if causal else None
    n = max(1, max(lead + length for lead, length in runs) + after)
    padding = torch.zeros(len(runs), n, dtype=torch.bool)
    for b, (lead, length) in enumerate(runs):
        padding[b, lead:lead + length] = True
    padding = padding.to(device)
    n_q = max(1, n - fewer_queries)
    q, k, v = _qkv(device, n=n, seed=seed, batch=len(runs))
    real_q = padding[:, -n_q:] if causal else torch.ones_like(padding[:, :n_q])
    q = q[:, :, -n_q:].masked_fill(~real_q[:, None, :, None], math.nan)
    k, v = (_poisoned(t, padding) for t in (k, v))
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=causal), q, k, v, padding,
                                          sliding_window=window)
    pattern = _causal(n_q, n, device, window)[0, 0] if causal else torch.ones(n_q, n, dtype=torch.bool, device=device)
    ref = _dense_reference(q.nan_to_num(), k.nan_to_num(), v.nan_to_num(), pattern & padding[:, None, None, :])
    seen = real_q & (pattern & padding[:, None, :]).any(-1)  # real queries that see a key
    assert not out.isnan().any() and (out[~seen] == 0).all()
    if seen.any():
        assert _rel(out[seen], ref[seen]) < 1e-4


def test_layers_of_one_mask_with_other_arguments_each_get_their_own(device, monkeypatch):
    """The in-place path keeps its offsets' key per layout and per module arguments: layers that share the padding
    mask but differ in scale, softcap, window or causality (Gemma 2's alternating layers) each run with theirs,
    in any order and again."""
    # transformers' layout, [batch, n, heads, dim] seen as [batch, heads, n, dim]: the in-place path's
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv(device, batch=2, seed=11))
    padding = torch.ones(2, 19, dtype=torch.bool, device=device)
    padding[0, :5] = False
    padding[1, 16:] = False

    def flattened(*args, **kwargs):
        raise AssertionError("q, k and v were flattened: the in-place launch did not run")

    monkeypatch.setattr(varlen_op, "varlen_attention", flattened)
    layers = [dict(scaling=0.25), dict(scaling=0.25, softcap=3.0), dict(scaling=0.4, sliding_window=5), dict()]
    for kwargs in layers + layers[::-1]:
        for causal in (True, False):
            out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=causal), q, k, v, padding, **kwargs)
            window = kwargs.get("sliding_window")
            allowed = (_causal(19, 19, device, window=window) if causal else
                       torch.ones(1, 1, 19, 19, dtype=torch.bool, device=device)) & padding[:, None, None, :]
            if window is not None and not causal:
                i = torch.arange(19, device=device)
                allowed &= ((i[:, None] - i[None, :]).abs() <= window)[None, None]
            kk, vv = (t.double().repeat_interleave(2, 1) for t in (k, v))
            scores = q.double() @ kk.transpose(-1, -2) * kwargs.get("scaling", 16 ** -0.5)
            if "softcap" in kwargs:
                scores = kwargs["softcap"] * torch.tanh(scores / kwargs["softcap"])
            ref = (scores.masked_fill(~allowed, -math.inf).softmax(-1) @ vv).transpose(1, 2)
            # A causal call's padded queries are zeros, and so are a window's (its queries are the keys' tokens); a
            # bidirectional mask pads the keys only (the call may be cross-attention): every query attends.
            real = padding if causal or window is not None else torch.ones_like(padding)
            assert _rel(out[real], ref[real].to(out.dtype)) < 1e-4, (kwargs, causal)
            assert (out[~real] == 0).all()


def test_arguments_equal_to_served_ones_but_of_another_type_are_still_refused(device):
    """The in-place path keeps its call keys by the module's arguments, with their types: after a call with
    scaling 1.0, one with scaling True is refused by name as on a fresh mask (True == 1.0), and so is a window of
    4.0 after one of 4."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv(device, n=7, seed=12))
    module = types.SimpleNamespace(is_causal=True)
    for n_q in (7, 1):  # the in-place prefill, and a padded decoding step (PagedDecode's plans and launches)
        for served, refused, message in [(dict(scaling=1.0), dict(scaling=True), "scale"),
                                         (dict(softcap=1.0), dict(softcap=True), "softcap"),
                                         (dict(sliding_window=4), dict(sliding_window=4.0), "sliding_window")]:
            padding = torch.ones(2, 7, dtype=torch.bool, device=device)
            padding[0, :2] = False
            query = q[:, :, -n_q:]
            tilegen_hf.attention_forward(module, query, k, v, padding, **served)
            with pytest.raises(ValueError, match=message):
                tilegen_hf.attention_forward(module, query, k, v, padding, **refused)


def test_a_decoding_step_over_one_key_of_other_strides_runs_with_its_own(device):
    """A cache of one key a row is contiguous whatever its token stride, which sets where each row's slot lies:
    two layers whose caches differ only there each get their own launch."""
    gen = torch.Generator().manual_seed(13)
    padding = torch.tensor([[True], [True], [False]], device=device)
    q = torch.randn(3, 1, 4, 16, generator=gen).to(device).transpose(1, 2)

    def one_key(layout):  # [3, 2, 1, 16]: token stride 16 (rows two slots apart), or 32 (one apart)
        t = torch.randn(3, 2, 16, generator=gen)[:, :, None] if layout else torch.randn(3, 1, 2, 16, generator=gen)
        return t.to(device) if layout else t.to(device).transpose(1, 2)

    caches = [(one_key(True), one_key(True)), (one_key(False), one_key(False))]
    assert caches[0][0].is_contiguous() and caches[1][0].is_contiguous()
    assert caches[0][0].stride() != caches[1][0].stride()
    for k, v in caches:
        out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, padding)
        ref = _dense_reference(q, k, v, padding[:, None, None, :])
        assert _rel(out[padding[:, -1:]], ref[padding[:, -1:]]) < 1e-4
        assert (out[~padding[:, -1]] == 0).all()


@pytest.mark.parametrize("bad, message", [
    ("value dtype", r"\bv\b.*float16"), ("query dtype", r"\bk\b.*differs from q's"),
    ("head dim", r"k: head_dim 32 differs from q's 16"), ("float64", r"q: expected dtype"),
])
def test_a_decoding_step_the_paged_kernel_refuses_names_the_callers_tensors(bad, message, device):
    """A padded decoding step PagedDecode cannot take is refused by the ragged path's op, which names q, k and v
    (as an unpadded call's does), not the one-slot pages it would have read."""
    q, k, v = _qkv(device, n=9, seed=15)
    q = q[:, :, -1:]
    if bad == "value dtype":
        v = v.half()
    elif bad == "query dtype":
        q = q.half()
    elif bad == "head dim":
        k = torch.cat([k, k], -1)
    else:
        q, k, v = q.double(), k.double(), v.double()
    padding = torch.ones(2, 9, dtype=torch.bool, device=device)
    padding[0, :3] = False
    with pytest.raises((ValueError, TypeError), match=message) as caught:
        tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, padding)
    assert "pages" not in str(caught.value)


def test_a_mask_made_under_inference_mode_is_served(device):
    """Inference tensors count no versions: the layout is kept by the mask alone (the module docstring)."""
    with torch.inference_mode():
        q, k, v = _qkv(device, n=7, seed=14)
        padding = torch.ones(2, 7, dtype=torch.bool, device=device)
        padding[0, :2] = False
        for _ in range(2):
            out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, padding)
            ref = _dense_reference(q, k, v, _causal(7, 7, device) & padding[:, None, None, :])
            assert _rel(out[padding], ref[padding]) < 1e-4


def _refuse_ragged(monkeypatch):
    """Make the ragged path (and any gather or flattening copy of K and V) fail: the call must not take it."""
    def refused(*args, **kwargs):
        raise AssertionError("the ragged path ran")

    monkeypatch.setattr(tilegen_hf, "varlen_attention", refused)
    monkeypatch.setattr(tilegen_hf, "varlen_attention_padded", refused)
    monkeypatch.setattr(tilegen_hf, "padded_call", refused)
    monkeypatch.setattr(torch.Tensor, "index_select", None)


@pytest.mark.parametrize("cache", ["head-major", "static", "token-major"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_padded_decoding_step_reads_the_cache_in_place(cache, causal, device, monkeypatch):
    """One query a row against transformers' cache: left padding, a row with holes, a row with no key, GQA 4/2,
    softcap and a scale, NaN in every padded key. PagedDecode reads the keys where the cache holds them."""
    batch, n, length = 4, 19, 23
    gen = torch.Generator().manual_seed(5 + causal)
    padding = torch.ones(batch, n, dtype=torch.bool)
    padding[0, :6] = False  # left
    padding[1, 3:8] = False  # holes
    padding[2] = False  # no key at all
    padding = padding.to(device)
    q = torch.randn(batch, 4, 1, 16, generator=gen).to(device)
    if cache == "static":  # [batch, kv_heads, max length, dim], the mask covering the first n keys
        k, v = (torch.randn(batch, 2, length, 16, generator=gen).to(device) for _ in "kv")
    elif cache == "head-major":  # what transformers' dynamic cache concatenates
        k, v = (torch.randn(batch, 2, n, 16, generator=gen).to(device) for _ in "kv")
    else:  # the projections' own layout, [batch, n, kv_heads, dim] transposed
        k, v = (torch.randn(batch, n, 2, 16, generator=gen).to(device).transpose(1, 2) for _ in "kv")
    k[:, :, :n], v[:, :, :n] = (_poisoned(t[:, :, :n], padding) for t in (k, v))
    _refuse_ragged(monkeypatch)
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=causal), q, k, v, padding, scaling=0.3,
                                          softcap=2.0)
    assert out.shape == (batch, 1, 4, 16)
    keys, values = (t[:, :, :n].nan_to_num().double().repeat_interleave(2, dim=1) for t in (k, v))
    scores = 2.0 * torch.tanh(q.double() @ keys.transpose(-1, -2) * 0.3 / 2.0)
    weights = scores.masked_fill(~padding[:, None, None, :], -math.inf).softmax(-1).nan_to_num()
    ref = (weights @ values).transpose(1, 2)  # one query, at the last key: causal or not, it sees every key
    real = padding.any(-1)
    assert not out.isnan().any() and (out[~real] == 0).all()
    assert _rel(out[real], ref[real]) < 1e-4


def test_every_layer_of_a_padded_decoding_step_reads_its_own_cache(device, monkeypatch):
    """The first layer of a step runs PagedDecode.run and keeps a launch through views of transformers' tensors; the
    other layers launch it. Each layer's cache (other values, the same layout) gives that layer's answer, every
    output element written; a layer laid out otherwise (a token-major cache, a query of every other element) runs
    PagedDecode.run once again."""
    batch, n = 3, 19
    gen = torch.Generator().manual_seed(21)
    padding = torch.ones(batch, n, dtype=torch.bool)
    padding[0, :6] = False
    padding[2, 4:9] = False  # holes
    padding = padding.to(device)
    runs = []
    real_run = tilegen_hf.PagedDecode.run
    monkeypatch.setattr(tilegen_hf.PagedDecode, "run",
                        lambda self, *a, **kw: runs.append(1) or real_run(self, *a, **kw))
    nan_outputs(monkeypatch)
    _refuse_ragged(monkeypatch)
    module = types.SimpleNamespace(is_causal=True)
    for layer in range(5):
        q = torch.randn(batch, 1, 4, 16, generator=gen).to(device).transpose(1, 2)  # transformers' query layout
        if layer == 4:  # the same shape, not contiguous
            q = torch.randn(batch, 1, 4, 32, generator=gen).to(device)[..., ::2].transpose(1, 2)
        if layer != 3:  # what a dynamic cache concatenates: [batch, kv_heads, n, dim]
            k, v = (torch.randn(batch, 2, n, 16, generator=gen).to(device) for _ in "kv")
        else:
            k, v = (torch.randn(batch, n, 2, 16, generator=gen).to(device).transpose(1, 2) for _ in "kv")
        for t in (k, v):  # in place: the layout stays the cache's
            t.masked_fill_(~padding[:, None, :, None], math.nan)
        out, _ = tilegen_hf.attention_forward(module, q, k, v, padding)
        assert out.shape == (batch, 1, 4, 16) and out.is_contiguous() and not out.isnan().any()
        assert _rel(out, _dense_reference(q, k.nan_to_num(), v.nan_to_num(), padding[:, None, None, :])) < 1e-4
        assert len(runs) == (1 if layer < 3 else layer - 1), f"layer {layer}"


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_a_padded_decoding_step_with_a_window(holes, causal, device, monkeypatch, _fresh_warnings):
    """The window counts positions, as transformers' masks do, holes in a row included: the page table lists the
    keys inside it."""
    q, k, v = _qkv(device, n=19, batch=3)
    q = q[:, :, -1:]
    padding = torch.ones(3, 19, dtype=torch.bool, device=device)
    padding[0, :11] = False
    if holes:
        padding[1, 14:17] = False  # inside the window
        padding[2, 2:9] = False  # before it
    k, v = (_poisoned(t, padding) for t in (k, v))
    _refuse_ragged(monkeypatch)
    module = types.SimpleNamespace(is_causal=causal)
    out, _ = tilegen_hf.attention_forward(module, q, k, v, padding, sliding_window=5)
    assert not tilegen_hf._warned
    if causal:  # the query and the 4 keys before it
        allowed = _causal(1, 19, device, window=5)
    else:  # transformers' bidirectional window: |q_idx - kv_idx| <= 5, the query at the last key
        allowed = (torch.arange(19, device=device) >= 13)[None, None, None, :]
    allowed = allowed & padding[:, None, None, :]
    assert _rel(out, _dense_reference(q, k.nan_to_num(), v.nan_to_num(), allowed)) < 1e-4


def test_a_padded_decoding_step_under_torch_compile(device, monkeypatch):
    """A compiled model's padded decoding step: the padding layout breaks the graph (it reads the mask on the host),
    and the step runs the ragged path's op (a PagedDecode plan is made outside a trace only), as right as eagerly."""
    q, k, v = _qkv(device, n=19, batch=2, seed=7)
    q = q[:, :, -1:]
    padding = torch.ones(2, 19, dtype=torch.bool, device=device)
    padding[1, :6] = False

    def step(q, k, v, padding):
        return tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, padding)[0]

    ran = []
    real = tilegen_hf.padded_call
    monkeypatch.setattr(tilegen_hf, "padded_call", lambda *a, **kw: ran.append("varlen") or real(*a, **kw))
    torch._dynamo.reset()
    got = torch.compile(step, backend="eager")(q, k, v, padding)
    assert ran == ["varlen"]
    want = step(q, k, v, padding)
    assert ran == ["varlen"], "eagerly, PagedDecode"
    ref = _dense_reference(q, k, v, padding[:, None, None, :])
    assert _rel(got, ref) < 1e-4 and _rel(want, ref) < 1e-4
    # With the mask's plan made eagerly first, the compiled step still takes the ragged path's op.
    torch._dynamo.reset()
    assert _rel(torch.compile(step, backend="eager")(q, k, v, padding), ref) < 1e-4
    assert ran == ["varlen", "varlen"]


def test_a_cache_past_int32_token_positions_is_not_paged(device):
    """Slot ids are int32: a padded batch whose slots would pass 2**31 - 1 is not viewed as pages (meta tensors: the
    shapes without the memory)."""
    big = torch.empty(40000, 2, 60000, 16, device="meta")
    assert tilegen_hf._slots(big, 60000) is None
    assert tilegen_hf._slots(big[:2], 60000)[1] == 2 * 60000


def test_a_decoding_step_keeps_no_key_or_value_alive(device):
    """Generation makes new K and V tensors (a dynamic cache concatenates) and a new mask every step: once the
    step's tensors are gone, nothing of the integration's holds them or the mask's layouts."""
    import gc
    import weakref

    q, k, v = _qkv(device, n=19, batch=2, seed=8)
    padding = torch.ones(2, 19, dtype=torch.bool, device=device)
    padding[0, :5] = False
    for _ in range(2):  # two layers: the second takes the first's page table
        tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q[:, :, -1:], k, v, padding)
    gone = [weakref.ref(t) for t in (k, v)]
    del k, v
    gc.collect()
    assert all(ref() is None for ref in gone), "the mask's page table holds a layer's keys"
    mask_id = id(padding)
    assert [key for key in tilegen_hf._layouts if key[0] == mask_id]
    del padding
    gc.collect()
    assert not [key for key in tilegen_hf._layouts if key[0] == mask_id], "a dead mask's layouts are kept"


def test_a_layout_a_cuda_graph_was_captured_with_outlives_its_mask(device, monkeypatch):
    """A graph captured over a padded step replays its layout's tensors (offsets, the page table, the decode plan's
    partials) after the mask that made them is gone: a layout found during a capture is kept for the process."""
    import gc
    import weakref

    monkeypatch.setattr(tilegen_hf, "_captured", {})
    q, k, v = _qkv(device, n=19, batch=2, seed=9)
    padding = torch.ones(2, 19, dtype=torch.bool, device=device)
    padding[1, :4] = False
    module = types.SimpleNamespace(is_causal=True)
    tilegen_hf.attention_forward(module, q[:, :, -1:], k, v, padding)  # the warm-up makes the layout
    # The padding's layout and the decoding step's page table over one-slot pages.
    keys = [key for key in tilegen_hf._layouts if key[0] == id(padding)]
    found = {key[-1]: tilegen_hf._layouts[key][2] for key in keys}
    assert set(found) == {tilegen_hf._padding_layout, tilegen_hf._slot_table}
    layout, table = found[tilegen_hf._padding_layout], found[tilegen_hf._slot_table]
    # What the graph replays: the page table and the decode plan's partials.
    replayed = [*table.pages, *(t for d in table.plans.values() for t in (d._plan.part_o, d._plan.part_lse))]
    refs = [weakref.ref(t) for t in (layout, *replayed)]
    del found, layout, table, replayed
    monkeypatch.setattr(tilegen_hf, "_capturing", lambda t: True)
    tilegen_hf.attention_forward(module, q[:, :, -1:], k, v, padding)  # as a capture would call it
    monkeypatch.setattr(tilegen_hf, "_capturing", lambda t: False)
    del padding
    gc.collect()
    assert not [key for key in keys if key in tilegen_hf._layouts]
    assert all(ref() is not None for ref in refs), "a tensor a graph was captured with was freed"
    assert list(tilegen_hf._captured.values()) == [refs[0]()]


@pytest.mark.gpu
def test_a_captured_padded_decoding_step_replays_after_its_mask_is_gone():
    """A CUDA graph of padded decoding steps (two layers), captured after a warm-up call with the same mask: its
    replays give the eager output, and still do once the mask is gone and later steps' masks replaced its layouts."""
    import gc

    q, k, v = _qkv("cuda", n=300, heads=8, heads_kv=2, d=64, batch=3, seed=10)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    padding = torch.ones(3, 300, dtype=torch.bool, device="cuda")
    padding[0, :40] = False
    padding[2, 100:130] = False
    module = types.SimpleNamespace(is_causal=True)
    step = q[:, :, -1:].clone()

    def two_layers():
        out, _ = tilegen_hf.attention_forward(module, step, k, v, padding)
        return tilegen_hf.attention_forward(module, out.transpose(1, 2).contiguous(), k, v, padding)[0]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = two_layers().clone()  # the warm-up: layouts and plans made outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = two_layers()
    del padding
    for n in range(2 * tilegen_hf._MAX_LAYOUTS):  # later steps' masks, enough to clear the layouts' table
        other = torch.ones(3, 300, dtype=torch.bool, device="cuda")
        other[n % 3, : n + 1] = False
        tilegen_hf.attention_forward(module, step, k, v, other)
    gc.collect()
    torch.cuda.empty_cache()
    junk = torch.full((1 << 24, ), float("nan"), device="cuda")  # freed memory reused, and poisoned
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    del junk
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("why", ["the query is padding", "a gradient", "strides"])
def test_a_decoding_step_paged_decode_cannot_serve_runs_ragged(why, device, monkeypatch, _fresh_warnings):
    q, k, v = _qkv(device, n=19, batch=2, seed=6)
    q = q[:, :, -1:]
    padding = torch.ones(2, 19, dtype=torch.bool, device=device)
    padding[0, :4] = False
    if why == "the query is padding":  # right padding: row 1's last position, the query's, is padding
        padding[1, 15:] = False
    elif why == "a gradient":  # the decode kernel has no backward
        q.requires_grad_()
    elif why == "strides":  # rows 8 elements apart beyond their tokens: no fixed distance in tokens between rows
        k, v = (torch.empty(2 * 2 * 19 * 16 + 8, device=device).as_strided(t.shape, (2 * 19 * 16 + 8, 19 * 16, 16, 1))
                .copy_(t) for t in (k, v))
    served = []
    for name in ("varlen_attention", "varlen_attention_padded", "padded_call", "_fallback"):
        real = getattr(tilegen_hf, name)
        monkeypatch.setattr(tilegen_hf, name, lambda *a, _real=real, _name=name, **kw: served.append(_name)
                            or _real(*a, **kw))
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, padding)
    assert served == ["padded_call"]
    allowed = _causal(1, 19, device) & padding[:, None, None, :]
    ref = _dense_reference(q.detach(), k, v, allowed)
    real = padding[:, -1:]
    assert _rel(out.detach()[real], ref[real]) < 1e-4 and (out[~real] == 0).all()


@pytest.mark.parametrize("n_q, n_k, causal", [(0, 0, True), (3, 0, False), (0, 5, True)])
def test_a_padding_mask_over_no_tokens(n_q, n_k, causal, device):
    q, k, v = (torch.randn(2, h, n, 16, device=device) for h, n in ((4, n_q), (2, n_k), (2, n_k)))
    mask = torch.zeros(2, n_k, dtype=torch.bool, device=device)
    mask[0, 2:] = True
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=causal), q, k, v, mask)
    assert out.shape == (2, n_q, 4, 16) and (out == 0).all()


@pytest.mark.parametrize("path", ["ragged", "holes", "4-d", "fallback"])
def test_a_bidirectional_mask_pads_keys_only_with_as_many_queries_as_keys(path, device, _fresh_warnings):
    """Cross-attention with the decoder as long as the encoder gets the encoder's padding mask, which says nothing of
    the queries: every query row attends the real keys, on each path a bidirectional padding mask takes."""
    # The fallback's SDPA mask is built from the 2-d one: a head dim the kernels do not take goes there.
    q, k, v = _qkv(device, d=4 if path == "fallback" else 16)
    padding = torch.ones(2, 19, dtype=torch.bool, device=device)
    padding[1, 13:] = False  # right padding
    if path == "holes":
        padding[0, 4:9] = False
    allowed = padding[:, None, None, :].expand(2, 1, 19, 19)
    mask = allowed if path == "4-d" else padding
    module = types.SimpleNamespace(is_causal=False)
    if path == "fallback":
        with pytest.warns(RuntimeWarning, match="head dim"):
            out, _ = tilegen_hf.attention_forward(module, q, k, v, mask)
        tilegen_hf._warned.clear()
    else:
        out, _ = tilegen_hf.attention_forward(module, q, k, v, mask)
    assert not tilegen_hf._warned
    assert _rel(out, _dense_reference(q, k, v, allowed)) < 1e-4
    # A 4-d mask whose padded query rows see no key is not the keys' padding alone: SDPA serves it as it is.
    rows = allowed & padding[:, None, :, None]
    with pytest.warns(RuntimeWarning, match="a mask that is not causal"):
        out, _ = tilegen_hf.attention_forward(module, q, k, v, rows)
    real = padding
    assert _rel(out[real], _dense_reference(q, k, v, rows)[real]) < 1e-4


def test_a_padded_batch_differentiates_in_place_with_no_gradient_through_padding(device):
    q, k, v = _qkv(device, seed=3)
    padding = torch.ones(2, 19, dtype=torch.bool, device=device)
    padding[0, :7] = False
    padding[1, 12:] = False
    leaves = [_poisoned(t, padding).requires_grad_() for t in (q, k, v)]
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), *leaves, padding)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(device)
    grads = torch.autograd.grad(out, leaves, dout)
    refs = [t.detach().nan_to_num().double().requires_grad_() for t in leaves]
    ref = _dense_reference(*refs, _causal(19, 19, device) & padding[:, None, None, :])
    want = torch.autograd.grad(ref, refs, dout.double().masked_fill(~padding[:, :, None, None], 0.0))
    for name, got, expected in zip("qkv", grads, want):
        assert torch.isfinite(got).all(), name
        assert (got.transpose(1, 2)[~padding] == 0).all(), name
        assert _rel(got, expected) < 1e-4, name


def test_a_padding_mask_with_holes_gathers_its_real_tokens(device):
    q, k, v = _qkv(device)
    padding = torch.ones(2, 19, dtype=torch.bool, device=device)
    padding[0, 4:9] = False  # a hole: two runs of real tokens
    padding[1, :3] = False
    layout = tilegen_hf._layout(padding, 19, 19, True, tilegen_hf._padding_layout)
    assert layout.rows_q is not None
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, padding)
    ref = _dense_reference(q, k, v, _causal(19, 19, device) & padding[:, None, None, :])
    assert _rel(out[padding], ref[padding]) < 1e-4 and (out[~padding] == 0).all()


def test_packed_ids_keep_sequences_apart(device):
    q, k, v = _qkv(device)
    ids = torch.tensor([[0] * 7 + [1] * 5 + [2] * 7, [0] * 19], device=device)
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, ids, sliding_window=5)
    allowed = _causal(19, 19, device, window=5) & (ids[:, None, :, None] == ids[:, None, None, :])
    assert _rel(out, _dense_reference(q, k, v, allowed)) < 1e-4


def test_a_bidirectional_window_keeps_keys_within_its_distance(device):
    q, k, v = _qkv(device)
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=False), q, k, v, None, sliding_window=4)
    ref = attention_reference(q, k, v, causal=False, window=(4, 4))[0]
    assert _rel(out, ref.transpose(1, 2)) < 1e-4


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_4d_causal_mask_over_padding_runs_ragged(kind, device, monkeypatch, _fresh_warnings):
    q, k, v = _qkv(device)
    padding = torch.ones(2, 19, dtype=torch.bool, device=device)
    padding[1, :5] = False
    allowed = _causal(19, 19, device, window=6) & padding[:, None, None, :]
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape, device=device).masked_fill(~allowed, -math.inf)
    ran = []
    real = tilegen_hf.padded_call
    monkeypatch.setattr(tilegen_hf, "padded_call", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, mask, sliding_window=6)
    assert ran == [1] and not tilegen_hf._warned
    assert _rel(out[padding], _dense_reference(q, k, v, allowed)[padding]) < 1e-4
    # One causal mask for the whole batch: no padding, the dense kernel.
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, _causal(19, 19, device))
    assert ran == [1] and not tilegen_hf._warned
    assert _rel(out, _dense_reference(q, k, v, _causal(19, 19, device))) < 1e-4
    # The same mask with the window the call does not have: not causal over padding.
    with pytest.warns(RuntimeWarning, match="a mask that is not causal"):
        tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, mask)


@pytest.mark.parametrize("window", [None, 4])
def test_a_4d_causal_mask_of_a_static_cache_places_its_queries_before_the_unwritten_slots(window, device,
                                                                                           _fresh_warnings):
    """A static cache's 23 slots, of which the first 12 are written once these 3 queries' keys are: the queries
    sit at positions 9 to 11, and the slots past them hold NaN here."""
    q, _, _ = _qkv(device, n=3, seed=7)
    _, k, v = _qkv(device, n=23, seed=8)
    padding = (torch.arange(23, device=device) < 12)[None].repeat(2, 1)
    padding[1, :4] = False  # left padding
    k, v = (t.masked_fill(~padding[:, None, :, None], math.nan) for t in (k, v))
    i = torch.arange(9, 12, device=device)[:, None]
    j = torch.arange(23, device=device)[None]
    allowed = (j <= i) & ((j > i - window) if window else True)
    allowed = allowed[None, None] & padding[:, None, None, :]
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, allowed,
                                          sliding_window=window)
    assert not tilegen_hf._warned
    assert _rel(out, _dense_reference(q, k.nan_to_num(), v.nan_to_num(), allowed)) < 1e-4


def test_what_it_cannot_serve_goes_to_sdpa_with_one_warning_per_reason(device, _fresh_warnings):
    q, k, v = _qkv(device)
    module = types.SimpleNamespace(is_causal=True)
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(2, 1, 19, 19, generator=gen) > 0.4).to(device)
    mask[..., 0] = True
    with pytest.warns(RuntimeWarning, match="a mask that is not causal") as caught:
        for _ in range(3):
            out, _ = tilegen_hf.attention_forward(module, q, k, v, mask, scaling=0.3)
    assert len(caught) == 1
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert _rel(out, ref.transpose(1, 2)) < 1e-5

    holes = torch.ones(2, 19, dtype=torch.bool, device=device)
    holes[0, 4:6] = False  # a window counts positions; a ragged batch would count real tokens
    with pytest.warns(RuntimeWarning, match="not one run"):
        out, _ = tilegen_hf.attention_forward(module, q, k, v, holes, sliding_window=5)
    # Padded queries' rows are zeros, as on tilegen's own paths.
    allowed = _causal(19, 19, device, window=5) & holes[:, None, None, :] & holes[:, None, :, None]
    assert _rel(out, _dense_reference(q, k, v, allowed)) < 1e-5 and not out[0, 4:6].any()

    with pytest.warns(RuntimeWarning, match="dropout"):
        out, _ = tilegen_hf.attention_forward(module, q, k, v, None, dropout=0.5)
    assert out.shape == (2, 19, 4, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("mask", ["1-d", "3-d", "4-d of another batch", "4-d of fewer keys", "float 2-d",
                                  "ids of fewer tokens", "ids with fewer queries"])
def test_a_mask_that_does_not_fit_the_call_is_refused_by_name(mask, device):
    """Each is an error naming attention_mask, not a shape error from inside torch (or a float mask taken for
    sequence ids)."""
    q, k, v = _qkv(device)
    masks = {"1-d": torch.ones(19, dtype=torch.bool), "3-d": torch.ones(2, 19, 19, dtype=torch.bool),
             "4-d of another batch": torch.ones(3, 1, 19, 19, dtype=torch.bool),
             "4-d of fewer keys": torch.ones(2, 1, 19, 18, dtype=torch.bool),
             "float 2-d": torch.ones(2, 19), "ids of fewer tokens": torch.zeros(2, 18, dtype=torch.int64),
             "ids with fewer queries": torch.zeros(2, 19, dtype=torch.int64)}
    if mask == "ids with fewer queries":
        q = q[:, :, -3:]
    with pytest.raises(ValueError, match="attention_mask"):
        tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, masks[mask].to(device))


def test_a_4d_mask_longer_than_the_keys_is_cut_as_transformers_cuts_it(device, _fresh_warnings):
    q, k, v = _qkv(device)
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(2, 1, 19, 23, generator=gen) > 0.4).to(device)
    mask[..., 0] = True
    with pytest.warns(RuntimeWarning, match="a mask that is not causal"):
        out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, mask)
    assert _rel(out, _dense_reference(q, k, v, mask[..., :19])) < 1e-5


@pytest.mark.parametrize("keys", [19, 0], ids=["keys past the mask", "no key"])
def test_a_mask_of_no_key_gives_zeros(keys, device):
    q, k, v = _qkv(device)
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k[:, :, :keys], v[:, :, :keys],
                                          torch.ones(2, 0, dtype=torch.bool, device=device))
    assert out.shape == (2, 19, 4, 16) and not out.any()


@pytest.mark.parametrize("keys", [19, 0], ids=["keys past the mask", "no key"])
def test_a_mask_of_no_key_differentiates_to_zeros(keys, device):
    """Zeros without a grad_fn would leave the projections before attention with no gradient (None, which an
    optimizer skips, where it is zero)."""
    leaves = [t[:, :, :keys].requires_grad_() if i else t.requires_grad_() for i, t in enumerate(_qkv(device))]
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), *leaves,
                                          torch.ones(2, 0, dtype=torch.bool, device=device))
    assert out.grad_fn is not None and out.shape == (2, 19, 4, 16) and not out.any()
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert all(g is not None and not g.any() for g in grads)


def test_is_causal_from_a_property_of_the_class(device):
    class Encoder(torch.nn.Module):
        @property
        def is_causal(self):
            return False

    q, k, v = _qkv(device)
    out, _ = tilegen_hf.attention_forward(Encoder(), q, k, v, None)
    full = torch.ones(1, 1, 19, 19, dtype=torch.bool, device=device)
    assert _rel(out, _dense_reference(q, k, v, full)) < 1e-5


@pytest.mark.parametrize("keys", [19, 23], ids=["keys of the mask", "a static cache's keys past it"])
def test_a_causal_call_with_more_queries_than_the_masks_keys(keys, device):
    """Queries before the first key see none: their rows are zeros, the others as without the mask's cut."""
    q, _, _ = _qkv(device, n=25, seed=4)
    _, k, v = _qkv(device, n=keys, seed=5)
    padding = torch.ones(2, 19, dtype=torch.bool, device=device)
    padding[0, :4] = False  # left padding
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, padding)
    k, v = k[:, :, :19], v[:, :, :19]
    allowed = _causal(25, 19, device) & padding[:, None, None, :]
    assert _rel(out, _dense_reference(q, k, v, allowed)) < 1e-5 and not out[:, :6].any()


def test_what_nothing_can_serve_is_refused_by_name(device, _fresh_warnings):
    q, k, v = _qkv(device)
    # softcap and attention sinks fall back to the model's own eager attention; a module without one has none.
    module = types.SimpleNamespace(is_causal=True)
    with pytest.raises(NotImplementedError, match="s_aux.*eager_attention_forward"):
        tilegen_hf.attention_forward(module, q, k, v, None, s_aux=torch.zeros(4, device=device))
    mask = torch.ones(2, 1, 19, 19, dtype=torch.bool, device=device)
    with pytest.raises(NotImplementedError, match="eager_attention_forward"):
        tilegen_hf.attention_forward(module, q, k, v, mask, softcap=2.0)


@pytest.mark.parametrize("mask", ["left padding", "holes", "decoding step", "no padding", "packed"])
@pytest.mark.parametrize("wrong", ["key", "value", "attention_mask"])
def test_a_batch_that_disagrees_with_the_masks_is_refused_by_name(wrong, mask, device):
    """Every path a mask leads to: a tensor whose batch disagrees is named, whichever check finds it (value's is the
    op's where the call reaches one)."""
    q, k, v = _qkv(device)
    if mask == "packed":
        attention_mask = torch.tensor([[0] * 7 + [1] * 12, [0] * 19], device=device)
    else:
        attention_mask = torch.ones(2, 19, dtype=torch.bool, device=device)
        attention_mask[0, :3] = mask == "no padding"
        attention_mask[1, 5:8] = mask != "holes"
    if mask == "decoding step":
        q = q[:, :, -1:]
    args = {"key": k, "value": v, "attention_mask": attention_mask}
    args[wrong] = args[wrong][:1]
    message = f"{wrong} has a batch of 1, query of 2"
    if wrong == "value" and mask in ("left padding", "packed"):
        message = r"v: a batch of 1, q has 2"  # varlen_attention_padded's own check
    elif wrong == "value" and mask == "no padding":
        message = r"k, v: batch sizes 2, 1 differ from q's 2"  # tilegen.attention's
    with pytest.raises(ValueError, match=message):
        tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, args["key"], args["value"],
                                     args["attention_mask"])


def test_a_mask_changed_in_place_gets_a_new_layout(device):
    padding = torch.ones(2, 9, dtype=torch.bool, device=device)
    padding[0, :2] = False
    first = tilegen_hf._layout(padding, 9, 9, True, tilegen_hf._padding_layout)
    assert tilegen_hf._layout(padding, 9, 9, True, tilegen_hf._padding_layout) is first
    padding[1, :5] = False
    second = tilegen_hf._layout(padding, 9, 9, True, tilegen_hf._padding_layout)
    # [padding, no keys], [no queries, padding], [row 0's tokens], ... in place of the packed [0, 7, 11]
    assert second is not first and second.cu_q.tolist() == [0, 2, 2, 9, 14, 14, 18, 18, 18]
    assert second.cu_k.tolist() == [0, 0, 2, 9, 9, 14, 18, 18, 18] and (second.max_q, second.max_k) == (7, 7)


def test_register_without_transformers_says_what_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # an import of it fails
    with pytest.raises(ImportError, match="needs transformers"):
        tilegen_hf.register()


def test_importing_tilegen_does_not_import_transformers():
    code = "import sys, tilegen, tilegen.integrations.transformers; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})


@pytest.mark.parametrize("dense", [False, True], ids=["2d", "4d"])
def test_a_mask_laid_out_under_inference_mode_serves_a_training_call(dense, device):
    """An evaluation under torch.inference_mode, then a training step on the same mask object: the layout the first
    made must be of normal tensors, which the second's backward can save (inference tensors it cannot)."""
    q, k, v = _qkv(device, n=7, seed=15)
    padding = torch.ones(2, 7, dtype=torch.bool, device=device)
    padding[0, :2] = False
    allowed = _causal(7, 7, device) & padding[:, None, None, :]
    mask = allowed if dense else padding
    module = types.SimpleNamespace(is_causal=True)
    with torch.inference_mode():
        tilegen_hf.attention_forward(module, q, k, v, mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = tilegen_hf.attention_forward(module, *leaves, mask)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(16)).to(device)
    grads = torch.autograd.grad(out, leaves, dout.masked_fill(~padding[:, :, None, None], 0.0))
    refs = [t.detach().double().requires_grad_() for t in leaves]
    want = torch.autograd.grad(_dense_reference(*refs, allowed), refs,
                               dout.double().masked_fill(~padding[:, :, None, None], 0.0))
    for name, got, expected in zip("qkv", grads, want):
        assert _rel(got, expected) < 1e-4, name


def test_a_mask_that_outlives_the_modules_globals_drops_its_layout_quietly(device, monkeypatch):
    """At interpreter exit the module's globals are set to None before the last masks die (a 4-d mask's entry holds
    the padding mask of another): their entries' callbacks must not look the cache up by its global name."""
    padding = torch.ones(2, 7, dtype=torch.bool, device=device)
    padding[0, :2] = False
    key = (id(padding), 7, 7, True, tilegen_hf._padding_layout)
    tilegen_hf._layout(padding, 7, 7, True, tilegen_hf._padding_layout)
    layouts = tilegen_hf._layouts
    assert key in layouts
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(tilegen_hf, "_layouts", None)
    del padding
    gc.collect()
    assert not unraisable, unraisable[0].exc_value
    assert key not in layouts
