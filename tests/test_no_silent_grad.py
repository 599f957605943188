"""Ops without a backward refuse inputs that require grad instead of returning outputs that silently
have no ``grad_fn``.

With grad mode on and any tensor input (an ``out`` buffer and a cache's pages included) requiring
grad, each op raises ``NotImplementedError`` naming the op and the argument, before it launches
anything: a given ``out`` or cache is left as it was. Under ``torch.no_grad()`` (or
``torch.inference_mode()``) the same call runs as before. Each op is first called once without
grad, so that the refused call takes the planned fast path, where the check must run too.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from test_kv_append import make_batch
from test_varlen import _cu, make_cache

import tilegen
from tilegen.families.blockwise_ffn import BlockwiseFFNSpec
from tilegen.families.blockwise_ffn.problem import random_weights
from tilegen.layers import BlockwiseLayer, LayerConfig
from tilegen.layers.family.problem import random_weights as random_layer_weights


def refused(op: str, arg: str, missing: str | None = None):
    """``pytest.raises`` for the refusal: ``<op>: <arg> requires grad, but <missing>; ...``."""
    missing = missing or f"{op.removeprefix('tilegen.')} has no backward"
    message = f"{op}: {arg} requires grad, but {missing}; call it under torch.no_grad()"
    return pytest.raises(NotImplementedError, match="^" + re.escape(message))


def _randn(*shape, device, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------ apply_rope

@pytest.mark.parametrize("arg", ["x", "cos", "sin", "out"])
def test_apply_rope(arg, device):
    args = {"x": _randn(3, 2, 8, device=device), "cos": _randn(3, 8, device=device, seed=1),
            "sin": _randn(3, 8, device=device, seed=2), "out": torch.full((3, 2, 8), math.nan, device=device)}
    expected = tilegen.apply_rope(args["x"], args["cos"], args["sin"])  # planned without grad
    args[arg].requires_grad_()
    with refused("tilegen.apply_rope", arg):
        tilegen.apply_rope(args["x"], args["cos"], args["sin"], out=args["out"])
    assert args["out"].isnan().all()
    with torch.no_grad():
        assert torch.equal(tilegen.apply_rope(args["x"], args["cos"], args["sin"], out=args["out"]), expected)
    with torch.inference_mode():
        assert torch.equal(tilegen.apply_rope(args["x"], args["cos"], args["sin"]), expected)


# ---------------------------------------------------------------------------- merge_states

@pytest.mark.parametrize("arg", ["o_a", "lse_a", "o_b", "lse_b", "out", "out_lse"])
def test_merge_states(arg, device):
    args = {"o_a": _randn(3, 2, 8, device=device), "lse_a": _randn(3, 2, device=device, seed=1),
            "o_b": _randn(3, 2, 8, device=device, seed=2), "lse_b": _randn(3, 2, device=device, seed=3),
            "out": torch.full((3, 2, 8), math.nan, device=device),
            "out_lse": torch.full((3, 2), math.nan, device=device)}
    parts = ("o_a", "lse_a", "o_b", "lse_b")
    o, lse = tilegen.merge_states(*(args[p] for p in parts))
    args[arg].requires_grad_()
    with refused("tilegen.merge_states", arg):
        tilegen.merge_states(*(args[p] for p in parts), out=args["out"], out_lse=args["out_lse"])
    assert args["out"].isnan().all() and args["out_lse"].isnan().all()
    with torch.no_grad():
        merged = tilegen.merge_states(*(args[p] for p in parts), out=args["out"], out_lse=args["out_lse"])
    assert torch.equal(merged[0], o) and torch.equal(merged[1], lse)


# -------------------------------------------------------------------------------- append_kv

@pytest.mark.parametrize("arg", ["k", "v", "cache.k_pages", "cache.v_pages"])
def test_append_kv(arg, device):
    cache, k, v, cu = make_batch([0, 3], [2, 1], page_size=8, kv_heads=1, dim=8, device=device)
    tensors = {"k": k, "v": v, "cache.k_pages": cache.k_pages, "cache.v_pages": cache.v_pages}
    tilegen.append_kv(cache, k, v, cu)  # planned without grad; pages written
    cache.k_pages.fill_(math.nan)
    cache.v_pages.fill_(math.nan)
    tensors[arg].requires_grad_()
    with refused("tilegen.append_kv", arg):
        tilegen.append_kv(cache, k, v, cu)
    assert cache.k_pages.isnan().all() and cache.v_pages.isnan().all()
    with torch.no_grad():
        tilegen.append_kv(cache, k, v, cu)
    assert not cache.k_pages.isnan().all() and not cache.v_pages.isnan().all()


# -------------------------------------------------------------------------------- the paged runs

def _paged(device):
    gen = torch.Generator().manual_seed(0)
    return make_cache([5, 9], 8, 1, 16, torch.float32, device, gen)


@pytest.mark.parametrize("arg", ["q", "out", "cache.k_pages", "cache.v_pages"])
def test_paged_decode_run(arg, device):
    cache = _paged(device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=2, num_splits=1)
    q = _randn(cache.batch, 2, 16, device=device)
    expected = decode.run(q, cache)
    out = torch.full_like(q, math.nan)
    {"q": q, "out": out, "cache.k_pages": cache.k_pages, "cache.v_pages": cache.v_pages}[arg].requires_grad_()
    with refused("tilegen.PagedDecode.run", arg):
        decode.run(q, cache, out=out)
    assert out.isnan().all()
    with torch.no_grad():
        assert torch.equal(decode.run(q, cache, out=out), expected)


@pytest.mark.parametrize("arg", ["q", "out", "cache.k_pages", "cache.v_pages"])
def test_paged_attention_run(arg, device):
    cache = _paged(device)
    attn = tilegen.PagedAttention()
    attn.plan(_cu([2, 1], device), cache, heads_q=2, causal=True, max_seqlen_q=2, max_seqlen_k=9)
    q = _randn(3, 2, 16, device=device)
    expected = attn.run(q, cache)
    out = torch.full_like(q, math.nan)
    {"q": q, "out": out, "cache.k_pages": cache.k_pages, "cache.v_pages": cache.v_pages}[arg].requires_grad_()
    with refused("tilegen.PagedAttention.run", arg):
        attn.run(q, cache, out=out)
    assert out.isnan().all()
    with torch.no_grad():
        assert torch.equal(attn.run(q, cache, out=out), expected)


# ---------------------------------------------------------------------------- blockwise_ffn

@pytest.mark.parametrize("arg", ["x", "w_norm", "b_norm", "w_gate", "w_up", "w_down", "out"])
def test_blockwise_ffn(arg, device):
    spec = BlockwiseFFNSpec(d_model=16, d_ffn=24, norm="layernorm", ffn="swiglu", dtype="fp32")
    w = random_weights(spec, torch.Generator().manual_seed(0), device, torch.float32)
    args = {"x": _randn(3, 16, device=device), "w_norm": w.w_norm, "b_norm": w.b_norm, "w_gate": w.w_gate,
            "w_up": w.w_up, "w_down": w.w_down}
    expected = tilegen.blockwise_ffn(**args, norm="layernorm")
    args["out"] = torch.full((3, 16), math.nan, device=device)
    args[arg].requires_grad_()
    with refused("tilegen.blockwise_ffn", arg):
        tilegen.blockwise_ffn(**args, norm="layernorm")
    assert args["out"].isnan().all()
    with torch.no_grad():
        assert torch.equal(tilegen.blockwise_ffn(**args, norm="layernorm"), expected)


# ---------------------------------------------------------------------------- the blockwise layer

LAYER = LayerConfig(d_model=32, heads_q=2, heads_kv=1, head_dim=16, d_ffn=24)
from tilegen.layers.op import NO_BACKWARD  # noqa: E402


def _layer(device) -> BlockwiseLayer:
    layer = BlockwiseLayer(LAYER, dtype=torch.float32, device=device, block=4)
    return layer.load_weights(random_layer_weights(LAYER, torch.Generator().manual_seed(0), device, torch.float32))


@pytest.mark.parametrize("arg", ["x", "mlp.up_proj.weight"])
def test_blockwise_layer_trains_and_refuses_out(arg, device):
    """The layer differentiates (tilegen.layers.train); a result written into `out` could not, so `out` is
    refused before anything runs."""
    weights = random_layer_weights(LAYER, torch.Generator().manual_seed(0), device, torch.float32)
    x = _randn(5, 32, device=device)
    expected = tilegen.blockwise_layer(x, weights, LAYER, block=4)
    out = torch.full_like(x, math.nan)
    {"x": x, **weights}[arg].requires_grad_()
    with pytest.raises(TypeError, match=r"^out: x or a weight requires grad"):
        tilegen.blockwise_layer(x, weights, LAYER, block=4, out=out)
    assert out.isnan().all()
    y = tilegen.blockwise_layer(x, weights, LAYER, block=4)
    assert y.grad_fn is not None
    torch.testing.assert_close(y.detach(), expected)
    with torch.no_grad():
        assert torch.equal(tilegen.blockwise_layer(x, weights, LAYER, block=4, out=out), expected)


def test_blockwise_layer_refuses_an_out_that_requires_grad(device):
    weights = random_layer_weights(LAYER, torch.Generator().manual_seed(0), device, torch.float32)
    x = _randn(5, 32, device=device)
    out = torch.full_like(x, math.nan).requires_grad_()
    with refused("tilegen.blockwise_layer", "out", NO_BACKWARD):
        tilegen.blockwise_layer(x, weights, LAYER, block=4, out=out)
    assert out.isnan().all()


def test_blockwise_layer_reads_a_module_s_parameters(device):
    """A module's state_dict() is detached: whether the layer trains is read from its parameters."""
    layer = _layer(device).requires_grad_()
    x = _randn(5, 32, device=device)
    y = tilegen.blockwise_layer(x, layer, LAYER, block=4)
    y.sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in layer.parameters())
    with torch.no_grad():
        assert tilegen.blockwise_layer(x, layer, LAYER, block=4).grad_fn is None


def test_blockwise_layer_module(device):
    layer = _layer(device)
    x = _randn(5, 32, device=device)
    with torch.no_grad():
        expected = layer(x)
    y = layer(x)  # parameters require grad, as torch.nn.Linear's do
    assert y.grad_fn is not None
    torch.testing.assert_close(y.detach(), expected)
    out = torch.full_like(x, math.nan)
    with pytest.raises(TypeError, match=r"^out: "):
        layer(x, out=out)
    assert out.isnan().all()
    with torch.no_grad():
        assert torch.equal(layer(x, out=out), expected)
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)
    assert layer.requires_grad_(False)(x).grad_fn is None


# ------------------------------------------------------------------ forward-mode AD of attention

def _attention_calls(device):
    """tilegen.attention and tilegen.varlen_attention, each as a function of (q, k, v), with its inputs."""
    q, k, v = (_randn(1, 2, 9, 16, device=device, seed=s) for s in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    return [("tilegen.attention", lambda q, k, v: tilegen.attention(q, k, v, causal=True), (q, k, v)),
            ("tilegen.varlen_attention", lambda q, k, v: tilegen.varlen_attention(q, k, v, cu, cu, 5, 5, causal=True),
             tuple(t[0].transpose(0, 1).contiguous() for t in (q, k, v)))]


@pytest.mark.parametrize("trains", [False, True], ids=["plain", "requires-grad"])
@pytest.mark.parametrize("arg", [0, 2], ids=["q", "v"])
def test_forward_mode_tangents_are_refused_by_name(arg, trains, device):
    """The kernels have no forward-mode derivative: a dual input (torch.autograd.forward_ad, torch.func.jvp or jacfwd)
    is refused by name, where its tangent was dropped (None) or taken as zero, with the primal looking right."""
    import torch.autograd.forward_ad as fwAD

    name = "qkv"[arg]
    message = rf"^{{}}: {name} has a forward-mode tangent"
    for op, call, inputs in _attention_calls(device):
        inputs = [t.requires_grad_(trains) for t in inputs]
        with fwAD.dual_level(), pytest.raises(NotImplementedError, match=message.format(re.escape(op))):
            dual = [fwAD.make_dual(t, torch.ones_like(t)) if i == arg else t for i, t in enumerate(inputs)]
            call(*dual)
        with pytest.raises(NotImplementedError, match=message.format(re.escape(op))):
            torch.func.jvp(lambda x: call(*inputs[:arg], x, *inputs[arg + 1:]), (inputs[arg],),
                           (torch.ones_like(inputs[arg]),))
        with fwAD.dual_level():  # a level without a tangent on any input runs as before
            assert torch.equal(call(*inputs).detach(), call(*inputs).detach())
