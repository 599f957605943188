"""Gradients of ``tilegen.attention`` and ``tilegen.varlen_attention`` against the float64 reference.

Errors are relative Frobenius norms ``||g - ref|| / ||ref||`` of each of dQ, dK and dV against
``attention_backward_reference`` run on the same rounded inputs: below 1e-4 for fp32 and 1e-2 for
bf16/fp16 (P and dS are rounded to the input dtype before their products). Under Triton's CPU
interpreter every launch is slow, so shapes are small and only a couple reach 257 rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, Case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegen
from tilegen.codegen import module_for
from tilegen.device import CPU_INTERPRETER, DeviceInfo, device_info
from tilegen.families import family_of
from tilegen.families.attention_bwd import AttentionBwdSpec, Config
from tilegen.families.attention_bwd.config import deterministic as deterministic_config
from tilegen.families.attention_bwd.config import feasible
from tilegen.families.attention_bwd.reference import attention_backward_reference
from tilegen.families.attention_fwd.masks import launch_window
from tilegen.families.attention_fwd.reference import attention_reference

GRAD_REL_TOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-4}


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error. NaN never passes. A zero reference (dQ with one key: the softmax is
    constant) is compared absolutely: rounding leaves ~1e-8 there."""
    assert got.shape == ref.shape
    assert not torch.isnan(got).any(), f"{torch.isnan(got).sum().item()} NaN gradient elements"
    diff = (got.double() - ref).norm().item()
    norm = ref.norm().item()
    if norm == 0.0:
        return got.abs().max().item() if got.numel() else 0.0
    return diff / norm


def check_grads(grads, refs, dtype, what=""):
    tol = GRAD_REL_TOL[dtype]
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert g is not None, f"{what}{name} is None"
        assert g.dtype == dtype
        err = rel_error(g, r)
        assert err < tol, f"{what}{name}: relative error {err:.3e} >= {tol:.0e}"


def leaf_inputs(case: Case, device):
    return tuple(t.detach().requires_grad_() for t in case.inputs(device))


def lse_cotangent(lse: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random LSE gradient, zero on rows that see no key (their LSE is -inf and drops out of the loss)."""
    dlse = torch.randn(lse.shape, generator=gen).to(lse.device)
    return torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))


def run_and_backward(case: Case, device, *, with_lse: bool, deterministic: bool = False):
    """Grads of ``sum(out * dout) + sum(lse * dlse)`` (LSE's -inf rows masked out), and the reference's."""
    q, k, v = leaf_inputs(case, device)
    gen = torch.Generator().manual_seed(case.seed + 1)
    out, lse = tilegen.attention(q, k, v, return_lse=True, deterministic=deterministic, **case.mask_kwargs())
    assert out.grad_fn is not None
    dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=out.dtype)
    loss = (out * dout).float().sum()
    dlse = None
    if with_lse:
        dlse = lse_cotangent(lse, gen)
        finite = torch.isfinite(lse)
        loss = loss + (torch.where(finite, lse, torch.zeros_like(lse)) * dlse).sum()
    loss.backward()
    refs = attention_backward_reference(q.detach(), k.detach(), v.detach(), dout, dlse=dlse, **case.mask_kwargs())
    return (q.grad, k.grad, v.grad), refs


# --------------------------------------------------------------------------- the oracle itself

@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in [
    Case(7, 5, dtype="fp32", head_dim=8, heads_q=4, heads_kv=2, causal=True),
    Case(6, 9, dtype="fp32", head_dim=8, head_dim_v=4, window=(2, 1), softcap=2.0, scale=1.0),
    Case(5, 0, dtype="fp32", head_dim=8, heads_q=4, heads_kv=1),
]])
def test_reference_matches_autograd_of_forward_reference(case):
    """The hand-derived reference gradients equal float64 autograd through the forward reference."""
    q, k, v = (t.double().requires_grad_() for t in case.inputs("cpu"))
    out, lse = attention_reference(q, k, v, **case.mask_kwargs())
    gen = torch.Generator().manual_seed(2)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    dlse = torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))
    loss = (out * dout).sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).mul(dlse).sum()
    expected = torch.autograd.grad(loss, (q, k, v), allow_unused=True)
    got = attention_backward_reference(q.detach(), k.detach(), v.detach(), dout, dlse=dlse, **case.mask_kwargs())
    for g, e, t in zip(got, expected, (q, k, v)):
        torch.testing.assert_close(g, torch.zeros_like(t) if e is None else e, rtol=1e-10, atol=1e-10)


def test_the_references_keep_a_nan_of_the_inputs_and_give_rows_with_no_key_zeros():
    """An oracle that turned NaN into 0 would pass a kernel that does the same: a NaN in a query row makes that row's
    output and gradients NaN, while a row that sees no key (causal, more queries than keys) has zeros, never NaN."""
    case = Case(6, 3, dtype="fp32", head_dim=8, causal=True)
    q, k, v = (t.double() for t in case.inputs("cpu"))
    q[0, 0, 4, 3] = math.nan
    out, lse = attention_reference(q, k, v, causal=True)  # bottom-right: rows 0-2 sit before every key
    assert torch.isnan(out[0, 0, 4]).all() and torch.isnan(lse[0, 0, 4])
    assert torch.equal(out[0, 0, :3], torch.zeros_like(out[0, 0, :3])) and (lse[0, 0, :3] == -math.inf).all()
    assert torch.isfinite(out[0, 0, 5]).all() and torch.isfinite(out[0, 0, 3]).all()
    dq, dk, dv = attention_backward_reference(q, k, v, torch.ones_like(out), causal=True)
    assert torch.isnan(dq[0, 0, 4]).all() and torch.equal(dq[0, 0, :3], torch.zeros_like(dq[0, 0, :3]))
    assert torch.isfinite(dq[0, 0, 5]).all()


# --------------------------------------------------------------------------- the public op's gradients

GRAD_CASES = [
    # sizes: one row, a block and a bit, and a few blocks (the interpreter is slow: 257 once per dtype)
    Case(1, dtype="fp32", head_dim=16),
    Case(17, dtype="fp32", head_dim=16, causal=True),
    Case(17, dtype="bf16", head_dim=16),
    Case(257, dtype="fp32", head_dim=16, causal=True, heads_q=1, heads_kv=1),
    Case(257, dtype="bf16", head_dim=16, window=(40, 8), heads_q=1, heads_kv=1),
    # n_q != n_k both ways; with n_q > n_k causal's first rows see no key
    Case(17, 40, dtype="fp32", head_dim=16, causal=True),
    Case(40, 17, dtype="fp32", head_dim=16, causal=True),
    Case(40, 17, dtype="bf16", head_dim=16),
    # GQA 4 and MQA: dK and dV sum over each group's query heads
    Case(33, dtype="fp32", head_dim=16, heads_q=8, heads_kv=2, causal=True),
    Case(33, 20, dtype="bf16", head_dim=16, heads_q=4, heads_kv=1, tags=("mqa",)),
    # windows; (5, 0) with n_q > n_k leaves the first rows keyless
    Case(37, dtype="fp32", head_dim=16, window=(3, 2)),
    Case(37, 29, dtype="fp32", head_dim=16, window=(None, 4)),
    Case(40, 17, dtype="fp32", head_dim=16, window=(5, 0)),
    Case(40, 17, dtype="bf16", head_dim=16, window=(5, 0)),
    # softcap: 5 binds (scale 1 makes logits large), 1e8 is the identity to fp32 precision
    Case(33, dtype="fp32", head_dim=16, softcap=5.0, scale=1.0),
    Case(33, dtype="bf16", head_dim=16, softcap=5.0, scale=1.0, causal=True),
    Case(33, dtype="fp32", head_dim=16, softcap=1e8),
    # head dims: 72 pads to 128; V's head dim of its own
    Case(33, dtype="fp32", head_dim=72, causal=True),
    Case(33, dtype="bf16", head_dim=72),
    Case(33, 21, dtype="fp32", head_dim=16, head_dim_v=32, window=(6, 1)),
    Case(21, dtype="bf16", head_dim=16, head_dim_v=32, causal=True),
    # batch > 1, non-contiguous inputs
    Case(19, batch=2, dtype="fp32", head_dim=16, layout="bnhd", causal=True),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GRAD_CASES])
@pytest.mark.parametrize("with_lse", [False, True], ids=["out-only", "out+lse"])
def test_gradients_match_reference(case, with_lse, device):
    grads, refs = run_and_backward(case, device, with_lse=with_lse)
    check_grads(grads, refs, case.torch_dtype)


def test_lse_gradient_alone(device):
    """A loss of the LSE only: dout is None in the backward, and dQ/dK still follow from dLSE."""
    case = Case(40, 17, dtype="fp32", head_dim=16, causal=True)
    q, k, v = leaf_inputs(case, device)
    out, lse = tilegen.attention(q, k, v, causal=True, return_lse=True)
    dlse = lse_cotangent(lse, torch.Generator().manual_seed(3))
    (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse).sum().backward()
    refs = attention_backward_reference(q.detach(), k.detach(), v.detach(), torch.zeros_like(out), causal=True,
                                        dlse=dlse)
    check_grads((q.grad, k.grad, v.grad), refs, torch.float32)
    assert (v.grad == 0).all()  # dV = P^T dO, and dO is zero


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_q=st.integers(1, 40), n_k=st.integers(1, 40), heads_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([16, 24, 32]), mask=st.sampled_from(["none", "causal", "window"]),
    left=st.one_of(st.none(), st.integers(0, 20)), right=st.one_of(st.none(), st.integers(0, 20)),
    softcap=st.sampled_from([None, 3.0, 50.0]), seed=st.integers(0, 2**16),
)
def test_gradients_property(n_q, n_k, heads_kv, group, head_dim, mask, left, right, softcap, seed, device):
    case = Case(n_q, n_k, head_dim=head_dim, heads_kv=heads_kv, heads_q=heads_kv * group, dtype="fp32",
                causal=mask == "causal", window=(left, right) if mask == "window" else None, softcap=softcap,
                scale=1.0 if softcap == 3.0 else None, seed=seed)
    grads, refs = run_and_backward(case, device, with_lse=True)
    check_grads(grads, refs, torch.float32, what=f"{case.id}: ")


# --------------------------------------------------------------------------- both dQ modes, launched directly

def _direct_inputs(spec_case: Case, device):
    q, k, v = spec_case.inputs(device)
    gen = torch.Generator().manual_seed(7)
    out, lse = attention_reference(q, k, v, **spec_case.mask_kwargs())
    out, lse = out.to(q.dtype), lse.float()
    dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=q.dtype)
    dlse = lse_cotangent(lse, gen)
    return q, k, v, out, dout, lse, dlse


def _launch(spec, config, case, q, k, v, out, dout, lse, dlse):
    """One direct launch into NaN-poisoned gradients (an element left unwritten stays NaN)."""
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    delta, lse2 = torch.full_like(lse, math.nan), torch.full_like(lse, math.nan)
    dq_acc = torch.full(q.shape, math.nan, dtype=torch.float32, device=q.device)
    n_q, n_k = q.shape[2], k.shape[2]
    left, right = case.window if case.window is not None else (None, 0 if case.causal else None)
    wl, wr = launch_window(spec.mask, left, right, n_q, n_k)
    scale = case.scale if case.scale is not None else 1.0 / math.sqrt(q.shape[3])
    module_for(spec).launch(q, k, v, out, dout, lse, dlse, dq, dk, dv, delta, lse2, dq_acc, None, None, n_q, n_k,
                            scale=scale, softcap=case.softcap or 0.0, window_left=wl, window_right=wr,
                            **config.to_dict())
    return dq, dk, dv


DIRECT_CASES = [
    (Case(45, 30, dtype="fp32", head_dim=16, heads_q=4, heads_kv=2, causal=True), "causal"),
    (Case(30, 45, dtype="bf16", head_dim=16, head_dim_v=32, window=(4, 2), softcap=5.0, scale=1.0), "window"),
]
CONFIGS = {
    "separate-dq": Config(16, 32, 4, 1, 32, 16, 4, 1, atomic_dq=0),
    "atomic-dq": Config(32, 16, 4, 1, 32, 16, 4, 1, atomic_dq=1),
}


@pytest.mark.parametrize("case,mask", [pytest.param(c, m, id=c.id) for c, m in DIRECT_CASES])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_direct_launch_both_dq_modes(case, mask, config, device):
    spec = AttentionBwdSpec(head_dim=case.head_dim, head_dim_v=case.head_dim_v, q_per_kv=case.heads_q // case.heads_kv,
                            mask=mask, softcap=case.softcap is not None, dtype=case.dtype)
    assert feasible(spec, config, device_info(torch.device(device))) is None
    q, k, v, out, dout, lse, dlse = _direct_inputs(case, device)
    grads = _launch(spec, config, case, q, k, v, out, dout, lse, dlse)
    refs = attention_backward_reference(q, k, v, dout, dlse=dlse, **case.mask_kwargs())
    check_grads(grads, refs, case.torch_dtype)


def test_deterministic_config_drops_atomics():
    atomic = CONFIGS["atomic-dq"]
    spec = AttentionBwdSpec(head_dim=16)
    det = deterministic_config(atomic, spec, CPU_INTERPRETER)
    assert det.atomic_dq == 0
    # The dK/dV kernel keeps its tiles; a dQ kernel of its own takes the atomics' place.
    assert (det.block_m1, det.block_n1, det.num_warps1, det.num_stages1) == (
        atomic.block_m1, atomic.block_n1, atomic.num_warps1, atomic.num_stages1)
    assert feasible(spec, det, CPU_INTERPRETER) is None
    assert deterministic_config(CONFIGS["separate-dq"], spec, CPU_INTERPRETER) == CONFIGS["separate-dq"]


def test_a_deterministic_dq_kernel_is_one_the_device_runs():
    """Every atomic config of the H200's search space, deterministic: the dK/dV kernel as it was and a dQ kernel that
    ``feasible`` takes (4 warps over the transposed tile of a d256 M64-N64 row spill: ~320 registers a thread)."""
    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 141 << 30, 232448)
    family = family_of(AttentionBwdSpec(head_dim=64))
    for head_dim in (64, 128, 256):
        spec = AttentionBwdSpec(head_dim=head_dim, dtype="bf16", mask="causal")
        for config in (c for c in family.candidates(spec, h200) if c.atomic_dq):
            det = deterministic_config(config, spec, h200)
            assert det.atomic_dq == 0 and feasible(spec, det, h200) is None, (head_dim, str(config), str(det))
            assert (det.block_m1, det.block_n1, det.num_warps1, det.num_stages1, det.tma, det.wgmma) == (
                config.block_m1, config.block_n1, config.num_warps1, config.num_stages1, config.tma, config.wgmma)


def test_a_deterministic_config_is_worked_out_once(monkeypatch):
    """A call with mods maps its row's config at every backward: the search for a dQ kernel that fits (~0.5 ms for
    a d256 M64-N64 atomic row) is made once per config, spec and device, not per call."""
    import tilegen.families.attention_bwd.config as bwd_config

    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 141 << 30, 232448)
    spec = AttentionBwdSpec(head_dim=256, dtype="bf16", mask="causal")
    config = next(c for c in family_of(spec).candidates(spec, h200)
                  if c.atomic_dq and (c.block_m1, c.block_n1) == (64, 64))
    first = deterministic_config(config, spec, h200)
    calls = []
    real = bwd_config.feasible
    monkeypatch.setattr(bwd_config, "feasible", lambda *args: calls.append(args) or real(*args))
    assert deterministic_config(config, spec, h200) == first and not calls


def test_deterministic_gives_identical_bits(device, monkeypatch):
    # Hand deterministic() an atomic config, as a tuned row may be, so that it has atomics to remove.
    import tilegen.ops.attention_grad as grad_module

    seen = []
    real = grad_module.deterministic_config

    def spy(config, spec, device):
        atomic = dataclasses.replace(config, block_m2=config.block_m1, block_n2=config.block_n1,
                                     num_warps2=config.num_warps1, num_stages2=config.num_stages1, atomic_dq=1)
        result = real(atomic, spec, device)
        seen.append(result)
        return result

    monkeypatch.setattr(grad_module, "deterministic_config", spy)
    case = Case(40, 33, dtype="fp32", head_dim=16, heads_q=4, heads_kv=1, causal=True)
    runs = [run_and_backward(case, device, with_lse=True, deterministic=True)[0] for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert seen and all(result.atomic_dq == 0 for result in seen)


# --------------------------------------------------------------------------- autograd behaviour

def test_output_plus_input_gradient(device):
    case = Case(20, dtype="fp32", head_dim=16, causal=True)
    q, k, v = leaf_inputs(case, device)
    (tilegen.attention(q, k, v, causal=True) + q).sum().backward()
    ones = torch.ones(q.shape[:3] + (v.shape[3],), dtype=torch.float64, device=device)
    dq_ref, dk_ref, dv_ref = attention_backward_reference(q.detach(), k.detach(), v.detach(), ones, causal=True)
    check_grads((q.grad, k.grad, v.grad), (dq_ref + 1, dk_ref, dv_ref), torch.float32)


def test_non_contiguous_grad_output(device):
    case = Case(24, 18, dtype="fp32", head_dim=16, head_dim_v=16, window=(4, 3))
    q, k, v = leaf_inputs(case, device)
    out = tilegen.attention(q, k, v, window=(4, 3))
    gen = torch.Generator().manual_seed(5)
    # [b, h, d, n] transposed: the head dim is not unit-stride.
    dout = torch.randn(out.shape[0], out.shape[1], out.shape[3], out.shape[2], generator=gen).transpose(2, 3)
    assert not dout.is_contiguous()
    dout = dout.to(device)
    out.backward(dout)
    refs = attention_backward_reference(q.detach(), k.detach(), v.detach(), dout, window=(4, 3))
    check_grads((q.grad, k.grad, v.grad), refs, torch.float32)


def test_nan_input_gives_nan_gradients(device):
    q, k, v = leaf_inputs(Case(17, dtype="fp32", head_dim=16), device)
    with torch.no_grad():
        q[0, 0, 3, 2] = math.nan
    tilegen.attention(q, k, v).sum().backward()
    # Row 3 of head 0 is NaN and every key sees it through dK/dV.
    assert torch.isnan(q.grad[0, 0, 3]).all()
    assert torch.isnan(k.grad[0, 0]).any() and torch.isnan(v.grad[0, 0]).any()


def test_double_backward_is_refused(device):
    q, k, v = leaf_inputs(Case(17, dtype="fp32", head_dim=16), device)
    out = tilegen.attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.sum().backward()


@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_out_with_requires_grad_is_refused_before_launch(api, device):
    q, k, v = leaf_inputs(Case(8, dtype="fp32", head_dim=16), device)
    if api == "dense":
        buf = torch.full((1, 2, 8, 16), 7.0, device=device)
        call = lambda: tilegen.attention(q, k, v, out=buf)  # noqa: E731
    else:
        q, k, v = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
        cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
        buf = torch.full((8, 2, 16), 7.0, device=device)
        call = lambda: tilegen.varlen_attention(q, k, v, cu, cu, 8, 8, out=buf)  # noqa: E731
    with pytest.raises(TypeError, match="out"):
        call()
    assert (buf == 7.0).all(), "the out buffer was written before the refusal"


def test_deterministic_must_be_a_bool(device):
    q, k, v = leaf_inputs(Case(8, dtype="fp32", head_dim=16), device)
    with pytest.raises(TypeError, match="deterministic"):
        tilegen.attention(q, k, v, deterministic="yes")
    with torch.no_grad(), pytest.raises(TypeError, match="deterministic"):
        tilegen.attention(q, k, v, deterministic="yes")


def test_no_grad_output_has_no_grad_fn(device):
    q, k, v = leaf_inputs(Case(8, dtype="fp32", head_dim=16), device)
    with torch.no_grad():
        out, lse = tilegen.attention(q, k, v, return_lse=True)
    assert out.grad_fn is None and not out.requires_grad and lse.grad_fn is None
    assert tilegen.attention(q, k, v).grad_fn is not None


@pytest.mark.parametrize("n_q", [1, 4])
def test_decode_route_gradients(n_q, device):
    """Short queries take the decode family forward; the backward must still see the same LSE."""
    case = Case(n_q, 300, dtype="fp32", head_dim=16, heads_q=4, heads_kv=1, causal=True)
    q, k, v = case.inputs(device)
    assert type(tilegen.explain(q, k, v, causal=True).config).__name__ == "DecodeConfig"
    grads, refs = run_and_backward(case, device, with_lse=True)
    check_grads(grads, refs, torch.float32)


@pytest.mark.parametrize("n_q,n_k", [(12, 0), (0, 12)], ids=["nk0", "nq0"])
def test_zero_size_gradients(n_q, n_k, device):
    q, k, v = leaf_inputs(Case(n_q, n_k, dtype="fp32", head_dim=16), device)
    out, lse = tilegen.attention(q, k, v, return_lse=True)
    (out.sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()).backward()
    for g, t in zip((q.grad, k.grad, v.grad), (q, k, v)):
        assert g is not None and g.shape == t.shape and (g == 0).all()


def test_explain_backward(device):
    q, k, v = Case(40, dtype="bf16", head_dim=16).inputs(device)
    choice = tilegen.explain(q, k, v, causal=True, backward=True)
    assert isinstance(choice.config, Config)
    assert choice.config != tilegen.explain(q, k, v, causal=True).config


def test_explain_backward_of_a_deterministic_call_names_the_config_it_runs(device, monkeypatch):
    # A tuned row with atomics runs, in a deterministic call, with a dQ kernel of its own in their place.
    import tilegen.ops.attention_grad as grad_module
    from tilegen import dispatch

    case = Case(40, dtype="fp32", head_dim=16, causal=True)
    q, k, v = leaf_inputs(case, device)
    spec = grad_module.backward_spec(q.dtype, 16, 16, q.shape[1] // k.shape[1], "causal", False, "dense")
    info = device_info(torch.device(device))
    atomic = CONFIGS["atomic-dq"]
    dispatch._tables[(spec, info)] = dispatch.Table(spec, info, {64: (atomic, "tuned.sqlite")})
    ran = []
    real = grad_module.deterministic_config
    monkeypatch.setattr(grad_module, "deterministic_config", lambda *args: ran.append(real(*args)) or ran[-1])
    tilegen.attention(q, k, v, causal=True, deterministic=True).sum().backward()
    assert ran and ran[-1].atomic_dq == 0
    assert tilegen.explain(q, k, v, causal=True, backward=True).config == atomic
    choice = tilegen.explain(q, k, v, causal=True, backward=True, deterministic=True)
    assert choice.config == ran[-1] and (choice.source, choice.tuned_bucket) == ("tuned.sqlite", 64)
    with pytest.raises(TypeError, match="deterministic"):
        tilegen.explain(q, k, v, backward=True, deterministic=1)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_use_deterministic_algorithms_takes_the_deterministic_backward(api, compiled, device, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) a call with deterministic=False runs the deterministic backward,
    as SDPA's flash backward does there (it reads the flag): a tuned row's atomic dQ ran regardless."""
    import tilegen.ops.attention_grad as grad_module
    from tilegen import dispatch

    case = Case(40, dtype="fp32", head_dim=16, causal=True)
    q, k, v = leaf_inputs(case, device)
    layout = "dense"
    if api == "varlen":
        q, k, v = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
    spec = grad_module.backward_spec(torch.float32, 16, 16, 1, "causal", False, layout)
    info = device_info(torch.device(device))
    dispatch._tables[(spec, info)] = dispatch.Table(spec, info, {64: (CONFIGS["atomic-dq"], "tuned.sqlite")})
    ran = []
    real = grad_module.deterministic_config
    monkeypatch.setattr(grad_module, "deterministic_config", lambda *args: ran.append(real(*args)) or ran[-1])
    cu = torch.tensor([0, 40], dtype=torch.int32, device=device)

    def loss(q, k, v):
        if api == "dense":
            return tilegen.attention(q, k, v, causal=True).square().sum()
        return tilegen.varlen_attention(q, k, v, cu, cu, 40, 40, causal=True).square().sum()

    torch._dynamo.reset()
    call = torch.compile(loss, fullgraph=True, backend="aot_eager") if compiled else loss
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    call(q, k, v).backward()
    assert not ran  # the row's atomics; a compiled graph then retraces for the flag (Dynamo guards on it)
    explained = (lambda: tilegen.explain(q, k, v, causal=True, backward=True).config) if api == "dense" else None
    assert explained is None or explained().atomic_dq == 1
    torch.use_deterministic_algorithms(True)
    try:
        call(q, k, v).backward()
        assert ran and ran[-1].atomic_dq == 0
        assert explained is None or explained().atomic_dq == 0  # as the call runs
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_failed_row_falls_back_to_an_atomic_row_with_its_own_fp32_sum(dtype, device, caplog):
    """A tuned row that fails is skipped and the next one runs in the same call; when that one adds dQ by atomics,
    it must sum into an fp32 buffer of its own, not into dQ itself (allocated for the failed row's dQ kernel): bf16
    atomics are refused, so a good row was skipped as failed, and fp16 ones summed dQ in fp16."""
    import tilegen.ops.attention_grad as grad_module
    from tilegen import dispatch

    case = Case(40, dtype=dtype, head_dim=16, causal=True)
    q, k, v = leaf_inputs(case, device)
    spec = grad_module.backward_spec(q.dtype, 16, 16, 1, "causal", False, "dense")
    info = device_info(torch.device(device))
    bad = Config(48, 16, 4, 1, 48, 16, 4, 1)  # no power of two: tl.arange refuses it
    atomic = CONFIGS["atomic-dq"]
    dispatch._tables[(spec, info)] = dispatch.Table(spec, info, {64: (bad, "tuned.sqlite"),
                                                                 128: (atomic, "tuned.sqlite")})
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(device=device, dtype=q.dtype)
    runs = []
    with caplog.at_level(logging.WARNING, logger="tilegen.dispatch"):
        for _ in range(2):  # the first call falls back; the second runs the atomic row's plan directly
            for t in (q, k, v):
                t.grad = None
            tilegen.attention(q, k, v, causal=True).backward(dout)
            runs.append((q.grad, k.grad, v.grad))
    skipped = [r.getMessage() for r in caplog.records if "skipping the tuned config" in r.getMessage()]
    assert len(skipped) == 1 and str(bad) in skipped[0], skipped
    assert tilegen.explain(q, k, v, causal=True, backward=True).config == atomic
    refs = attention_backward_reference(q.detach(), k.detach(), v.detach(), dout, causal=True)
    check_grads(runs[0], refs, q.dtype)
    if device == "cpu":  # the interpreter adds in program order: both calls' atomic sums are the same bits
        for a, b in zip(*runs):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------- opcheck and torch.compile

def test_opcheck_dense(device):
    q, k, v = leaf_inputs(Case(19, 11, dtype="fp32", head_dim=16, heads_q=4, heads_kv=2), device)
    left, right = launch_window("causal", None, 0, 19, 11)
    args = (q, k, v, 16, "causal", False, True, 0.25, 0.0, left, right, False)
    torch.library.opcheck(torch.ops.tilegen.attention_fwd, args)


def test_opcheck_varlen(device):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 16, generator=gen).to(device).requires_grad_() for n, h in ((9, 4), (13, 2), (13, 2)))
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32, device=device)
    left, right = launch_window("window", 3, 1, 5, 7)
    args = (q, k, v, cu_q, cu_k, 5, 7, 16, "window", True, 0.25, 5.0, left, right, False)
    torch.library.opcheck(torch.ops.tilegen.varlen_attention_fwd, args)


def test_compiled_training_step_matches_eager(device):
    """The loss compiled whole (no graph break); AOTAutograd compiles its backward, which calls ours."""
    case = Case(20, 13, dtype="fp32", head_dim=16, heads_q=4, heads_kv=2)

    def loss_of(q, k, v):
        out, lse = tilegen.attention(q, k, v, causal=True, softcap=5.0, return_lse=True)
        return (out * out).sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()

    def step(fn):
        leaves = leaf_inputs(case, device)
        loss = fn(*leaves)
        loss.backward()
        return loss.detach(), [t.grad for t in leaves]

    torch._dynamo.reset()
    eager_loss, eager = step(loss_of)
    compiled_loss, compiled = step(torch.compile(loss_of, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-6)
    for e, c in zip(eager, compiled):
        assert c is not None
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)
    assert any(t.abs().max() > 0 for t in eager)



def test_compiled_training_step_stays_dynamic_over_lengths(device):
    """The backward's check that the forward kept its LSE reads the op's arguments, not sizes: comparing the LSE's
    size with the output's guarded the graph on each length (a recompile per length, and mark_dynamic refused)."""
    from torch._dynamo.utils import counters

    def loss_of(q, k, v):
        return (tilegen.attention(q, k, v, causal=True) ** 2).sum()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager")
    for n in (8, 13, 21):
        case = Case(n, n, dtype="fp32", head_dim=16, heads_q=2, heads_kv=2)
        leaves = leaf_inputs(case, device)
        for t in leaves:
            torch._dynamo.mark_dynamic(t, 2)
        compiled(*leaves).backward()
        got = [t.grad for t in leaves]
        want = torch.autograd.grad(loss_of(*leaves), leaves)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_the_raw_op_run_without_its_lse_refuses_a_backward_by_name(device):
    q, k, v = leaf_inputs(Case(9, 9, dtype="fp32", head_dim=16, heads_q=2, heads_kv=2), device)
    out, _ = torch.ops.tilegen.attention_fwd(q, k, v, 16, "causal", False, False, 0.25, 0.0, 2**31 - 1, 0)
    with pytest.raises(RuntimeError, match="without its LSE"):
        out.sum().backward()


def _varlen_leaves(device, grad=True):
    """A packed batch of three sequences (one empty, one of a single query) with more keys than queries."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, h, 16, generator=gen).to(device).requires_grad_(grad)
               for n, h in ((10, 4), (17, 2), (17, 2)))
    cu_q = torch.tensor([0, 9, 9, 10], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 12, 13, 17], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k


def test_varlen_attention_compiles_whole_and_matches_eager(device):
    """Under torch.compile(fullgraph=True) the call's arguments are checked in traced code and the custom op plans
    and launches (no dispatch table is traced, even in a process that has read none): forward with and without the
    LSE, into `out` too, and a training step whose gradients are the eager call's."""
    q, k, v, cu_q, cu_k = _varlen_leaves(device, grad=False)

    def infer(q, k, v, out=None):
        return tilegen.varlen_attention(q, k, v, cu_q, cu_k, 9, 12, causal=True, softcap=5.0, return_lse=True,
                                        out=out)

    def loss_of(q, k, v):
        out, lse = tilegen.varlen_attention(q, k, v, cu_q, cu_k, 9, 12, causal=True, return_lse=True)
        return (out * out).sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()

    from tilegen import dispatch

    dispatch.reset()  # a cold process: the op, not traced code, loads the tables
    torch._dynamo.reset()
    for backend in ("eager", "aot_eager"):
        out, lse = torch.compile(infer, fullgraph=True, backend=backend)(q, k, v)
        want, want_lse = infer(q, k, v)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
        given = torch.full_like(q, math.nan)
        got, _ = torch.compile(infer, fullgraph=True, backend=backend)(q, k, v, given)
        assert got.data_ptr() == given.data_ptr()
        torch.testing.assert_close(given, want, rtol=1e-6, atol=1e-6)

    def step(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    eager = step(loss_of)
    compiled = step(torch.compile(loss_of, fullgraph=True, backend="aot_eager"))
    for e, c in zip(eager, compiled):
        assert c is not None and e.abs().max() > 0
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)


def test_an_out_whose_elements_share_memory_is_refused_by_name_under_compile(device):
    """Traced code reads strides, not storage addresses: an expanded out is refused there as in eager calls."""
    q, k, v, cu_q, cu_k = _varlen_leaves(device, grad=False)
    dense = [t.unsqueeze(0).transpose(1, 2)[:, :, :9] for t in (q, k, v)]
    calls = [
        (lambda q, k, v, out: tilegen.varlen_attention(q, k, v, cu_q, cu_k, 9, 12, out=out), (q, k, v),
         q[:1].expand(q.shape)),
        (lambda q, k, v, out: tilegen.attention(q, k, v, out=out), dense, dense[0][:, :, :1].expand(dense[0].shape)),
    ]
    for call, inputs, out in calls:
        torch._dynamo.reset()
        with pytest.raises(Exception) as caught:
            torch.compile(call, fullgraph=True, backend="eager")(*inputs, out)
        assert "out: overlaps itself (stride 0" in str(caught.value) + str(caught.value.__cause__)


def test_varlen_attention_under_compile_refuses_bad_input_by_name(device):
    q, k, v, cu_q, cu_k = _varlen_leaves(device, grad=False)
    wrong = cu_q.to(torch.int64)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: tilegen.varlen_attention(q, k, v, wrong, cu_k, 9, 12), fullgraph=True,
                             backend="eager")
    with pytest.raises(Exception) as caught:
        compiled(q, k, v)
    assert "cu_seqlens_q: expected a 1-d int32 tensor" in str(caught.value) + str(caught.value.__cause__)


# --------------------------------------------------------------------------- varlen

@pytest.mark.parametrize("mask", ["causal", "none"])
def test_varlen_gradients_match_reference(mask, device):
    lens_q, lens_k, extra_k = [5, 0, 1, 17], [9, 4, 0, 17], 3  # 3 trailing K rows no sequence owns
    heads_q, heads_kv, d, dv = 4, 2, 16, 16
    gen = torch.Generator().manual_seed(11)
    total_q, total_k = sum(lens_q), sum(lens_k) + extra_k
    q = torch.randn(total_q, heads_q, d, generator=gen).to(device).requires_grad_()
    k = torch.randn(total_k, heads_kv, d, generator=gen).to(device).requires_grad_()
    v = torch.randn(total_k, heads_kv, dv, generator=gen).to(device).requires_grad_()
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    causal = mask == "causal"
    out, lse = tilegen.varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                        return_lse=True)
    dout = torch.randn(out.shape, generator=gen).to(device)
    dlse = lse_cotangent(lse, gen)
    ((out * dout).sum() + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse).sum()).backward()
    assert (k.grad[total_k - extra_k:] == 0).all() and (v.grad[total_k - extra_k:] == 0).all()
    for b in range(len(lens_q)):
        qs, qe, ks, ke = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        as_dense = lambda t, s, e: t.detach()[s:e].transpose(0, 1).unsqueeze(0)  # noqa: E731
        refs = attention_backward_reference(as_dense(q, qs, qe), as_dense(k, ks, ke), as_dense(v, ks, ke),
                                            as_dense(dout, qs, qe), dlse=dlse[qs:qe].T.unsqueeze(0), causal=causal)
        grads = (as_dense(q.grad, qs, qe), as_dense(k.grad, ks, ke), as_dense(v.grad, ks, ke))
        check_grads(grads, refs, torch.float32, what=f"sequence {b}: ")


def ragged_launch_matches_reference(spec, config, lens_q, lens_k, *, heads_q, device, seed=3, tail=0, window=None,
                                    head_major=False):
    """One direct launch of ``spec`` (ragged) with ``config`` over sequences of ``lens_q`` queries and ``lens_k``
    keys, into NaN-poisoned gradients, each sequence's rows against the float64 reference of that sequence alone.
    ``tail`` rows past the last sequence, which no sequence owns, hold NaN in Q, dO, K and V (a packed buffer's
    unwritten capacity). ``window``: a window spec's ``(left, right)``. ``head_major``: the LSE, Delta and the base-2
    LSE as ``[heads, total]`` storage seen as ``[total, heads]``, as the backward op lays them out."""
    heads_kv, d = heads_q // spec.q_per_kv, spec.head_dim
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    causal = spec.mask == "causal"
    masks = {"causal": causal, "window": window}
    gen = torch.Generator().manual_seed(seed)
    def packed(rows, heads):
        return torch.cat([torch.randn(rows, heads, d, generator=gen), torch.full((tail, heads, d), math.nan)])

    q, dout = (packed(sum(lens_q), heads_q).to(device, torch_dtype) for _ in "qo")
    k, v = (packed(sum(lens_k), heads_kv).to(device, torch_dtype) for _ in "kv")
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
                  for lens in (lens_q, lens_k))
    spans = [(cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()) for b in range(len(lens_q))]

    def as_dense(t, s, e):
        return t[s:e].transpose(0, 1).unsqueeze(0)

    out, lse = torch.zeros_like(q), torch.full((q.shape[0], heads_q), -math.inf, device=device)
    for qs, qe, ks, ke in spans:
        if qe > qs and ke > ks:
            o, l = attention_reference(as_dense(q, qs, qe), as_dense(k, ks, ke), as_dense(v, ks, ke), **masks)
            out[qs:qe], lse[qs:qe] = o[0].transpose(0, 1).to(torch_dtype), l[0].T.float()
    if head_major:
        lse = lse.t().contiguous().t()
        assert lse.stride() == (1, q.shape[0])
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    delta, lse2 = torch.full_like(lse, math.nan), torch.full_like(lse, math.nan)  # lse's strides
    dq_acc = torch.full(q.shape, math.nan, dtype=torch.float32, device=device)
    left, right = window if window is not None else (None, 0 if causal else None)
    wl, wr = launch_window(spec.mask, left, right, max(lens_q), max(lens_k))
    module_for(spec).launch(q, k, v, out, dout, lse, None, dq, dk, dv, delta, lse2, dq_acc, cu_q, cu_k, max(lens_q),
                            max(lens_k), scale=d ** -0.5, softcap=0.0, window_left=wl, window_right=wr,
                            **config.to_dict())
    for b, (qs, qe, ks, ke) in enumerate(spans):
        grads = (as_dense(dq, qs, qe), as_dense(dk, ks, ke), as_dense(dv, ks, ke))
        if ke == ks:  # no keys: nothing reaches dq
            assert (grads[0] == 0).all(), f"sequence {b}: dq"
        elif qe == qs:  # no queries: nothing reaches dk or dv
            assert all((g == 0).all() for g in grads[1:]), f"sequence {b}: dk, dv"
        else:
            refs = attention_backward_reference(as_dense(q, qs, qe), as_dense(k, ks, ke), as_dense(v, ks, ke),
                                                as_dense(dout, qs, qe), **masks)
            check_grads(grads, refs, torch_dtype, what=f"sequence {b}: ")


@pytest.mark.parametrize("mask", ["causal", "none", "window"])
@pytest.mark.parametrize("config", [Config(16, 32, 4, 1, 32, 16, 4, 1, tma=1), Config(32, 16, 4, 1, 32, 16, 4, 1,
                                                                                     atomic_dq=1, tma=1)], ids=str)
def test_ragged_launch_through_tma_descriptors(mask, config, device):
    """Q and dO (dK/dV kernel), K and V (dQ kernel) through descriptors of the packed tensors: a block past its
    sequence reads the next one's rows, or rows no sequence owns, which the masks must leave out (lengths that end
    mid-block, an empty sequence, one without keys, more keys than queries)."""
    spec = AttentionBwdSpec(head_dim=32, q_per_kv=2, mask=mask, dtype="fp32", layout="ragged")
    window = (6, 2) if mask == "window" else None
    ragged_launch_matches_reference(spec, config, [17, 0, 1, 40, 5], [17, 3, 0, 40, 33], heads_q=4, device=device,
                                    window=window)
    # Rows no sequence owns hold NaN: a block reaching into them must not carry it into any gradient (0 x NaN).
    ragged_launch_matches_reference(spec, config, [17, 0, 1, 40, 5], [17, 3, 0, 40, 33], heads_q=4, device=device,
                                    tail=9, window=window)


@pytest.mark.parametrize("mask", ["causal", "none", "window"])
def test_ragged_kernels_read_a_head_major_lse(mask, device):
    """The layout the backward op gives a ragged call's LSE, Delta and base-2 LSE (``_stats_layout``): every kernel
    reads them through their strides, rows of a head adjacent."""
    spec = AttentionBwdSpec(head_dim=32, q_per_kv=2, mask=mask, dtype="fp32", layout="ragged")
    ragged_launch_matches_reference(spec, Config(16, 32, 4, 1, 32, 16, 4, 1, tma=1), [17, 0, 1, 40, 5],
                                    [17, 3, 0, 40, 33], heads_q=4, device=device, tail=9, head_major=True,
                                    window=(6, 2) if mask == "window" else None)


@pytest.mark.parametrize("ragged", [True, False])
def test_the_backward_lays_the_lse_out_as_its_kernels_read_it(ragged):
    from tilegen.ops.attention_grad import _stats_layout

    shape = (37, 4) if ragged else (2, 4, 37)
    lse, dlse = torch.randn(shape), torch.randn(shape)
    if not ragged:  # a view the dense kernels cannot read with the scratch's contiguous strides
        lse, dlse = torch.randn(2, 37, 4).transpose(1, 2), torch.randn(2, 37, 4).transpose(1, 2)
    laid, dlaid = _stats_layout(lse, dlse, ragged)
    assert torch.equal(laid, lse) and torch.equal(dlaid, dlse)
    assert laid.stride() == dlaid.stride() == torch.empty_like(laid).stride()  # the scratch's, which empty_like keeps
    if ragged:
        assert laid.stride() == (1, 37)  # head-major: a head's rows adjacent
        assert _stats_layout(laid, None, True)[0] is laid  # already so: no copy
    else:
        assert laid.is_contiguous()


# --------------------------------------------------------------------------- against SDPA on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 192, 256])  # past 128 on the default's own tiles
def test_bf16_error_within_sdpa_on_gpu(head_dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (2, 8, 1000, head_dim), (2, 2, 1000, head_dim)
    q = torch.randn(shape_q, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(shape_kv, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape_kv, generator=gen, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(shape_q, generator=gen, device="cuda", dtype=torch.bfloat16)
    refs = attention_backward_reference(q, k, v, dout, causal=True)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward(dout)
        return [t.grad for t in leaves]

    ours = grads(lambda q, k, v: tilegen.attention(q, k, v, causal=True))
    sdpa = grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    for name, o, s, r in zip(("dq", "dk", "dv"), ours, sdpa, refs):
        ours_err, sdpa_err = rel_error(o, r), rel_error(s, r)
        assert ours_err < 1e-2
        assert ours_err <= 1.25 * sdpa_err, f"{name}: {ours_err:.3e} against SDPA's {sdpa_err:.3e}"


assert set(GRAD_REL_TOL) == set(DTYPES.values())
