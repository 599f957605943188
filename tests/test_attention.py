"""Correctness of ``tilegen.attention`` against the float64 reference.

Without a GPU every kernel runs under Triton's CPU interpreter, which is slow: shapes
keep batch * heads small, and only a few cases reach 1000 rows. On a GPU the same
tests run on CUDA (the ``device`` fixture).

Causal attention with a query much shorter than a tile (decoding-like) once skipped
keys; ``test_causal_short_query`` keeps that case covered for every block size.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings

import pytest
import torch
from helpers import (
    LAYOUTS,
    Case,
    attention_calls,
    check_against_reference,
    nan_outputs,
    param,
    poisoned_like_out,
    run_public,
    tuned_row_in_a_fresh_db,
)
from hypothesis import HealthCheck, given, settings

import tilegen
import tilegen.ops.attention as attention_module
from tilegen import dispatch
from tilegen.device import device_info
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import Config
from tilegen.ops.attention import prepare_call, run_with_config

# --------------------------------------------------------------------------- the public op

REFERENCE_CASES = [
    # dtypes
    param(Case(128, dtype="fp16")),
    param(Case(128, dtype="bf16")),
    param(Case(128, dtype="fp32")),
    # head dims: power-of-two, padded (96 -> 128, 40 -> 64), and a V head dim of its own
    param(Case(128, head_dim=128, dtype="bf16", causal=True)),
    param(Case(97, head_dim=96, dtype="fp16")),
    param(Case(70, head_dim=40, dtype="fp32", causal=True)),
    param(Case(65, head_dim=64, head_dim_v=128, dtype="bf16")),
    param(Case(65, head_dim=64, head_dim_v=32, dtype="fp16", window=(8, 8))),
    param(Case(33, head_dim=40, head_dim_v=96, dtype="fp32", causal=True)),
    # sequence lengths that are not block multiples
    param(Case(1, dtype="fp16")),
    param(Case(1, dtype="bf16", causal=True)),
    param(Case(17, dtype="bf16", causal=True)),
    param(Case(257, dtype="fp16", causal=True)),
    param(Case(257, dtype="bf16", window=(64, 16))),
    param(Case(1000, dtype="bf16", causal=True, heads_q=1, heads_kv=1)),
    # n_q != n_k: causal is bottom-right aligned; with n_q > n_k the first rows see nothing
    param(Case(17, 257, dtype="fp16", causal=True)),
    param(Case(1, 257, dtype="bf16", causal=True, tags=("decode",))),
    param(Case(257, 17, dtype="fp32", causal=True)),
    param(Case(40, 1000, dtype="fp16", causal=True, heads_q=2, heads_kv=1)),
    param(Case(100, 40, dtype="fp16", window=(5, 3))),
    param(Case(33, 100, dtype="fp32")),
    # GQA ratios 1 (above), 4 and 8, and MQA (one KV head)
    param(Case(65, heads_q=4, heads_kv=1, dtype="fp16", tags=("mqa",))),
    param(Case(65, heads_q=8, heads_kv=1, dtype="bf16", causal=True, tags=("mqa",))),
    param(Case(65, heads_q=8, heads_kv=2, batch=2, dtype="fp16", causal=True)),
    param(Case(48, heads_q=8, heads_kv=1, dtype="fp32", window=(4, None))),
    # windows: left only, right only, both, the diagonal alone, sliding causal,
    # (None, 0) which is causal, and windows where some rows see no key
    param(Case(130, dtype="fp16", window=(16, None))),
    param(Case(130, dtype="bf16", window=(None, 16))),
    param(Case(130, dtype="fp32", window=(10, 20))),
    param(Case(70, dtype="fp16", window=(0, 0))),
    param(Case(130, dtype="bf16", causal=True, window=(8, None))),
    param(Case(50, dtype="fp32", window=(None, 0))),
    param(Case(60, 20, dtype="fp16", window=(2, 0))),
    param(Case(20, 100, dtype="fp32", window=(0, None))),
    param(Case(45, 90, dtype="bf16", window=(3, 1), heads_q=4, heads_kv=2)),
    # softcap (scale 1 makes the logits large enough for the cap to bind), custom scales
    param(Case(80, dtype="fp16", softcap=5.0, scale=1.0)),
    param(Case(80, dtype="bf16", softcap=2.0, causal=True, heads_q=4, heads_kv=1)),
    param(Case(80, dtype="fp32", softcap=30.0, window=(20, 5), head_dim=40)),
    param(Case(64, dtype="fp32", scale=0.5)),
    param(Case(64, dtype="fp16", scale=0.0, causal=True)),
    # batch > 1 with its own strides
    param(Case(50, batch=3, dtype="fp32")),
]


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_matches_reference(request, case, device):
    (q, k, v), (out, lse) = run_public(request, case, device)
    check_against_reference(out, lse, q, k, v, **case.mask_kwargs())


@pytest.mark.parametrize(
    "case",
    [
        param(Case(40, 70, dtype="fp16", causal=True)),
        param(Case(33, dtype="bf16", window=(4, 9), head_dim=40)),
        param(Case(20, dtype="fp32", head_dim_v=32)),
    ],
)
def test_without_lse_returns_the_same_output(request, case, device):
    (q, k, v), (out_lse, lse) = run_public(request, case, device)
    out = tilegen.attention(q, k, v, **case.mask_kwargs())
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, out_lse)
    check_against_reference(out, None, q, k, v, **case.mask_kwargs())


@pytest.mark.parametrize(
    "case",
    [
        param(Case(60, 20, dtype="fp32", causal=True)),
        param(Case(30, 10, dtype="fp32", window=(0, 0))),
        param(Case(50, 30, dtype="fp16", window=(2, 1))),
    ],
)
def test_rows_that_see_no_key_give_zero_and_neg_inf(request, case, device):
    (q, k, v), (out, lse) = run_public(request, case, device)
    shift = case.n_q - case.nk  # query row i sits at key i - shift
    right = 0 if case.causal else case.window[1]
    empty = shift - right  # rows before this one end left of key 0
    assert empty > 0
    assert torch.isneginf(lse[:, :, :empty]).all()
    assert (out[:, :, :empty] == 0).all()
    assert torch.isfinite(lse[:, :, empty:]).all()
    if case.window == (0, 0):
        # Each remaining row sees exactly its diagonal key: its output is that key's value row.
        torch.testing.assert_close(out[:, :, empty:], v[:, :, empty - shift :], rtol=1e-6, atol=1e-6)
    check_against_reference(out, lse, q, k, v, **case.mask_kwargs())


# ------------------------------------------------------------------ explicit configs, poisoned output

CONFIG_SHAPES = [
    pytest.param(Case(70, 90, dtype="fp16", heads_q=2, heads_kv=1, window=(5, 9)), id="win5-9-nq70-nk90-gqa2"),
    pytest.param(Case(90, 70, dtype="bf16", head_dim=40, window=(40, 0)), id="sliding-causal-nq90-nk70-d40"),
    pytest.param(Case(50, 130, dtype="fp32", head_dim_v=32, causal=True), id="causal-nq50-nk130-dv32"),
    pytest.param(Case(77, dtype="fp16", window=(None, 7)), id="right-only-n77"),
    pytest.param(Case(100, 45, dtype="fp32", head_dim_v=96), id="nomask-nq100-nk45-dv96"),
]
BLOCKS = [(16, 16), (16, 64), (32, 16), (64, 32), (64, 64)]


@pytest.mark.parametrize("block_m,block_n", BLOCKS, ids=[f"bm{m}-bn{n}" for m, n in BLOCKS])
@pytest.mark.parametrize("case", CONFIG_SHAPES)
def test_explicit_config_writes_every_element(request, case, block_m, block_n, device):
    """Every block size, with key ranges that start and end inside blocks, into a NaN-filled output."""
    q, k, v = case.inputs(device)
    spec, left, right, scale, softcap = prepare_call(q, k, v, case.causal, case.window, case.softcap, case.scale, True)
    config = Config(block_m, block_n, 4, 1)
    poisoned = poisoned_like_out(q, v)
    out, lse = run_with_config(spec, config, q, k, v, scale, softcap, left, right, out=poisoned)
    assert out is poisoned
    assert not torch.isnan(poisoned).any(), f"{torch.isnan(poisoned).sum().item()} output elements never written"
    check_against_reference(out, lse, q, k, v, **case.mask_kwargs())


@pytest.mark.parametrize("block_m", [16, 32, 64], ids=lambda m: f"bm{m}")
@pytest.mark.parametrize("n_q,n_k", [(1, 1), (1, 40), (5, 70), (15, 15), (31, 90), (32, 90)], ids=lambda n: str(n))
def test_causal_short_query(request, n_q, n_k, block_m, device):
    """Causal with few query rows (decoding), where a tile is mostly padding rows."""
    case = Case(n_q, n_k, dtype="fp32", head_dim=32, heads_q=2, heads_kv=1, causal=True)
    q, k, v = case.inputs(device)
    spec, left, right, scale, softcap = prepare_call(q, k, v, True, None, None, None, True)
    assert spec.mask == "causal"
    out, lse = run_with_config(spec, Config(block_m, 16, 4, 1), q, k, v, scale, softcap, left, right)
    check_against_reference(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize(
    "case",
    [
        param(Case(70, 90, dtype="fp16", causal=True, heads_q=4, heads_kv=2)),
        param(Case(45, 20, dtype="bf16", window=(3, 0), head_dim=40, head_dim_v=96)),
        param(Case(33, dtype="fp32", softcap=4.0)),
        param(Case(1, 1, dtype="fp16")),
    ],
)
def test_public_op_writes_every_element(request, monkeypatch, case, device):
    """Through ``tilegen.attention``: the buffers it allocates are NaN when its kernel starts."""
    buffers = []
    real_plan = attention_module._plan

    def plan_poisoning(*args):
        plan = real_plan(*args)

        def launch(key, q, k, v, out, lse):
            buffers.append(out.fill_(math.nan))
            lse.fill_(math.nan)
            return plan.launch(key, q, k, v, out, lse)

        return dataclasses.replace(plan, launch=launch)

    monkeypatch.setattr(attention_module, "_plan", plan_poisoning)
    attention_module._plans.clear()  # no plan of an earlier test may be reused
    (q, k, v), (out, lse) = run_public(request, case, device)
    assert len(buffers) == 1 and out is buffers[0], "the op did not launch into the buffer it returned"
    assert not torch.isnan(out).any(), f"{torch.isnan(out).sum().item()} output elements never written"
    check_against_reference(out, lse, q, k, v, **case.mask_kwargs())


@pytest.mark.parametrize("n_q, n_k, kwargs", [
    (70, 90, {"causal": True}),  # the dense kernel, GQA, a separate V dim
    (3, 33, {"window": (5, 0), "softcap": 20.0}),  # the decode route
    (0, 9, {}),
])
def test_seq_major_output_is_written_in_place_of_every_element(device, monkeypatch, n_q, n_k, kwargs):
    """attention_seq_major: a contiguous [batch, n_q, heads, dv] output, every element written (the buffer is
    NaN when the kernel starts), equal to the op's output transposed; the second call takes the cached plan."""
    case = Case(n_q, n_k, dtype="bf16", head_dim=64, head_dim_v=32, heads_q=4, heads_kv=2, batch=2)
    q, k, v = case.inputs(device)
    nan_outputs(monkeypatch)
    for _ in range(2):
        out = attention_module.attention_seq_major(q, k, v, **kwargs)
        assert out.shape == (2, n_q, 4, 32) and out.is_contiguous()
        monkeypatch.undo()
        want = tilegen.attention(q, k, v, **kwargs).transpose(1, 2)
        nan_outputs(monkeypatch)
        assert not torch.isnan(out).any() and torch.equal(out, want)


@pytest.mark.parametrize("layout", ["contiguous", "bnhd"])
def test_out_argument_is_written_and_returned(device, layout):
    case = Case(70, 90, dtype="bf16", causal=True, head_dim=64, head_dim_v=32, heads_q=4, heads_kv=2)
    q, k, v = case.inputs(device)
    out = poisoned_like_out(q, v)
    if layout == "bnhd":
        out = torch.full((1, 70, 4, 32), math.nan, device=device, dtype=q.dtype).transpose(1, 2)
    for _ in range(2):  # the second call takes the checked-call fast path
        result, lse = tilegen.attention(q, k, v, causal=True, return_lse=True, out=out)
        assert result is out
        check_against_reference(out, lse, q, k, v, causal=True)
        out.fill_(math.nan)


def test_a_repeated_call_reuses_its_plan_until_the_tables_are_reset(device):
    q, k, v = Case(20, dtype="fp32").inputs(device)
    attention_module._plans.clear()
    first = tilegen.attention(q, k, v, window=[3, None])  # a list works as the tuple does
    (plan,) = attention_module._plans.values()
    torch.testing.assert_close(tilegen.attention(q, k, v, window=[3, None]), first, rtol=0, atol=0)
    assert list(attention_module._plans.values()) == [plan]
    table = dispatch.table_for(plan_spec(q, k, v), device_info(q.device.index))
    dispatch.reset()  # forgets plans and tables together: no plan outlives the table it was made from
    assert not attention_module._plans
    tilegen.attention(q, k, v, window=[3, None])
    (fresh,) = attention_module._plans.values()
    assert fresh is not plan and dispatch.table_for(plan_spec(q, k, v), device_info(q.device.index)) is not table


def plan_spec(q, k, v):
    return prepare_call(q, k, v, False, [3, None], None, None, False)[0]


@pytest.mark.parametrize(
    "window,equivalent",
    [
        pytest.param((sys.maxsize, 0), (None, 0), id="left-maxsize"),
        pytest.param((2**40, 2**40), (None, None), id="both-2e40"),
        pytest.param((3, sys.maxsize), (3, None), id="right-maxsize"),
        pytest.param((10**30, 2), (None, 2), id="left-1e30"),
    ],
)
def test_window_sides_past_the_sequence_act_as_unbounded(window, equivalent, device):
    case = Case(40, 50, dtype="fp32", head_dim=32)
    q, k, v = case.inputs(device)
    try:
        out, lse = tilegen.attention(q, k, v, window=window, return_lse=True)
    except ValueError as e:  # refusing the value, naming the argument, would do too
        assert str(e).startswith("window:"), str(e)
        return
    # The reference is given the equivalent bounded form (its own arithmetic is int64 too).
    check_against_reference(out, lse, q, k, v, window=equivalent)


def test_empty_inputs(device):
    q = torch.randn(1, 2, 0, 64, device=device, dtype=torch.float16)
    k = torch.randn(1, 2, 5, 64, device=device, dtype=torch.float16)
    out, lse = tilegen.attention(q, k, k, causal=True, return_lse=True)
    assert out.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)
    q = torch.randn(0, 2, 8, 64, device=device, dtype=torch.float16)
    out = tilegen.attention(q, q, q)
    assert out.shape == (0, 2, 8, 64)


def test_no_keys_at_all(device):
    """n_k == 0: every row sees no key, so zeros and -inf (not NaN)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 20, 32, generator=gen).to(device)
    k = torch.randn(1, 2, 0, 32, generator=gen).to(device)
    out, lse = tilegen.attention(q, k, k, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


# ------------------------------------------------------------------------------ layouts

@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "contiguous"])
@pytest.mark.parametrize(
    "base",
    [
        pytest.param(Case(70, 90, dtype="fp16", causal=True, heads_q=4, heads_kv=2), id="causal-gqa2-fp16"),
        pytest.param(Case(50, dtype="fp32", window=(6, 2), head_dim=40), id="window-d40-fp32"),
    ],
)
def test_non_contiguous_inputs(request, base, layout, device):
    case = dataclasses.replace(base, layout=layout)
    q, k, v = case.inputs(device)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    before = [t.clone() for t in (q, k, v)]
    out, lse = tilegen.attention(q, k, v, return_lse=True, **case.mask_kwargs())
    check_against_reference(out, lse, q, k, v, **case.mask_kwargs())
    for t, saved in zip((q, k, v), before):
        assert torch.equal(t, saved), "the op wrote into an input"
    # Same values, contiguous: same result (the layout changes addressing only).
    out_c, lse_c = tilegen.attention(q.contiguous(), k.contiguous(), v.contiguous(), return_lse=True,
                                     **case.mask_kwargs())
    torch.testing.assert_close(out, out_c, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_c, rtol=0, atol=0)


def test_mixed_layouts_and_broadcast_kv_heads(device):
    """q as [b, n, h, d] transposed, K broadcast over KV heads (stride 0), V with a strided head dim."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 41, 4, 64, generator=gen).to(device, torch.float16).transpose(1, 2)
    k = torch.randn(1, 1, 57, 64, generator=gen).to(device, torch.float16).expand(1, 2, 57, 64)
    v = torch.randn(1, 2, 48, 57, generator=gen).to(device, torch.float16).transpose(2, 3)
    assert k.stride(1) == 0
    out, lse = tilegen.attention(q, k, v, window=(12, 4), return_lse=True)
    check_against_reference(out, lse, q, k, v, window=(12, 4))
    assert out.is_contiguous()  # head_dim_v 48 against q's 64: a new contiguous tensor
    # With head_dim_v == head_dim the output has q's shape and is laid out as q (torch.empty_like),
    # for prefill and for one query row (the decode route).
    v = torch.randn(1, 2, 57, 64, generator=gen).to(device, torch.float16)
    for query in (q, q[:, :, -1:]):
        out, lse = tilegen.attention(query, k, v, return_lse=True)
        check_against_reference(out, lse, query, k, v)
        assert out.stride() == query.stride()


# -------------------------------------------------------------------------------- n = 1000

def test_long_sequence_window_gqa_with_explicit_config(device):
    """1000 rows and keys, sliding window with GQA, 64x64 blocks (the interpreter's fastest)."""
    case = Case(1000, dtype="fp16", heads_q=2, heads_kv=1, window=(200, 50), head_dim=64)
    q, k, v = case.inputs(device)
    spec, left, right, scale, softcap = prepare_call(q, k, v, False, (200, 50), None, None, True)
    poisoned = poisoned_like_out(q, v)
    out, lse = run_with_config(spec, Config(64, 64, 4, 1), q, k, v, scale, softcap, left, right, out=poisoned)
    assert not torch.isnan(poisoned).any()
    check_against_reference(out, lse, q, k, v, window=(200, 50))


# ------------------------------------------------------------------------------ property test

@settings(
    max_examples=25,
    deadline=None,
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=attention_calls())
def test_property_matches_reference(case, device):
    q, k, v = case.inputs(device)
    kwargs = case.mask_kwargs()
    out, lse = tilegen.attention(q, k, v, return_lse=True, **kwargs)
    check_against_reference(out, lse, q, k, v, **kwargs)


# ----------------------------------------------------------------------------- dispatch

def test_explain_names_the_config_the_call_runs(device):
    q = torch.randn(1, 4, 100, 64, device=device, dtype=torch.float16)
    k = torch.randn(1, 2, 300, 64, device=device, dtype=torch.float16)
    choice = tilegen.explain(q, k, k, causal=True)
    assert choice.bucket == ATTENTION_FWD.buckets.of(300) == 512
    spec, *_ = prepare_call(q, k, k, True, None, None, None, False)
    assert ATTENTION_FWD.feasible(spec, choice.config, device_info()) is None
    assert choice.source == "default" or choice.tuned_bucket is not None


def test_explain_of_a_training_call_names_the_forward_that_keeps_the_lse(device, tmp_path, monkeypatch):
    """A call whose inputs require grad runs the variant that writes the LSE for its backward; its rows are that
    variant's, and explain names the config the call runs."""
    q, k, v = (torch.randn(1, 2, 40, 32, device=device) for _ in range(3))
    spec = prepare_call(q, k, v, True, None, None, None, True)[0]
    default, tuned = tuned_row_in_a_fresh_db(tmp_path, monkeypatch, ATTENTION_FWD, spec, 40)
    assert tilegen.explain(q, k, v, causal=True).config == default
    assert tilegen.explain(q, k, v, causal=True, return_lse=True).config == tuned
    leaves = [t.requires_grad_() for t in (q, k, v)]
    assert tilegen.explain(*leaves, causal=True).config == tuned
    with torch.no_grad():
        assert tilegen.explain(*leaves, causal=True).config == default


# ------------------------------------------------------------------------------ torch.compile

def _compile_args(device, return_lse):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 33, 64, generator=gen).to(device, torch.float16)
    k = torch.randn(1, 2, 45, 64, generator=gen).to(device, torch.float16)
    v = torch.randn(1, 2, 45, 32, generator=gen).to(device, torch.float16)
    spec, left, right, scale, softcap = prepare_call(q, k, v, True, None, None, None, return_lse)
    return q, k, v, spec, (spec.dv, spec.mask, spec.softcap, spec.return_lse, scale, softcap, left, right)


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
def test_fake_impl_gives_real_shapes(device, return_lse):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, spec, rest = _compile_args(device, return_lse)
    real_out, real_lse = torch.ops.tilegen.attention_fwd(q, k, v, *rest)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake_out, fake_lse = torch.ops.tilegen.attention_fwd(fq, fk, fv, *rest)
    for fake, real in ((fake_out, real_out), (fake_lse, real_lse)):
        assert fake.shape == real.shape and fake.dtype == real.dtype and fake.device == real.device
    assert real_out.shape == (1, 4, 33, 32)
    assert real_lse.shape == ((1, 4, 33) if return_lse else (0,))


def _varlen_of(q, k, v, **kwargs):
    """``tilegen.varlen_attention`` over [batch, heads, n, dim] inputs as one packed sequence a batch element."""
    rows = [t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (q, k, v)]
    batch, n_q, n_k = q.shape[0], q.shape[2], k.shape[2]
    cu_q = torch.arange(0, batch * n_q + 1, n_q, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, batch * n_k + 1, n_k, dtype=torch.int32, device=q.device)
    return tilegen.varlen_attention(*rows, cu_q, cu_k, n_q, n_k, **kwargs)


@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_fake_tensor_mode_gives_the_eager_shapes_without_grad_too(api, device):
    """Under a FakeTensorMode (shape propagation, memory estimates) a call that does not train takes the custom op's
    fake implementation, as a call that trains does: it launched on the fakes, which have no storage."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    q, k, v, _, _ = _compile_args(device, True)
    call = tilegen.attention if api == "dense" else _varlen_of
    want = call(q, k, v, causal=True, return_lse=True)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (q, k, v)]
        got = call(*fakes, causal=True, return_lse=True)
        with torch.no_grad():
            assert [t.shape for t in call(*fakes, causal=True, return_lse=True)] == [t.shape for t in got]
    for g, w in zip(got, want):
        assert isinstance(g, FakeTensor) and (g.shape, g.dtype, g.device) == (w.shape, w.dtype, w.device)


@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_vmap_runs_each_sample_as_a_call_of_its_own(api, device):
    """torch.func.vmap over a call: the custom op, which torch runs sample by sample (the kernels had been launched
    on the batched wrappers, which have no storage). Mods cannot take that route: refused by name."""
    q, k, v, _, _ = _compile_args(device, True)
    call = tilegen.attention if api == "dense" else _varlen_of
    stacked = [torch.stack([t, t.flip(2)]) for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "no batching rule, performance drop"
        out, lse = torch.func.vmap(lambda q, k, v: call(q, k, v, causal=True, return_lse=True))(*stacked)
    for i in range(2):
        want = call(*(t[i] for t in stacked), causal=True, return_lse=True)
        assert torch.equal(out[i], want[0]) and torch.equal(lse[i], want[1])
    from tilegen.mods import library

    alibi = library.alibi(torch.ones(q.shape[1], device=device))
    with pytest.raises(NotImplementedError, match=r"score_mod/mask_mod under a torch\.func transform"):
        torch.func.vmap(lambda q, k, v: call(q, k, v, score_mod=alibi))(*stacked)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autocast_runs_in_its_dtype_as_sdpa_does(compiled, device):
    """A drop-in for SDPA in an autocast region: fp32 (or mixed) inputs run in the region's dtype and the result comes
    out in it, as SDPA's does; an fp32 leaf gets an fp32 gradient through the cast. It ignored autocast (an fp32
    result) and refused the mixed dtypes an autocast projection hands it (a bf16 q beside fp32 k and v)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen).to(device).requires_grad_() for _ in range(3))
    call = tilegen.attention
    if compiled:
        torch._dynamo.reset()
        call = torch.compile(tilegen.attention, fullgraph=True, backend="aot_eager")
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast(torch.device(device).type, dtype=dtype):
            for inputs in ((q, k, v), (q.to(dtype), k, v)):
                want = F.scaled_dot_product_attention(*inputs, is_causal=True)
                got = call(*inputs, causal=True)
                assert got.dtype == want.dtype == dtype
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    (grad,) = torch.autograd.grad(got.float().sum(), v)
    assert grad.dtype == torch.float32 and grad.abs().max() > 0



def test_explain_in_an_autocast_region_shows_the_cast_call(device, monkeypatch):
    """explain casts as the call does: in a bf16 region fp32 inputs run the bf16 spec's row, which explain showed the
    fp32 spec's choice for."""
    q = torch.randn(1, 2, 24, 16, device=device)
    spec = prepare_call(q.bfloat16(), q.bfloat16(), q.bfloat16(), True, None, None, None, False)[0]
    info = device_info(q.device)
    row = Config(block_m=16, block_n=16, num_warps=2, num_stages=1)
    monkeypatch.setitem(dispatch._tables, (spec, info), dispatch.Table(spec, info, {32: (row, "tuned.sqlite")}))
    assert tilegen.explain(q, q, q, causal=True).config != row
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        assert tilegen.explain(q, q, q, causal=True).config == row


@pytest.mark.parametrize("mods", [False, True], ids=["plain", "score-mod"])
@pytest.mark.parametrize("dim_v", [16, 24])
def test_the_output_is_laid_out_as_q_on_every_route(dim_v, mods, device):
    """The output takes q's memory layout when it has q's shape (empty_like(q)), contiguous otherwise, in eager calls
    with and without grad and compiled: the op's output was always contiguous, so `out.transpose(1, 2).view(b, n, -1)`
    on a [batch, seq, heads, dim] q worked in eager inference and failed in training and under torch.compile."""
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(2, 9, 4, 16, generator=gen).to(device).transpose(1, 2)  # a projection's heads: [b, h, n, d]
    k = torch.randn(2, 9, 2, 16, generator=gen).to(device).transpose(1, 2)
    v = torch.randn(2, 9, 2, dim_v, generator=gen).to(device).transpose(1, 2)
    want = torch.empty_like(q).stride() if dim_v == 16 else (4 * 9 * dim_v, 9 * dim_v, dim_v, 1)
    score_mod = None
    if mods:
        from tilegen.mods import library

        score_mod = library.alibi(torch.tensor([0.5, 0.25, 0.125, 1.0], device=device))

    def merged(q, k, v):
        out, lse = tilegen.attention(q, k, v, causal=True, return_lse=True, score_mod=score_mod)
        assert out.stride() == want and lse.is_contiguous()
        return out.transpose(1, 2).reshape(2, 9, -1) if dim_v != 16 else out.transpose(1, 2).view(2, 9, -1)

    expected = merged(q, k, v)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.testing.assert_close(merged(*leaves), expected, rtol=0, atol=0)
    from tilegen.mods import compiled as mods_compiled

    if mods and not mods_compiled.compiles_mods():
        return  # compiled calls with mods are refused by name before torch 2.13 (test_mods.py)
    torch._dynamo.reset()
    for inputs in ((q, k, v), leaves):
        got = torch.compile(merged, fullgraph=True, backend="aot_eager")(*inputs)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    got.sum().backward()
    assert all(t.grad is not None and t.grad.stride() == t.stride() for t in leaves)


def test_custom_op_passes_opcheck(device):
    q, k, v, _, rest = _compile_args(device, True)
    torch.library.opcheck(torch.ops.tilegen.attention_fwd.default, (q, k, v, *rest))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_fullgraph(device, backend):
    q, k, v, _, _ = _compile_args(device, True)

    def f(q, k, v):
        out, lse = tilegen.attention(q, k, v, causal=True, return_lse=True)
        return out * 2, lse

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out2, lse = compiled(q, k, v)
    check_against_reference(out2 / 2, lse, q, k, v, causal=True)
    # Dynamo traces the spec builder without the cache it warns about.
    assert not [w for w in caught if "lru_cache" in str(w.message)]


def test_torch_compile_dynamic_takes_a_scale_computed_from_a_size(device):
    """With dynamic=True, q.shape[-1] ** -0.5 is a symbolic float: the argument check compares it (math.isfinite
    broke the graph), and the kernel gets its value."""
    q, k, v, _, _ = _compile_args(device, False)
    for scale_of in (lambda q: q.shape[-1] ** -0.5, lambda q: 2.0 / q.shape[-1]):
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v: tilegen.attention(q, k, v, causal=True, scale=scale_of(q)),
                                 fullgraph=True, dynamic=True, backend="eager")
        check_against_reference(compiled(q, k, v), None, q, k, v, causal=True, scale=scale_of(q))


@pytest.mark.parametrize("n_q", [1, 3])
def test_torch_compile_runs_short_queries_on_the_decode_kernel(device, n_q):
    from tilegen.families.attention_decode import DecodeConfig
    from tilegen.ops import attention as attention_op

    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, n_q, 64, generator=gen).to(device, torch.float16)
    k = torch.randn(2, 2, 45, 64, generator=gen).to(device, torch.float16)
    v = torch.randn(2, 2, 45, 64, generator=gen).to(device, torch.float16)

    def f(q, k, v):
        return tilegen.attention(q, k, v, causal=True, return_lse=True)

    torch._dynamo.reset()
    attention_op._op_plans.clear()
    out, lse = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    check_against_reference(out, lse, q, k, v, causal=True)
    # The compiled graph took the same route as an eager call: the decode family's kernel.
    assert [type(plan.choice.config) for plan in attention_op._op_plans.values()] == [DecodeConfig]
    assert type(tilegen.explain(q, k, v, causal=True, return_lse=True).config) is DecodeConfig


def test_scale_default_is_inverse_sqrt_head_dim(device):
    case = Case(40, dtype="fp32", head_dim=40)
    q, k, v = case.inputs(device)
    default = tilegen.attention(q, k, v)
    explicit = tilegen.attention(q, k, v, scale=1.0 / math.sqrt(40))
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    other = tilegen.attention(q, k, v, scale=0.05)
    assert not torch.allclose(default, other, rtol=1e-3, atol=1e-3)
