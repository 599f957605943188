"""The Blockwise Parallel Transformer layer: the blockwise FFN family and ``tilegen.blockwise_layer``.

Layer sizes are tiny (the interpreter is slow) and none is a multiple of a block: 45 tokens
in query blocks of 16 (two whole blocks and a partial one), d_model 40 and d_ffn 72 against
kernel tiles of 16 and 32. Errors are relative Frobenius errors against float64 references
on the same rounded inputs and weights: below 1e-2 in bf16, 1e-4 in fp32. The residual
stream dominates a layer's output, so the layer's own contribution (out - x) is held to the
same bound too: a layer that dropped attention or the MLP fails both.

Covered: the FFN kernels alone (both norms, both MLPs, fp32 and bf16, NaN-poisoned outputs, a
default and a many-block config), the op in place and strided; the layer causal or not, with
GQA and MQA, windows, softcap and no RoPE, batched, in place, with one-row blocks; a
Llama-shaped module's weights loading; bad weights named; the generated source's constexpr
rule and an sm90 compile; a tune through the Tuner that dispatch and the layer then use; the
benchmark's smoke run. The layer's own family (``blockwise_layer``): its spec, the schedule
rendered for it (what each spec leaves out), the layer through it at 1, 17 and 257 tokens, its
tuning problem's checks, and a ``tilegen tune`` of its tiny preset whose row the layer then runs.
Tests marked ``gpu`` run Llama-sized shapes on a GPU.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tilegen
from tilegen import dispatch
from tilegen.codegen import module_for, source_for
from tilegen.db import TuningDB, tuned_rows
from tilegen.device import device_info
from tilegen.families import family_of, relative_error
from tilegen.families.blockwise_ffn import BlockwiseFFNSpec, Config
from tilegen.families.blockwise_ffn.problem import random_weights
from tilegen.families.blockwise_ffn.reference import ffn_reference
from tilegen.layers.family import BlockwiseLayerSpec
from tilegen.layers.family import Config as LayerBlock
from tilegen.layers.family.problem import random_weights as random_layer_weights
from tilegen.ir import SpecError
from tilegen.families import spec_from_json
from tilegen.key import TuningKey
from tilegen.layers import BlockwiseLayer, LayerConfig, reference_layer
from tilegen.layers.op import explain_layer, layer_spec
from tilegen.tuning import Tuner

from helpers import sizeable_weights

DEVICE = device_info()
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
D_MODEL, D_FFN, TOKENS, BLOCK = 40, 72, 45, 16


def _spec(norm="rmsnorm", ffn="swiglu", dtype="fp32"):
    return BlockwiseFFNSpec(d_model=D_MODEL, d_ffn=D_FFN, norm=norm, ffn=ffn, dtype=dtype)


def layer_weights(config: LayerConfig, dtype, device, seed=0) -> dict[str, torch.Tensor]:
    """Fresh weights: norms near one (biases near zero, never zero), projections scaled by 1/sqrt(fan_in)."""
    return random_layer_weights(config, torch.Generator().manual_seed(seed), device, dtype)


def _x(shape, dtype, device, seed=1):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1.5).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------- the FFN kernels alone

FFN_CASES = [pytest.param(norm, ffn, dtype, id=f"{norm}-{ffn}-{dtype}") for dtype in ("fp32", "bf16")
             for norm, ffn in (("rmsnorm", "swiglu"), ("layernorm", "gelu_mlp"), ("rmsnorm", "gelu_mlp"),
                               ("layernorm", "swiglu"))] + [pytest.param("rmsnorm", "swiglu", "fp16", id="fp16")]


@pytest.mark.parametrize("norm,ffn,dtype", FFN_CASES)
def test_the_ffn_kernels_match_the_reference_into_poisoned_outputs(norm, ffn, dtype):
    spec = _spec(norm, ffn, dtype)
    family = family_of(spec)
    problem = family.problem(spec, 64, on_gpu=not DEVICE.is_interpreter)
    inputs = problem.inputs(seed=0)
    # Several fusion blocks and a partial one, tiles that straddle every edge, and the default.
    for config in (Config(16, 16, 32, 16, 16, 1, 1), family.default_config(spec, DEVICE, 64)):
        outputs = problem.outputs(inputs)
        assert torch.isnan(outputs[0]).all()
        assert problem.check(inputs, outputs) == (math.inf, math.inf)  # unwritten never passes
        problem.launch(module_for(spec), config, inputs, outputs)
        error, _ = problem.check(inputs, outputs)
        assert error < problem.tolerance, (config, error)
    # The check sees a wrong result: the output without the MLP is just x, normalized away.
    outputs[0][3, 5] += 1.0
    assert problem.check(inputs, outputs)[0] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_ffn_op_in_place_and_strided(dtype, device):
    spec = _spec("layernorm", "swiglu", "fp32" if dtype == torch.float32 else "bf16")
    w = random_weights(spec, torch.Generator().manual_seed(2), device, dtype)
    x = _x((TOKENS, D_MODEL + 8), dtype, device)[:, 4:4 + D_MODEL]  # row stride 48, wider than the rows
    ref = ffn_reference(x, w.w_norm, w.b_norm, w.w_gate, w.w_up, w.w_down, norm="layernorm", ffn="swiglu", eps=1e-6)
    kwargs = dict(w_norm=w.w_norm, b_norm=w.b_norm, w_gate=w.w_gate, w_up=w.w_up, w_down=w.w_down.t().contiguous().t(),
                  norm="layernorm", eps=1e-6)
    out = tilegen.blockwise_ffn(x, **kwargs)
    assert relative_error(out, ref)[0] < TOL[dtype]
    assert relative_error(out - x, ref - x.double())[0] < TOL[dtype]
    y = x.clone()
    assert tilegen.blockwise_ffn(y, **kwargs, out=y) is y
    assert relative_error(y, ref)[0] < TOL[dtype]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_the_ffn_op_under_torch_compile(backend, device):
    """``fullgraph=True`` traces ``tilegen::blockwise_ffn``: the same bits as an eager call, a given ``out`` (``x``
    itself included) filled; ``opcheck`` passes on the op."""
    spec = _spec("layernorm", "gelu_mlp")
    w = random_weights(spec, torch.Generator().manual_seed(3), device, torch.float32)
    kwargs = dict(w_norm=w.w_norm, b_norm=w.b_norm, w_up=w.w_up, w_down=w.w_down, norm="layernorm", eps=1e-6)
    x = _x((TOKENS, D_MODEL), torch.float32, device, seed=4)
    want = tilegen.blockwise_ffn(x, **kwargs)

    def f(x, out):
        return tilegen.blockwise_ffn(x, **kwargs) * 2, tilegen.blockwise_ffn(x, **kwargs, out=out)

    torch._dynamo.reset()
    out = torch.full_like(x, math.nan)
    doubled, result = torch.compile(f, fullgraph=True, backend=backend)(x, out)
    assert torch.equal(doubled, want * 2) and result is out and torch.equal(out, want)
    y = x.clone()
    torch.compile(lambda y: tilegen.blockwise_ffn(y, **kwargs, out=y), fullgraph=True, backend=backend)(y)
    assert torch.equal(y, want)
    torch.library.opcheck(torch.ops.tilegen.blockwise_ffn.default,
                          (x, w.w_norm, w.w_up, w.w_down, None, w.b_norm, "layernorm", 1e-6))


def test_the_ffn_op_names_bad_arguments(device):
    spec = _spec("rmsnorm", "swiglu")
    w = random_weights(spec, torch.Generator().manual_seed(2), device, torch.float32)
    x = _x((5, D_MODEL), torch.float32, device)
    good = dict(w_norm=w.w_norm, w_gate=w.w_gate, w_up=w.w_up, w_down=w.w_down)
    with pytest.raises(ValueError, match=r"w_down: expected shape \(40, 72\)"):
        tilegen.blockwise_ffn(x, **{**good, "w_down": w.w_down[:, :-1]})
    with pytest.raises(TypeError, match="w_gate: dtype torch.bfloat16 differs"):
        tilegen.blockwise_ffn(x, **{**good, "w_gate": w.w_gate.bfloat16()})
    with pytest.raises(ValueError, match="w_norm: on meta"):
        tilegen.blockwise_ffn(x, **{**good, "w_norm": w.w_norm.to("meta")})
    with pytest.raises(ValueError, match="b_norm: norm='layernorm' needs"):
        tilegen.blockwise_ffn(x, **good, norm="layernorm")
    with pytest.raises(ValueError, match="eps"):
        tilegen.blockwise_ffn(x, **good, eps=0.0)
    with pytest.raises(SpecError, match="norm"):
        BlockwiseFFNSpec(d_model=8, d_ffn=8, norm="batchnorm")
    rows = torch.cat([x, x[:1]]).clone()  # x's rows and one more, in one buffer
    with pytest.raises(ValueError, match="^out: overlaps x in memory; pass x itself, or a tensor of its own"):
        tilegen.blockwise_ffn(rows[:5], **good, out=rows[1:])
    with pytest.raises(ValueError, match="^out: overlaps w_up in memory"):
        tilegen.blockwise_ffn(x, **good, out=w.w_up.flatten()[:5 * D_MODEL].view(5, D_MODEL))


# --------------------------------------------------------------------------------- the layer

LAYERS = [
    pytest.param(dict(causal=True, norm="rmsnorm", ffn="swiglu", heads_q=4, heads_kv=2), id="causal-gqa-rms-swiglu"),
    pytest.param(dict(causal=False, norm="layernorm", ffn="gelu_mlp", heads_q=4, heads_kv=1), id="full-mqa-ln-gelu"),
    pytest.param(dict(causal=True, norm="layernorm", ffn="gelu_mlp", heads_q=2, heads_kv=2, rope_theta=None),
                 id="causal-mha-ln-gelu-norope"),
    pytest.param(dict(causal=False, norm="rmsnorm", ffn="swiglu", heads_q=4, heads_kv=2), id="full-gqa-rms-swiglu"),
    pytest.param(dict(causal=True, norm="rmsnorm", ffn="swiglu", heads_q=4, heads_kv=2, window=(20, 0), softcap=5.0),
                 id="causal-window20-softcap"),
    pytest.param(dict(causal=False, norm="rmsnorm", ffn="gelu_mlp", heads_q=4, heads_kv=2, window=(7, 19)),
                 id="window7-19"),
    pytest.param(dict(causal=False, norm="layernorm", ffn="swiglu", heads_q=2, heads_kv=1, window=(None, 3)),
                 id="window-inf-3"),
]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp16 on the first two cases only: the interpreter is slow.
LAYER_CASES = [pytest.param(case.values[0], DTYPES[name], id=f"{case.id}-{name}")
               for name in DTYPES for i, case in enumerate(LAYERS) if name != "fp16" or i < 2]


@pytest.mark.parametrize("options,dtype", LAYER_CASES)
def test_the_layer_matches_the_reference(options, dtype, device):
    config = LayerConfig(d_model=D_MODEL, head_dim=16, d_ffn=D_FFN, eps=1e-5, **options)
    weights = layer_weights(config, dtype, device)
    x = _x((TOKENS, D_MODEL), dtype, device)
    out = tilegen.blockwise_layer(x, weights, config, block=BLOCK)
    assert out.shape == x.shape and out.dtype == dtype and torch.isfinite(out).all()
    ref = reference_layer(x, weights, config, compute_dtype=torch.float64)
    assert relative_error(out, ref)[0] < TOL[dtype]
    assert relative_error(out - x, ref - x.double())[0] < TOL[dtype]


def test_the_layer_takes_a_batch_the_default_block_and_out(device):
    config = LayerConfig(d_model=D_MODEL, heads_q=4, heads_kv=2, head_dim=16, d_ffn=D_FFN)
    weights = layer_weights(config, torch.float32, device)
    x = _x((2, 37, D_MODEL), torch.float32, device)
    out = torch.full_like(x, math.nan)
    assert tilegen.blockwise_layer(x, weights, heads_q=4, heads_kv=2, out=out) is out  # widths from the weights
    ref = reference_layer(x, weights, config, compute_dtype=torch.float64)
    assert relative_error(out, ref)[0] < 1e-4
    # In place: the layer reads a block's rows before it writes them.
    for layer in (config, config.replace(causal=False)):
        y = x.clone()
        assert tilegen.blockwise_layer(y, weights, layer, block=BLOCK, out=y) is y
        assert relative_error(y, reference_layer(x, weights, layer, compute_dtype=torch.float64))[0] < 1e-4
    rows = torch.cat([x[1], x[1, :1]]).clone()
    with pytest.raises(ValueError, match="^out: overlaps x in memory; pass x itself"):
        tilegen.blockwise_layer(rows[:37], weights, config, out=rows[1:])
    # Each query block really sees only its keys: a block size of one row gives the same layer.
    one = tilegen.blockwise_layer(x[1, :9], weights, config, block=1)
    assert relative_error(one, reference_layer(x[1, :9], weights, config, compute_dtype=torch.float64))[0] < 1e-4


def test_a_blockwise_layer_in_the_wrong_order_is_caught(device):
    """The comparison can fail: K projected from the un-normalized input is a different layer."""
    config = LayerConfig(d_model=D_MODEL, heads_q=4, heads_kv=2, head_dim=16, d_ffn=D_FFN)
    weights = layer_weights(config, torch.float32, device)
    x = _x((TOKENS, D_MODEL), torch.float32, device)
    other = dict(weights, **{"self_attn.k_proj.weight": weights["self_attn.k_proj.weight"] * 1.01})
    ref = reference_layer(x, weights, config, compute_dtype=torch.float64)
    out = tilegen.blockwise_layer(x, other, config, block=BLOCK)
    assert relative_error(out - x, ref - x.double())[0] > 1e-4


class _Linear(torch.nn.Linear):
    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out, bias=False)


class _RMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))


class _LlamaLayer(torch.nn.Module):
    """The module tree of transformers' ``LlamaDecoderLayer``, with its parameter names and a rotary buffer."""

    def __init__(self, d, heads_q, heads_kv, head_dim, d_ffn):
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.q_proj = _Linear(d, heads_q * head_dim)
        self.self_attn.k_proj = _Linear(d, heads_kv * head_dim)
        self.self_attn.v_proj = _Linear(d, heads_kv * head_dim)
        self.self_attn.o_proj = _Linear(heads_q * head_dim, d)
        self.self_attn.rotary_emb = torch.nn.Module()
        self.self_attn.rotary_emb.register_buffer("inv_freq", torch.ones(head_dim // 2))
        self.mlp = torch.nn.Module()
        self.mlp.gate_proj = _Linear(d, d_ffn)
        self.mlp.up_proj = _Linear(d, d_ffn)
        self.mlp.down_proj = _Linear(d_ffn, d)
        self.input_layernorm = _RMSNorm(d)
        self.post_attention_layernorm = _RMSNorm(d)


def test_a_llama_layer_loads_into_the_module(device):
    torch.manual_seed(0)
    llama = _LlamaLayer(D_MODEL, 4, 2, 16, D_FFN)
    sizeable_weights(llama)
    llama = llama.to(device=device, dtype=torch.bfloat16)
    layer = BlockwiseLayer.from_llama(llama, heads_q=4, heads_kv=2, rope_theta=500000.0, eps=1e-5, block=BLOCK)
    assert layer.config == LayerConfig(D_MODEL, 4, 2, 16, D_FFN, rope_theta=500000.0, eps=1e-5)
    assert set(layer.state_dict()) == set(layer.config.weight_shapes())
    assert torch.equal(layer.mlp.down_proj.weight, llama.mlp.down_proj.weight)
    # The state dict loads as it is (the rotary buffer aside) into a module built from a config.
    fresh = BlockwiseLayer(layer.config, dtype=torch.bfloat16, device=device, block=BLOCK)
    fresh.load_state_dict({k: v for k, v in llama.state_dict().items() if "inv_freq" not in k})
    x = _x((TOKENS, D_MODEL), torch.bfloat16, device)
    ref = reference_layer(x, llama.state_dict(), layer.config, compute_dtype=torch.float64)
    for module in (layer, fresh):
        out = module(x).detach()  # parameters require grad: this forward trains, as it would in a model
        assert relative_error(out, ref)[0] < 1e-2 and relative_error(out - x, ref - x.double())[0] < 1e-2


def test_bad_weights_are_named(device):
    config = LayerConfig(d_model=D_MODEL, heads_q=4, heads_kv=2, head_dim=16, d_ffn=D_FFN)
    weights = layer_weights(config, torch.float32, device)
    x = _x((7, D_MODEL), torch.float32, device)

    def call(**changes):
        tilegen.blockwise_layer(x, {**weights, **changes}, config)

    with pytest.raises(ValueError, match=r"mlp.up_proj.weight: expected shape \(72, 40\).*got \(72, 39\)"):
        call(**{"mlp.up_proj.weight": weights["mlp.up_proj.weight"][:, :-1]})
    with pytest.raises(TypeError, match="self_attn.v_proj.weight: dtype torch.bfloat16 differs"):
        call(**{"self_attn.v_proj.weight": weights["self_attn.v_proj.weight"].bfloat16()})
    with pytest.raises(ValueError, match="post_attention_layernorm.weight: on meta"):
        call(**{"post_attention_layernorm.weight": weights["post_attention_layernorm.weight"].to("meta")})
    with pytest.raises(ValueError, match="self_attn.q_proj.bias: not a weight of this layer.*no projection biases"):
        call(**{"self_attn.q_proj.bias": torch.ones(64)})
    missing = dict(weights)
    del missing["mlp.gate_proj.weight"]
    with pytest.raises(ValueError, match="mlp.gate_proj.weight: missing"):
        tilegen.blockwise_layer(x, missing, config)
    with pytest.raises(ValueError, match="x: expected"):
        tilegen.blockwise_layer(x[:, :-1], weights, config)
    with pytest.raises(ValueError, match="heads_q"):
        LayerConfig(d_model=D_MODEL, heads_q=3, heads_kv=2, head_dim=16, d_ffn=D_FFN)
    with pytest.raises(ValueError, match=r"self_attn.o_proj.weight: expected shape"):
        BlockwiseLayer(config).load_weights({**weights, "self_attn.o_proj.weight": torch.ones(40, 40)})


@pytest.mark.parametrize("name, value, exc, message", [
    ("self_attn.q_proj.weight", torch.zeros(64), ValueError,
     r"self_attn.q_proj.weight: expected a 2-d weight \[out, in\], got shape \(64,\)"),
    ("self_attn.q_proj.weight", torch.zeros(64, 40, 1), ValueError, "self_attn.q_proj.weight: expected a 2-d weight"),
    ("mlp.up_proj.weight", None, TypeError, "mlp.up_proj.weight: expected a tensor, got NoneType"),
    ("self_attn.q_proj.weight", [[0.0] * 40] * 64, TypeError, "self_attn.q_proj.weight: expected a tensor, got list"),
    ("self_attn.k_proj.weight", torch.zeros(8, 40), ValueError,
     "self_attn.k_proj.weight: 8 rows, not a positive multiple of the head dim 16"),
], ids=["q-1d", "q-3d", "up-none", "q-list", "k-fewer-rows-than-a-head"])
def test_weights_the_config_is_read_from_are_named(name, value, exc, message, device):
    """A layer built from its weights (from_llama, or blockwise_layer given heads_q) reads the widths off them: a
    weight that is no matrix, or a k_proj whose rows make no whole KV head, is named, not unpacked into a bare error."""
    config = LayerConfig(d_model=D_MODEL, heads_q=4, heads_kv=2, head_dim=16, d_ffn=D_FFN)
    weights = {**layer_weights(config, torch.float32, device), name: value}
    with pytest.raises(exc, match=message):
        tilegen.BlockwiseLayer.from_llama(weights, heads_q=4)
    with pytest.raises(exc, match=message):
        tilegen.blockwise_layer(_x((7, D_MODEL), torch.float32, device), weights, heads_q=4)


# ------------------------------------------------------------------ generated source and tuning

def test_generated_source_reads_constexpr_globals_only_and_compiles():
    from helpers import kernel_globals_are_constexpr

    source = source_for(BlockwiseFFNSpec(d_model=4096, d_ffn=14336, norm="layernorm", ffn="gelu_mlp"))
    assert "{{" not in source and "{%" not in source and "Glossary" in source
    compile(source, "<generated>", "exec")
    assert len(kernel_globals_are_constexpr(source)) == 4  # norm, the tile order, up, down


def test_the_kernels_compile_for_sm90(tmp_path):
    """What the interpreter runs, the H200's compiler must accept too (no GPU needed)."""
    pytest.importorskip("triton.backends.nvidia")
    script = textwrap.dedent("""
        import sys, types
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from tilegen.codegen import source_for
        from tilegen.families import spec_from_json
        spec = spec_from_json(sys.argv[1])
        path = sys.argv[2]
        open(path, "w").write(source_for(spec))
        module = types.ModuleType(spec.name)
        module.__file__ = path
        sys.modules[spec.name] = module
        exec(compile(open(path).read(), path, "exec"), module.__dict__)
        ptr = {"bf16": "*bf16", "fp32": "*fp32"}[spec.dtype]
        up, down = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64)
        for kind, constexprs in (("norm", {}), ("up", up), ("down", down)):
            kernel = getattr(module, f"_{spec.name}_{kind}_kernel")
            signature = {n: "constexpr" if n in constexprs else "fp32" if n == "eps" else ptr if n[0].isupper()
                         else "i32" for n in kernel.arg_names}
            triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 8, "num_stages": 3})
            print("compiled", kind)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for spec in (BlockwiseFFNSpec(d_model=4096, d_ffn=14336), BlockwiseFFNSpec(d_model=1000, d_ffn=2700,
                                                                                norm="layernorm", ffn="gelu_mlp",
                                                                                dtype="fp32")):
        done = subprocess.run([sys.executable, "-c", script, spec.to_json(), str(tmp_path / f"{spec.hash}.py")],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("compiled") == 3


def test_a_tune_stores_a_row_that_dispatch_and_the_op_use(tmp_path, monkeypatch, device):
    spec = _spec("rmsnorm", "swiglu", "fp32")
    path = tmp_path / "tuning.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(path))
    bucket = family_of(spec).buckets.of(TOKENS)
    with TuningDB(path) as db, Tuner(db, DEVICE, trials=3) as tuner:
        result = tuner.tune(spec, bucket)
    assert result.best is not None and result.statuses["ok"] == 3
    assert tuned_rows(**TuningKey.current(spec, DEVICE).variant_fields()) == {bucket: (result.best.config, str(path))}
    dispatch.reset()
    choice = dispatch.table_for(spec, DEVICE).choose(TOKENS)
    assert (choice.config, choice.source) == (result.best.config, str(path))
    # The layer's FFN runs through the same table.
    config = LayerConfig(d_model=D_MODEL, heads_q=4, heads_kv=2, head_dim=16, d_ffn=D_FFN)
    weights = layer_weights(config, torch.float32, device)
    x = _x((TOKENS, D_MODEL), torch.float32, device)
    out = tilegen.blockwise_layer(x, weights, config)
    assert relative_error(out, reference_layer(x, weights, config, compute_dtype=torch.float64))[0] < 1e-4
    assert json.loads(spec.to_json())["family"] == "blockwise_ffn"


_SDPA = torch.nn.functional.scaled_dot_product_attention


def test_the_benchmark_runs_its_smoke_shapes(tmp_path):
    from tilegen.bench import blockwise as bench

    out = tmp_path / "blockwise.json"
    assert bench.main(["--smoke", "--runs", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["provider"], r["tokens"]) for r in rows} == {(p, n) for p in bench.PROVIDERS for n in bench.SMOKE_LENGTHS}
    assert all(r["correct"] is True for r in rows)
    assert all(0 < r["error"] < 1e-2 for r in rows if r["provider"] == "tilegen")
    fits = json.loads(out.read_text())["fit"]
    assert [f["provider"] for f in fits] == list(bench.PROVIDERS) and all(f["runs"] for f in fits)
    # The replay skips attention's arithmetic only while it runs.
    assert torch.nn.functional.scaled_dot_product_attention is _SDPA


def test_the_gpu_defaults_are_feasible_on_an_h200():
    h200 = type(DEVICE)("NVIDIA H200", (9, 0), 132, 150_000_000_000, 232448)
    for spec in (BlockwiseFFNSpec(d_model=4096, d_ffn=14336), BlockwiseFFNSpec(d_model=4096, d_ffn=14336, dtype="fp32"),
                 BlockwiseFFNSpec(d_model=1024, d_ffn=4096, norm="layernorm", ffn="gelu_mlp", dtype="fp16")):
        family = family_of(spec)
        for _, config in family.default_rule(spec, h200):
            assert family.feasible(spec, config, h200) is None, config
        assert len(family.candidates(spec, h200)) > 20
    # What the rule refuses, it names.
    assert "spill" in family_of(spec).feasible(BlockwiseFFNSpec(d_model=64, d_ffn=64), Config(1024, 128, 256, 64, 64, 4, 3), h200)


# ------------------------------------------------------------- the layer's family: blockwise_layer

def _layer_spec(**changes):
    fields = dict(d_model=D_MODEL, d_ffn=D_FFN, heads_q=4, head_dim=16, q_per_kv=2, dtype="fp32")
    return BlockwiseLayerSpec(**{**fields, **changes})


def _code(source: str) -> str:
    """The generated module's code without its docstrings, comments and spec (which name every field)."""
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if not (isinstance(node, ast.Assign) and node.targets[0].id.startswith(
        "SPEC_"))]
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def _launch_keywords(spec):
    signature = inspect.signature(module_for(spec).launch)
    return {name for name, p in signature.parameters.items() if p.kind is p.KEYWORD_ONLY}


def test_the_layer_spec_is_a_registered_ir_spec():
    spec = _layer_spec(window=True, softcap=True, causal=False, rope=False, norm="layernorm", ffn="gelu_mlp")
    assert family_of(spec).name == "blockwise_layer" and family_of(spec).spec_type is BlockwiseLayerSpec
    back = spec_from_json(spec.to_json())
    assert back == spec and back.hash == spec.hash and type(back) is BlockwiseLayerSpec
    assert spec.name == "blockwise_layer_fp32_d40_f72_h4g2x16_layernorm_gelu_mlp_window_softcap_norope"
    assert "causal" not in json.loads(_layer_spec().to_json())  # fields at their default leave the hash alone
    # Every field is checked by name, attention's and the FFN's limits included (through their specs).
    for changes, field in ((dict(head_dim=20), "head_dim"), (dict(q_per_kv=3), "q_per_kv"),
                           (dict(norm="batchnorm"), "norm"), (dict(d_model=1 << 15), "d_model"),
                           (dict(causal=1), "causal"), (dict(heads_q=0), "heads_q")):
        with pytest.raises(SpecError) as caught:
            _layer_spec(**changes)
        assert caught.value.field == field, changes
    # A window whose right side is 0 is causal, whatever the config's flag says; an unbounded one is none.
    layer = LayerConfig(d_model=D_MODEL, heads_q=4, heads_kv=2, head_dim=16, d_ffn=D_FFN, causal=False)
    assert layer_spec(layer.replace(window=(7, 0)), torch.float32) == _layer_spec(window=True)
    assert layer_spec(layer.replace(window=(None, None)), torch.float32) == _layer_spec(causal=False)
    assert layer_spec(layer.replace(window=(None, 3)), torch.bfloat16) == _layer_spec(causal=False, window=True,
                                                                                       dtype="bf16")


def test_the_rendered_schedule_holds_only_what_its_spec_has():
    causal = source_for(_layer_spec())
    full = source_for(_layer_spec(causal=False, rope=False, norm="layernorm", ffn="gelu_mlp"))
    causal_window = source_for(_layer_spec(window=True, softcap=True))
    window = source_for(_layer_spec(causal=False, window=True))
    for source in (causal, full, causal_window, window):
        assert "{{" not in source and "{%" not in source and "Glossary" in source
        compile(source, "<generated>", "exec")
        # Host code over the ops it is handed: no kernel, and no other family imported by name.
        assert "triton" not in _code(source) and "tilegen" not in _code(source)
    causal, full, causal_window, window = map(_code, (causal, full, causal_window, window))
    # A causal layer projects K and V as its blocks come; any other projects them all first.
    progressive = "        _project_kv(xn, w, k_all, v_all, start, end"  # a call in the block loop
    assert progressive in causal and progressive in causal_window
    assert progressive not in full and progressive not in window
    assert "_project_kv(_input_norm(x[start:end]" in full and "_project_kv(_input_norm(" not in causal
    # RoPE only when on; the norm the spec has; the gate only for SwiGLU.
    assert "_rope(" in causal and "rope_theta" in causal
    assert "rope" not in full and "inv_freq" not in full
    assert "F.rms_norm" in causal and "layer_norm" not in causal
    assert "F.layer_norm" in full and "b_norm=w['post_attention_layernorm.bias']" in full and "rms_norm" not in full
    assert "w_gate=" in causal and "w_gate=" not in full
    # The keys a block sees, and the window arithmetic only where a window is.
    assert "causal=True" in causal and "window" not in causal
    assert "causal=True" not in full and "window" not in full and "k0, k1 = (0, n_tokens)" in full
    assert "window=(window_left, 0)" in causal_window and "shift" not in causal_window
    assert "shift = k1 - end" in window and "window=(left + shift, right - shift)" in window
    assert "softcap=softcap" in causal_window and "softcap" not in causal
    # launch() takes exactly the numbers its spec's code reads.
    ops = {"attention", "blockwise_ffn", "block_q", "eps", "scale"}
    assert _launch_keywords(_layer_spec()) == ops | {"rope", "rope_theta"}
    assert _launch_keywords(_layer_spec(causal=False, rope=False)) == ops
    assert _launch_keywords(_layer_spec(window=True, softcap=True)) == ops | {"rope", "rope_theta", "softcap",
                                                                              "window_left"}
    assert _launch_keywords(_layer_spec(causal=False, window=True, rope=False)) == ops | {"window_left", "window_right"}


LAYER_LENGTHS = [
    pytest.param(dict(causal=True, heads_q=4, heads_kv=2), torch.float32, id="causal-gqa-fp32"),
    pytest.param(dict(causal=True, heads_q=4, heads_kv=2, window=(50, 0), softcap=5.0), torch.bfloat16,
                 id="causal-window50-softcap-gqa-bf16"),
    pytest.param(dict(causal=False, heads_q=4, heads_kv=1, window=(30, 20), softcap=5.0, norm="layernorm",
                      ffn="gelu_mlp"), torch.float32, id="window30-20-softcap-mqa-ln-gelu-fp32"),
]


@pytest.mark.parametrize("options,dtype", LAYER_LENGTHS)
def test_the_generated_schedule_matches_the_reference_at_lengths_off_the_blocks(options, dtype, device):
    config = LayerConfig(d_model=24, head_dim=16, d_ffn=40, **options)
    weights = layer_weights(config, dtype, device, seed=3)
    for n in (1, 17, 257):  # the default block (32 under the interpreter) divides none of them
        x = _x((n, 24), dtype, device, seed=n)
        ref = reference_layer(x, weights, config, compute_dtype=torch.float64)
        out = tilegen.blockwise_layer(x, weights, config, out=torch.full_like(x, math.nan))
        assert relative_error(out, ref)[0] < TOL[dtype], n
        assert relative_error(out - x, ref - x.double())[0] < TOL[dtype], n


def test_the_reference_at_chosen_rows_is_the_whole_reference_there(device):
    for options in (dict(causal=True), dict(causal=False, window=(5, 3), softcap=5.0), dict(causal=False)):
        config = LayerConfig(d_model=D_MODEL, heads_q=4, heads_kv=2, head_dim=16, d_ffn=D_FFN, **options)
        weights = layer_weights(config, torch.float32, device)
        x = _x((TOKENS, D_MODEL), torch.float32, device)
        rows = torch.tensor([0, 1, 16, 30, TOKENS - 1])
        whole = reference_layer(x, weights, config, compute_dtype=torch.float64)
        torch.testing.assert_close(reference_layer(x, weights, config, compute_dtype=torch.float64, rows=rows),
                                   whole[rows], rtol=1e-12, atol=1e-12)


def test_the_reference_takes_a_batch_of_no_sequence_as_the_layer_does(device):
    for rope_theta in (10000.0, None):
        config = LayerConfig(d_model=D_MODEL, heads_q=4, heads_kv=2, head_dim=16, d_ffn=D_FFN, rope_theta=rope_theta)
        weights = layer_weights(config, torch.float32, device)
        x = _x((0, 5, D_MODEL), torch.float32, device)
        assert tilegen.blockwise_layer(x, weights, config, block=BLOCK).shape == x.shape
        for rows in (None, torch.tensor([0, 4])):
            ref = reference_layer(x, weights, config, compute_dtype=torch.float64, rows=rows)
            assert ref.shape == (0, 5 if rows is None else 2, D_MODEL) and ref.dtype == torch.float64


def test_the_reference_takes_a_scale_of_zero_or_below(device):
    """A config's scale need only be finite: the reference layer at scale 0 or below is the layer's function there
    (its attention at chosen rows, which computes the scores as they are), not NaN, and so is the layer."""
    for scale in (-0.5, 0.0):
        config = LayerConfig(d_model=D_MODEL, heads_q=4, heads_kv=2, head_dim=16, d_ffn=D_FFN, scale=scale)
        weights = layer_weights(config, torch.float32, device)
        x = _x((TOKENS, D_MODEL), torch.float32, device)
        whole = reference_layer(x, weights, config, compute_dtype=torch.float64)
        at_rows = reference_layer(x, weights, config, compute_dtype=torch.float64, rows=torch.arange(TOKENS))
        torch.testing.assert_close(whole, at_rows, rtol=1e-12, atol=1e-12)
        out = tilegen.blockwise_layer(x, weights, config, block=16)
        assert relative_error(out - x, whole - x.double())[0] < TOL[torch.float32], scale


def test_the_layer_problem_poisons_checks_and_samples_rows(monkeypatch):
    from tilegen.layers.family import problem as layer_problem

    spec = _layer_spec(causal=False, window=True, softcap=True)
    family = family_of(spec)
    problem = family.problem(spec, 64, on_gpu=not DEVICE.is_interpreter)
    assert problem.layer().window is not None and problem.layer().softcap is not None
    assert family.buckets.of(problem.tokens) == 64 and problem.flops() > 0 and problem.bytes_moved() > 0
    inputs = problem.inputs(seed=0)
    outputs = problem.outputs(inputs)
    assert problem.check(inputs, outputs) == (math.inf, math.inf)  # unwritten never passes
    problem.launch(module_for(spec), family.default_config(spec, DEVICE, 64), inputs, outputs)
    assert problem.check(inputs, outputs)[0] < problem.tolerance
    # Past _CHECK_ALL tokens only sampled rows are compared (every row is checked for NaN).
    monkeypatch.setattr(layer_problem, "_CHECK_ALL", 8)
    monkeypatch.setattr(layer_problem, "_CHECK_EDGE", 2)
    monkeypatch.setattr(layer_problem, "_CHECK_STRIDE_ROWS", 4)
    rows = problem.check_rows()
    assert rows[0] == 0 and rows[-1] == problem.tokens - 1 and 4 < len(rows) < problem.tokens
    assert problem.check(inputs, outputs)[0] < problem.tolerance
    skipped = next(i for i in range(problem.tokens) if i not in rows.tolist())
    spoiled = outputs[0].clone()
    spoiled[skipped, 0] = math.nan
    assert problem.check(inputs, (spoiled,)) == (math.inf, math.inf)
    spoiled = outputs[0].clone()
    spoiled[int(rows[3])] += 0.5
    assert problem.check(inputs, (spoiled,))[0] > problem.tolerance


def test_the_gpu_layer_defaults_are_feasible_and_untuned_blocks_fill_the_gpu():
    h200 = type(DEVICE)("NVIDIA H200", (9, 0), 132, 150_000_000_000, 232448)
    spec = family_of(_layer_spec()).presets["llama3-8b-layer"]
    family = family_of(spec)
    assert family.default_config(spec, h200, 512).block_q == family.default_config(spec, h200, 65536).block_q == 4096
    assert [c.block_q for c in family.candidates(spec, h200)] == [2048, 4096, 8192, 16384]
    small = type(DEVICE)("small", (8, 0), 20, 2_000_000_000, 101376)
    assert "of the device's 2 GB" in family.feasible(spec, LayerBlock(16384), small)


def test_tune_the_tiny_preset_and_the_layer_runs_its_row(tmp_path, monkeypatch, device):
    """``tilegen tune --preset tiny-layer`` writes a row; ``db list`` shows it; the layer runs its block."""
    from typer.testing import CliRunner

    from tilegen.cli import app
    from tilegen.cli.spec_args import presets

    spec = presets()["tiny-layer"]
    path = tmp_path / "tuning.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(path))
    tuned = CliRunner().invoke(app, ["tune", "--preset", "tiny-layer", "--sizes", "16", "--trials", "2",
                                     "--db", str(path)])
    assert tuned.exit_code == 0, tuned.output
    listed = CliRunner().invoke(app, ["db", "--db", str(path), "list"], env={"COLUMNS": "300"})
    assert listed.exit_code == 0 and spec.hash in listed.stdout and "block_q" in listed.stdout, listed.output
    rows = tuned_rows(**TuningKey.current(spec, DEVICE).variant_fields())
    assert list(rows) == [16] and rows[16][1] == str(path)

    dispatch.reset()
    config = LayerConfig(d_model=spec.d_model, heads_q=spec.heads_q, heads_kv=spec.heads_kv, head_dim=spec.head_dim,
                         d_ffn=spec.d_ffn)
    assert layer_spec(config, torch.float32) == spec
    weights = layer_weights(config, torch.float32, device)
    x = _x((13, spec.d_model), torch.float32, device)
    choice = explain_layer(x, weights, config)
    assert (choice.config, choice.source, choice.bucket, choice.tuned_bucket) == (rows[16][0], str(path), 16, 16)
    # The generated schedule is launched with that row's block.
    launcher = dispatch.launcher_for(spec)
    launched = []
    launch = launcher.direct
    monkeypatch.setattr(launcher, "direct", lambda *args, **kwargs: launched.append(kwargs["block_q"]) or launch(
        *args, **kwargs))
    out = tilegen.blockwise_layer(x, weights, config)
    assert launched == [choice.config.block_q]
    assert relative_error(out, reference_layer(x, weights, config, compute_dtype=torch.float64))[0] < 1e-4
    tilegen.blockwise_layer(x, weights, config, block=5)  # an explicit block wins over the row
    assert launched[-1] == 5


# ------------------------------------------------------------------------------ GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_layer_matches_the_reference_on_gpu(causal):
    config = LayerConfig(d_model=1024, heads_q=8, heads_kv=2, head_dim=128, d_ffn=2816, causal=causal,
                         rope_theta=500000.0)
    weights = layer_weights(config, torch.bfloat16, "cuda")
    x = _x((3000, 1024), torch.bfloat16, "cuda")
    ref = reference_layer(x, weights, config, compute_dtype=torch.float64)
    for block in (None, 1024, 777):
        out = tilegen.blockwise_layer(x, weights, config, block=block)
        assert relative_error(out, ref)[0] < 1e-2 and relative_error(out - x, ref - x.double())[0] < 1e-2


@pytest.mark.gpu
def test_the_ffn_kernels_on_gpu_with_the_default_and_sampled_configs():
    spec = BlockwiseFFNSpec(d_model=4096, d_ffn=14336)
    family = family_of(spec)
    problem = family.problem(spec, 4096, on_gpu=True, tokens=3001)
    inputs = problem.inputs(seed=0)
    candidates = family.candidates(spec, DEVICE)
    for config in [family.default_config(spec, DEVICE, 4096), *candidates[:: max(1, len(candidates) // 6)]]:
        outputs = problem.outputs(inputs)
        problem.launch(module_for(spec), config, inputs, outputs)
        assert problem.check(inputs, outputs)[0] < problem.tolerance, config


def test_under_vmap_or_fake_tensors_the_op_runs(device):
    """blockwise_ffn launched on the tensors as given: under torch.func.vmap torch's "Cannot access storage of
    BatchedTensorImpl". Now each sample runs through tilegen::blockwise_ffn, and fakes get its fake shapes."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    spec = BlockwiseFFNSpec(d_model=16, d_ffn=24, norm="rmsnorm", ffn="swiglu", dtype="fp32")
    w = random_weights(spec, torch.Generator().manual_seed(0), device, torch.float32)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)).to(device)

    def ffn(x):
        return tilegen.blockwise_ffn(x, w_norm=w.w_norm, w_up=w.w_up, w_down=w.w_down, w_gate=w.w_gate)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "no batching rule, performance drop"
        got = torch.func.vmap(ffn)(torch.stack([x, x.flip(0)]))
    assert torch.equal(got[0], ffn(x)) and torch.equal(got[1], ffn(x.flip(0)))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = ffn(mode.from_tensor(x))
    assert isinstance(fake, FakeTensor) and fake.shape == x.shape
