"""Score and mask mods under torch.compile(fullgraph=True) (tilegen.mods.compiled): the compiled call equals the
eager one (its gradients too) and the float64 reference, reads the captured tensors of the moment, and refuses what
eager refuses.

Most mods are made outside the compiled function, as a model makes them once (module level, ``__init__``); one
made inside it may close over constants and read globals."""

from __future__ import annotations

import pytest
import torch

from helpers import checkout_pythonpath

import tilegen
from tilegen.families import relative_error
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.mods import compiled as mods_compiled
from tilegen.mods import library

pytestmark = pytest.mark.skipif(not mods_compiled.compiles_mods(),
                                reason=f"mods under torch.compile need torch {mods_compiled.MIN_TORCH}")


def test_a_process_that_first_meets_mods_under_compile_imports_their_tracing_there(tmp_path):
    """``import tilegen`` leaves ``tilegen.mods.compiled`` (and the Dynamo its decorators import) to the first call
    under torch.compile, which imports it while Dynamo traces: that call compiles and equals the eager one."""
    import os
    import subprocess
    import sys

    script = """
import sys, torch, tilegen
from tilegen.mods import library
assert "tilegen.mods.compiled" not in sys.modules and "torch._dynamo" not in sys.modules
score_mod = library.alibi(torch.tensor([0.5, 0.25]))
def f(q, k, v):
    return tilegen.attention(q, k, v, score_mod=score_mod, return_lse=True)
q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
out, lse = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
ref, ref_lse = f(q, k, v)
assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
assert "tilegen.mods.compiled" in sys.modules
print("ok")
"""
    environment = {**os.environ, "PYTHONPATH": checkout_pythonpath(), "TRITON_INTERPRET": "1",
                   "TILEGEN_DB": str(tmp_path / "none.sqlite")}
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _inputs(device, n=20):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(1, 2, n, 16, generator=gen).to(device) for _ in range(3)]


def _mods(case, device):
    slopes = torch.tensor([0.5, 0.25], device=device)
    ids = torch.tensor([0] * 7 + [1] * 13, device=device)
    score_mod = library.alibi(slopes) if "alibi" in case else None
    mask_mod = library.document_mask(ids) if "doc" in case else None
    return score_mod, mask_mod, slopes, ids


def _compiled(backend, score_mod, mask_mod):
    def f(q, k, v):
        return tilegen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)

    torch._dynamo.reset()
    return torch.compile(f, fullgraph=True, backend=backend), f


def _check_reference(out, lse, q, k, v, score_mod, mask_mod):
    ref, ref_lse = attention_reference(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    assert relative_error(out, ref)[0] < 1e-4
    assert (lse.double() - ref_lse).abs().max() < 1e-4


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", ["alibi", "doc", "alibi+doc"])
def test_compiled_mods_match_eager_and_reference(device, backend, case):
    q, k, v = _inputs(device)
    score_mod, mask_mod, slopes, ids = _mods(case, device)
    compiled, eager = _compiled(backend, score_mod, mask_mod)
    out, lse = compiled(q, k, v)
    for got, want in zip((out, lse), eager(q, k, v)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same kernel, config and inputs
    _check_reference(out, lse, q, k, v, score_mod, mask_mod)

    # New values in the captured tensors, written in place: graph inputs, so the compiled call sees them.
    slopes.mul_(4)
    ids[5:] = 1
    again, lse = compiled(q, k, v)
    assert not torch.equal(again, out)
    _check_reference(again, lse, q, k, v, score_mod, mask_mod)


def test_each_mod_object_compiles_its_own_constants(device):
    # Closures of one factory share their code: the graph is guarded on the function object itself.
    def scaled(c):
        return lambda score, b, h, q_idx, kv_idx: score * c

    q, k, v = _inputs(device)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, mod: tilegen.attention(q, k, v, score_mod=mod), fullgraph=True,
                             backend="eager")
    for c in (0.5, 3.0):
        mod = scaled(c)
        ref, _ = attention_reference(q, k, v, score_mod=mod)
        assert relative_error(compiled(q, k, v, mod), ref)[0] < 1e-4


def test_unsupported_mod_op_fails_at_compile_time(device):
    q, k, v = _inputs(device)

    def sine(score, b, h, q_idx, kv_idx):
        return torch.sin(score)

    compiled, _ = _compiled("eager", sine, None)
    with pytest.raises(Exception, match="score_mod: sin is not supported; supported: "):
        compiled(q, k, v)


def test_captured_tensor_out_of_range_fails_at_compile_time(device):
    q, k, v = _inputs(device)
    compiled, _ = _compiled("eager", library.alibi(torch.ones(1, device=device)), None)
    with pytest.raises(Exception) as caught:
        compiled(q, k, v)
    assert "captured tensor 'slopes' (shape (1,)), dim 0: h ranges over [0, 1]" in str(caught.value.__cause__)


def test_built_in_mods_take_the_built_in_op_under_compile(device):
    q, k, v = _inputs(device)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v):
        return tilegen.attention(q, k, v, score_mod=library.softcap(20.0), mask_mod=causal)

    causal = library.causal()
    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert "tilegen.attention_fwd" in targets and "tilegen.attention_mods_fwd" not in targets
    torch.testing.assert_close(out, tilegen.attention(q, k, v, causal=True, softcap=20.0), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_mods_train_as_eager(device, backend):
    # Through the custom op's autograd (tilegen::attention_mods_bwd): the eager call's kernels, so the same bits.
    base = _inputs(device)
    score_mod, mask_mod, slopes, _ = _mods("alibi+doc", device)
    slopes.requires_grad_()

    def f(q, k, v):
        out, lse = tilegen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
        return out.square().sum() + lse.sum()

    def grads(fn):
        q, k, v = (t.clone().requires_grad_() for t in base)
        slopes.grad = None
        fn(q, k, v).backward()
        return q.grad, k.grad, v.grad, slopes.grad

    torch._dynamo.reset()
    for got, want in zip(grads(torch.compile(f, fullgraph=True, backend=backend)), grads(f)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compiled_mod_without_a_derivative_fails_at_compile_time(device):
    q, k, v = _inputs(device)

    def stepped(score, b, h, q_idx, kv_idx):
        return score // 2.0

    compiled, _ = _compiled("eager", stepped, None)
    compiled(q, k, v)  # no gradient asked for: fine
    with pytest.raises(Exception, match="floordiv"):
        compiled(q.requires_grad_(), k, v)


_slopes = torch.tensor([0.5, 0.25])


def test_mod_made_inside_the_compiled_function_reads_globals_and_constants(device):
    # Dynamo rebuilds such a mod from its code and constant cells; its global tensor is read through the module.
    if device != "cpu":
        pytest.skip("the global lives on the CPU")
    q, k, v = _inputs(device)

    def f(q, k, v):
        return tilegen.attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score * 0.5 + _slopes[h])

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=0, atol=0)
    _slopes.mul_(2)
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=0, atol=0)


def _varlen(device):
    """``_inputs`` packed as two sequences of 8 and 12 tokens: ``(q, k, v, cu_seqlens)``."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in _inputs(device))  # [total, heads, dim]
    return q, k, v, torch.tensor([0, 8, 20], dtype=torch.int32, device=device)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_varlen_attention_with_mods_compiles_and_trains_as_eager(device, backend):
    """Through tilegen::varlen_attention_mods_fwd (and _bwd): the eager call's kernels, so the same bits, captured
    tensors read at every call, and the captured slopes' gradient too."""
    q, k, v, cu = _varlen(device)
    score_mod, mask_mod, slopes, _ = _mods("alibi+doc", device)

    def f(q, k, v):
        return tilegen.varlen_attention(q, k, v, cu, cu, 12, 12, score_mod=score_mod, mask_mod=mask_mod,
                                        return_lse=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    for _ in range(2):
        for got, want in zip(compiled(q, k, v), f(q, k, v)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        slopes.mul_(2)  # in place: a graph input, so the compiled call sees it
    ref, _ = attention_reference(q[8:].transpose(0, 1)[None], k[8:].transpose(0, 1)[None],
                                 v[8:].transpose(0, 1)[None], score_mod=score_mod, mask_mod=mask_mod,
                                 batch_ids=torch.tensor([1], device=device))
    assert relative_error(compiled(q, k, v)[0][8:], ref[0].transpose(0, 1))[0] < 1e-4

    slopes.requires_grad_()

    def loss(q, k, v):
        out, lse = f(q, k, v)
        return out.square().sum() + lse.sum()

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        slopes.grad = None
        fn(*leaves).backward()
        return [t.grad for t in leaves] + [slopes.grad]

    for got, want in zip(grads(torch.compile(loss, fullgraph=True, backend=backend)), grads(loss)):
        assert got is not None and want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("trains", [False, True], ids=["forward", "backward"])
def test_varlen_mods_custom_op_passes_opcheck(device, trains):
    from tilegen.mods.trace import CallRanges, bind_mods
    from tilegen.ops.varlen import _checked_ragged

    q, k, v, cu = _varlen(device)
    score_mod, mask_mod, slopes, _ = _mods("alibi+doc", device)
    q.requires_grad_(trains), slopes.requires_grad_(trains)
    spec, left, right, scale, softcap = _checked_ragged(q, k, v, cu, cu, 12, 12, False, None, None, None, True)
    mods = bind_mods(score_mod, mask_mod, q.device, CallRanges(b=2, h=2, q_idx=12, kv_idx=12))
    args = (q, k, v, cu, cu, 12, 12, list(mods.tensors), 1, mods.score_mod, mods.mask_mod, spec.dv, spec.mask,
            spec.softcap, True, scale, softcap, left, right, False)
    torch.library.opcheck(torch.ops.tilegen.varlen_attention_mods_fwd.default, args)


@pytest.mark.parametrize("trains", [False, True], ids=["forward", "backward"])
def test_mods_custom_op_passes_opcheck(device, trains):
    from tilegen.mods.trace import CallRanges, bind_mods
    from tilegen.ops.attention import prepare_call

    q, k, v = _inputs(device)
    score_mod, mask_mod, slopes, _ = _mods("alibi+doc", device)
    q.requires_grad_(trains), slopes.requires_grad_(trains)
    spec, left, right, scale, softcap = prepare_call(q, k, v, False, None, None, None, True)
    mods = bind_mods(score_mod, mask_mod, q.device, CallRanges(b=1, h=2, q_idx=20, kv_idx=20))
    args = (q, k, v, list(mods.tensors), 1, mods.score_mod, mods.mask_mod, spec.dv, spec.mask, spec.softcap, True,
            scale, softcap, left, right, False)
    torch.library.opcheck(torch.ops.tilegen.attention_mods_fwd.default, args)


_FACTOR = 0.5


def test_a_number_the_mod_reads_changed_later_compiles_again(device):
    """A global rebound: the compiled graph is guarded on each global number the mod's text holds, so it compiles
    the new text, as an eager call traces it again. (A closure's variable assigned again is not seen.)"""
    global _FACTOR

    def scaled(score, b, h, q_idx, kv_idx):
        return score * _FACTOR

    q, k, v = _inputs(device)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, mod: tilegen.attention(q, k, v, score_mod=mod), fullgraph=True,
                             backend="eager")
    try:
        for value in (0.5, 3.0):
            _FACTOR = value
            ref, _ = attention_reference(q, k, v, score_mod=scaled)
            assert relative_error(compiled(q, k, v, scaled), ref)[0] < 1e-4, value
    finally:
        _FACTOR = 0.5


def _factor_of(score):
    return score * _FACTOR


class _Settings:
    FACTOR = 0.5


_SETTINGS = _Settings()
_TABLE = {"factor": 0.5}


def test_a_number_read_by_a_helper_a_default_an_attribute_or_an_item_changed_later_compiles_again(device):
    """A helper's global, a default argument, an object's or a class's attribute and a dict's item are guarded as
    the mod's own global is."""

    def through_helper(score, b, h, q_idx, kv_idx):
        return _factor_of(score)

    def with_default(score, b, h, q_idx, kv_idx, factor=0.5):
        return score * factor

    def through_attribute(score, b, h, q_idx, kv_idx):
        return score * _SETTINGS.factor

    def through_class(score, b, h, q_idx, kv_idx):
        return score * _Settings.FACTOR

    def through_item(score, b, h, q_idx, kv_idx):
        return score * _TABLE["factor"]

    global _FACTOR
    q, k, v = _inputs(device)
    try:
        for mod in (through_helper, with_default, through_attribute, through_class, through_item):
            torch._dynamo.reset()  # each mod's graphs of their own, within Dynamo's recompile limit
            compiled = torch.compile(lambda q, k, v, mod: tilegen.attention(q, k, v, score_mod=mod), fullgraph=True,
                                     backend="eager")
            for value in (0.5, 3.0):
                _FACTOR = _SETTINGS.factor = _Settings.FACTOR = _TABLE["factor"] = value
                with_default.__defaults__ = (value,)
                ref, _ = attention_reference(q, k, v, score_mod=mod)
                assert relative_error(compiled(q, k, v, mod), ref)[0] < 1e-4, (mod.__name__, value)
    finally:
        _FACTOR = _SETTINGS.factor = _Settings.FACTOR = _TABLE["factor"] = 0.5


def test_a_mod_compiles_again_for_another_length(device):
    """A second length recompiles (its sizes may be symbolic): the range check is traced, not a constant."""
    table = torch.rand(2, device=device)

    def biased(score, b, h, q_idx, kv_idx):
        return score * 0.5 + table[h]

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: tilegen.attention(q, k, v, score_mod=biased), fullgraph=True,
                             backend="eager")
    for n in (9, 13, 17):
        q, k, v = _inputs(device, n)
        ref, _ = attention_reference(q, k, v, score_mod=biased)
        assert relative_error(compiled(q, k, v), ref)[0] < 1e-4, n


@pytest.mark.parametrize("wants", [True, False], ids=["learned", "frozen"])
def test_the_backward_ops_fake_strides_match_theirs_for_a_permuted_captured_tensor(device, wants):
    """A learned bias stored permuted (a dense leaf with other strides): the backward ops' fake implementations must
    give its gradient the strides the ops do, or a compiled training step's graph is traced with the wrong ones."""
    from tilegen.mods.trace import CallRanges, bind_mods
    from tilegen.ops.attention import prepare_call
    from tilegen.ops.varlen import _checked_ragged

    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(2, 12, 12, generator=gen).transpose(1, 2).contiguous().transpose(1, 2).to(device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    q, k, v = (torch.randn(1, 2, 12, 16, generator=gen).to(device) for _ in range(3))
    spec, left, right, scale, softcap = prepare_call(q, k, v, False, None, None, None, True)
    mods = bind_mods(score_mod, None, q.device, CallRanges(b=1, h=2, q_idx=12, kv_idx=12))
    fwd = (list(mods.tensors), 1, mods.score_mod, None, spec.dv, spec.mask, spec.softcap, True, scale, softcap, left,
           right, False)
    out, lse = torch.ops.tilegen.attention_mods_fwd(q, k, v, *fwd)
    tail = (list(mods.tensors), [wants], 1, mods.score_mod, None, spec.mask, spec.softcap, scale, softcap, left, right,
            False)
    dout = torch.randn(out.shape, generator=gen).to(device)
    torch.library.opcheck(torch.ops.tilegen.attention_mods_bwd.default, (dout, q, k, v, out, lse, None, *tail),
                          test_utils=("test_faketensor",))

    # The same over a packed batch of one sequence.
    qr, kr, vr = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    cu = torch.tensor([0, 12], dtype=torch.int32, device=device)
    spec, left, right, scale, softcap = _checked_ragged(qr, kr, vr, cu, cu, 12, 12, False, None, None, None, True)
    out, lse = torch.ops.tilegen.varlen_attention_mods_fwd(qr, kr, vr, cu, cu, 12, 12, *fwd)
    dout = torch.randn(out.shape, generator=gen).to(device)
    torch.library.opcheck(torch.ops.tilegen.varlen_attention_mods_bwd.default,
                          (dout, qr, kr, vr, out, lse, None, cu, cu, 12, 12, *tail), test_utils=("test_faketensor",))
