"""The blockwise layer trains: BPT's block-by-block backward (tilegen.layers.train) against autograd of
the float64 reference layer, for loss and every gradient (input and weights)."""

from __future__ import annotations

import pytest
import torch

import tilegen
from tilegen.layers import BlockwiseLayer, LayerConfig, reference_layer
from tilegen.layers.family.problem import random_weights

from helpers import sizeable_weights

TINY = LayerConfig(d_model=64, heads_q=4, heads_kv=2, head_dim=16, d_ffn=160)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error; a gradient that is zero in exact arithmetic (q_proj's and k_proj's with one key: the
    softmax of one score is 1 whatever it is) is held to the tolerance in absolute terms (the other gradients
    here are 10-80 in norm), where fp32 rounding leaves ~1e-5."""
    assert not torch.isnan(got).any()
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1.0))


def _layer(config: LayerConfig, device, dtype=torch.float32, block=16, seed=0) -> BlockwiseLayer:
    weights = random_weights(config, torch.Generator().manual_seed(seed), device, dtype)
    return BlockwiseLayer(config, dtype=dtype, device=device, block=block).load_weights(weights)


def _against_reference(layer: BlockwiseLayer, x: torch.Tensor, tolerance: float) -> None:
    y = layer(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    (y * dy).sum().backward()
    w64 = {name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    y64 = reference_layer(x64, w64, layer.config)
    (y64 * dy.double()).sum().backward()
    errors = {"out": _rel(y.detach(), y64.detach()), "x": _rel(x.grad, x64.grad)}
    errors.update({name: _rel(p.grad, w64[name].grad) for name, p in layer.named_parameters()})
    assert max(errors.values()) < tolerance, errors


@pytest.mark.parametrize("options, tokens, block", [
    pytest.param({}, 33, 16, id="causal-rope-33-tokens-block16"),
    pytest.param({"causal": False}, 21, 8, id="full"),
    pytest.param({"window": (5, 0)}, 33, 8, id="causal-window"),
    pytest.param({"causal": False, "window": (4, 3), "softcap": 5.0, "rope_theta": None}, 19, 8,
                 id="two-sided-window-softcap-no-rope"),
    pytest.param({"norm": "layernorm", "ffn": "gelu_mlp"}, 17, 16, id="layernorm-gelu"),
    pytest.param({}, 1, 16, id="one-token"),
    # Attention's width (heads_q x head_dim) apart from d_model, as Gemma's and the tiny-layer preset's are
    pytest.param({"d_model": 32}, 17, 8, id="heads-wider-than-d-model"),
    pytest.param({"d_model": 96}, 17, 8, id="heads-narrower-than-d-model"),
])
def test_gradients_match_the_float64_reference(options, tokens, block, device):
    config = TINY.replace(**options)
    layer = _layer(config, device, block=block)
    x = torch.randn(tokens, config.d_model, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
    _against_reference(layer, x, 1e-4)


def test_use_deterministic_algorithms_takes_the_backward_without_atomics(device, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the layer's attention backward runs without atomics, as
    tilegen.attention's does; it passed deterministic=False whatever the flag said."""
    import tilegen.ops.attention_grad as grad_module

    ran = []
    real = grad_module.deterministic_config
    monkeypatch.setattr(grad_module, "deterministic_config", lambda *args: ran.append(real(*args)) or ran[-1])
    layer = _layer(TINY, device, block=8)
    x = torch.randn(17, TINY.d_model, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_()
    layer(x).sum().backward()
    assert not ran
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        layer(x).sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert ran and all(config.atomic_dq == 0 for config in ran)


def test_frozen_weights_get_no_gradient_sums_and_the_rest_stay_exact(device, monkeypatch):
    """Weights that want no gradient (a frozen backbone, adapters trained beside it) get no fp32 sum and no
    weight-gradient GEMM in the backward; x's gradient and the trained weights' stay exact."""
    from tilegen.layers import train

    layer = _layer(TINY, device, block=8)
    trained = {"mlp.down_proj.weight", "post_attention_layernorm.weight"}
    for name, p in layer.named_parameters():
        p.requires_grad_(name in trained)
    computed = []
    add = train._add_product
    monkeypatch.setattr(train, "_add_product",
                        lambda grads, name, a, b: (computed.append(name) if name in grads else None,
                                                   add(grads, name, a, b)))
    x = torch.randn(19, TINY.d_model, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
    y = layer(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    (y * dy).sum().backward()
    assert set(computed) == {"mlp.down_proj.weight"}, computed
    w64 = {name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    (reference_layer(x64, w64, layer.config) * dy.double()).sum().backward()
    for name, p in layer.named_parameters():
        assert (p.grad is not None) == (name in trained), name
        if p.grad is not None:
            assert _rel(p.grad, w64[name].grad) < 1e-4, name
    assert _rel(x.grad, x64.grad) < 1e-4


def test_the_ffn_recomputed_in_chunks_that_cut_across_blocks(device, monkeypatch):
    """The backward recomputes the FFN ffn_recompute_rows at a time inside each schedule block: chunks of 7
    rows in blocks of 16 leave ragged ends in every block, and the sum over chunks must still be exact."""
    from tilegen.layers import train

    monkeypatch.setattr(train, "ffn_recompute_rows", lambda config, itemsize: 7)
    layer = _layer(TINY, device, block=16)
    x = torch.randn(37, TINY.d_model, generator=torch.Generator().manual_seed(6)).to(device).requires_grad_()
    _against_reference(layer, x, 1e-4)


def test_ffn_recompute_rows_bound_the_chunk():
    from tilegen.layers.train import FFN_RECOMPUTE_BYTES, ffn_recompute_rows

    llama = LayerConfig(d_model=4096, heads_q=32, heads_kv=8, head_dim=128, d_ffn=14336)
    assert ffn_recompute_rows(llama, 2) == 2048  # 2048 x 14336 x 2 B = 56 MiB
    assert ffn_recompute_rows(llama, 4) == 1024
    assert ffn_recompute_rows(TINY, 4) == 4096  # a narrow FFN: the cap
    wide = llama.replace(d_ffn=1 << 22)
    assert ffn_recompute_rows(wide, 4) == 64  # past the budget, the floor
    for config, itemsize in ((llama, 2), (llama, 4)):
        assert ffn_recompute_rows(config, itemsize) * config.d_ffn * itemsize <= FFN_RECOMPUTE_BYTES


def test_a_batch_of_sequences(device):
    layer = _layer(TINY, device, block=8)
    x = torch.randn(2, 19, TINY.d_model, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_()
    _against_reference(layer, x, 1e-4)


def test_bf16_gradients_at_the_bf16_noise_floor(device):
    """bf16 against the float64 reference, no further off than the same reference layer run in bf16."""
    layer = _layer(TINY, device, dtype=torch.bfloat16, block=16)
    x = torch.randn(33, TINY.d_model, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    x.requires_grad_()
    y = layer(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y)
    (y * dy).sum().backward()
    w64 = {name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    (reference_layer(x64, w64, TINY) * dy.double()).sum().backward()
    w16 = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    x16 = x.detach().clone().requires_grad_()
    (reference_layer(x16, w16, TINY) * dy).sum().backward()
    for name, p in layer.named_parameters():
        floor = _rel(w16[name].grad, w64[name].grad)
        assert _rel(p.grad, w64[name].grad) <= max(2 * floor, 1e-2), name
    assert _rel(x.grad, x64.grad) <= max(2 * _rel(x16.grad, x64.grad), 1e-2)


def test_the_functional_layer_differentiates_a_weight_dict(device):
    weights = random_weights(TINY, torch.Generator().manual_seed(0), device, torch.float32)
    weights["mlp.down_proj.weight"].requires_grad_()
    x = torch.randn(9, TINY.d_model, generator=torch.Generator().manual_seed(6)).to(device)
    y = tilegen.blockwise_layer(x, weights, TINY, block=4)
    (grad,) = torch.autograd.grad(y.square().sum(), weights["mlp.down_proj.weight"])
    w64 = {name: t.detach().double().requires_grad_(name == "mlp.down_proj.weight") for name, t in weights.items()}
    (ref,) = torch.autograd.grad(reference_layer(x.double(), w64, TINY).square().sum(), w64["mlp.down_proj.weight"])
    assert _rel(grad, ref) < 1e-4


def test_a_module_holding_a_weight_as_a_buffer_trains_it_as_a_constant(device):
    """A frozen norm weight registered as a buffer is a weight of the layer all the same: the call trains the
    parameters and x, and the buffer gets no gradient."""
    layer = _layer(TINY, device)
    frozen = layer.input_layernorm.weight.detach().clone()
    del layer.input_layernorm.weight
    layer.input_layernorm.register_buffer("weight", frozen)
    x = torch.randn(11, TINY.d_model, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_()
    y = tilegen.blockwise_layer(x, layer, TINY, block=4)
    y.square().sum().backward()
    w64 = {name: t.detach().double().requires_grad_(name != "input_layernorm.weight")
           for name, t in layer.state_dict().items()}
    x64 = x.detach().double().requires_grad_()
    reference_layer(x64, w64, TINY).square().sum().backward()
    assert _rel(x.grad, x64.grad) < 1e-4
    for name, p in layer.named_parameters():
        assert _rel(p.grad, w64[name].grad) < 1e-4, name
    assert frozen.grad is None and "input_layernorm.weight" not in dict(layer.named_parameters())


def test_the_forward_keeps_nothing_of_the_ffn_width(device):
    """What autograd saves is the input and the weights; the attention output and LSE the backward replays are
    [tokens, heads_q * head_dim] and [heads_q, tokens]: no tensor as wide as the FFN."""
    layer = _layer(TINY, device, block=8)
    x = torch.randn(33, TINY.d_model, generator=torch.Generator().manual_seed(7)).to(device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = layer(x)
    assert all(TINY.d_ffn not in shape or shape in {(TINY.d_ffn, TINY.d_model), (TINY.d_model, TINY.d_ffn)}
               for shape in saved), saved
    recorder = y.grad_fn.recorders[0]
    assert recorder.out.shape == (33, TINY.heads_q * TINY.head_dim) and recorder.lse.shape == (TINY.heads_q, 33)


def test_double_backward_is_refused(device):
    layer = _layer(TINY, device, block=8)
    x = torch.randn(9, TINY.d_model, generator=torch.Generator().manual_seed(8)).to(device).requires_grad_()
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(layer(x).sum(), x, create_graph=True)


def test_mixed_dtypes_are_refused_by_name(device):
    layer = _layer(TINY, device)
    x = torch.randn(9, TINY.d_model, dtype=torch.bfloat16, device=device, requires_grad=True)
    with pytest.raises((TypeError, ValueError), match="input_layernorm.weight|dtype"):
        layer(x)


def test_an_empty_sequence_still_differentiates(device):
    """No rows, but x requires grad: the output has a grad_fn and every gradient comes back empty or zero."""
    layer = _layer(TINY, device, block=8)
    x = torch.randn(0, TINY.d_model, device=device, requires_grad=True)
    y = layer(x)
    assert y.grad_fn is not None and y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())


def test_trains_in_place_of_a_transformers_llama_layer(device):
    """BlockwiseLayer.from_llama(LlamaDecoderLayer) against that very layer under autograd, fp32: the loss and
    every gradient (input and each weight) agree to fp32 rounding (a wrong RoPE transpose, norm gradient or
    GQA sum shows as errors of 1e-2 and more)."""
    transformers = pytest.importorskip("transformers")
    if device != "cpu":
        pytest.skip("tiny fp32 CPU model, run under the interpreter; the GPU benchmark compares the bf16 layer")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                                      max_position_embeddings=64, attention_bias=False, mlp_bias=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    llama = LlamaDecoderLayer(config, layer_idx=0)
    sizeable_weights(llama)
    layer = BlockwiseLayer.from_llama(llama, heads_q=4, heads_kv=2, rope_theta=10000.0, eps=1e-5, block=16)
    tokens = 33
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(7))
    dy = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(8))

    x_ref = x.clone().requires_grad_()
    positions = torch.arange(tokens)[None]
    rotary = LlamaRotaryEmbedding(config=config)
    out = llama(x_ref[None], attention_mask=None, position_ids=positions,
                position_embeddings=rotary(x_ref[None], positions))
    y_ref = (out[0] if isinstance(out, tuple) else out)[0]
    loss_ref = (y_ref * dy).sum()
    loss_ref.backward()

    x_ours = x.clone().requires_grad_()
    loss = (layer(x_ours) * dy).sum()
    loss.backward()
    assert abs(float(loss) - float(loss_ref)) <= 1e-4 * abs(float(loss_ref))
    errors = {"x": _rel(x_ours.grad, x_ref.grad.double())}
    reference = dict(llama.named_parameters())
    errors.update({name: _rel(p.grad, reference[name].grad.double()) for name, p in layer.named_parameters()})
    assert set(errors) == {"x", *reference}
    assert max(errors.values()) < 1e-4, errors


def test_the_layer_in_a_compiled_model_runs_eagerly_with_the_same_gradients(device):
    """``torch.compile`` of a model holding the layer: the layer is a graph break (it runs eagerly, forward and
    backward, the graph around it compiled), so values and gradients are the eager ones; ``fullgraph=True`` says
    why it cannot take the layer."""
    layer = _layer(TINY, device, block=8)
    x = torch.randn(21, TINY.d_model, generator=torch.Generator().manual_seed(3)).to(device)

    def model(x):
        return layer(x * 0.5).square().mean()

    grads = []
    for run in (model, torch.compile(model, backend="aot_eager")):
        torch._dynamo.reset()
        leaf = x.clone().requires_grad_()
        loss = run(leaf)
        loss.backward()
        grads.append((loss.detach(), leaf.grad, [p.grad.clone() for p in layer.parameters()]))
        layer.zero_grad()
    (loss, dx, dw), (compiled_loss, compiled_dx, compiled_dw) = grads
    assert torch.equal(loss, compiled_loss) and torch.equal(dx, compiled_dx)
    assert all(torch.equal(a, b) for a, b in zip(dw, compiled_dw))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="tilegen.blockwise_layer runs eagerly under torch.compile"):
        torch.compile(model, backend="eager", fullgraph=True)(x)


def test_explain_layer_gives_the_block_a_training_call_runs(device, monkeypatch):
    """A training call takes at most MAX_TRAINING_BLOCK query rows a block whatever the table chose; explain_layer
    says so for such a call (a weight requiring grad), and gives the table's choice to an inference call. The cap is lowered
    below the interpreter's default block here, as the H200's rows of 16384 rows meet the cap of 4096 there."""
    from tilegen.layers import explain_layer, op
    from tilegen.layers import train

    monkeypatch.setattr(op, "MAX_TRAINING_BLOCK", 16)
    layer = _layer(TINY, device, block=None)
    weights = dict(layer.named_parameters())
    x = torch.randn(40, TINY.d_model, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():  # the parameters require grad: outside grad mode the call does not train
        assert explain_layer(x, weights, TINY).config.block_q > 16
    assert explain_layer(x, weights, TINY).config.block_q == 16
    rows = []
    real = train.attention
    monkeypatch.setattr(train, "attention", lambda q, k, v, **kw: rows.append(q.shape[2]) or real(q, k, v, **kw))
    layer(x).sum().backward()
    assert max(rows) == 16


def test_from_llama_reads_the_rope_base_and_eps_a_transformers_layer_holds(device):
    """A Llama 3 layer (rope_theta 500000, eps 1e-6) loaded without those options gets them from its own config, and
    its forward matches the module's; a RoPE of scaled frequencies (Llama 3.1's) is refused by name, unless
    rope_theta is passed."""
    transformers = pytest.importorskip("transformers")
    if device != "cpu":
        pytest.skip("tiny fp32 CPU model, run under the interpreter")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=500000.0,
                                      max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    llama = LlamaDecoderLayer(config, layer_idx=0)
    sizeable_weights(llama)
    layer = BlockwiseLayer.from_llama(llama, heads_q=4, block=16)
    assert (layer.config.rope_theta, layer.config.eps) == (500000.0, 1e-6)
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(7))
    positions = torch.arange(40)[None]
    with torch.no_grad():
        out = llama(x, attention_mask=None, position_ids=positions,
                    position_embeddings=LlamaRotaryEmbedding(config=config)(x, positions))
        want = (out[0] if isinstance(out, tuple) else out)[0]
        got = layer(x[0])
    assert _rel(got, want.double()) < 1e-4

    scaled = transformers.LlamaConfig(**{**config.to_dict(), "max_position_embeddings": 16384, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}})
    llama31 = LlamaDecoderLayer(scaled, layer_idx=0)
    with pytest.raises(NotImplementedError, match="source: its attention config's RoPE is of type 'llama3'"):
        BlockwiseLayer.from_llama(llama31, heads_q=4)
    assert BlockwiseLayer.from_llama(llama31, heads_q=4, rope_theta=500000.0).config.rope_theta == 500000.0


def test_from_llama_refuses_what_its_config_says_the_layer_would_compute_otherwise(device):
    """A transformers layer whose config the weights do not show: an MLP activation other than SiLU, attention
    dropout, or head counts other than the call's. Each would build a layer that differs from the module, so each
    is refused by name; the same config with SiLU, no dropout and its own head counts builds."""
    transformers = pytest.importorskip("transformers")
    if device != "cpu":
        pytest.skip("tiny fp32 CPU model, run under the interpreter")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    base = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=16)

    def llama(**changes):
        config = transformers.LlamaConfig(**{**base, **changes})
        config._attn_implementation = "sdpa"
        return LlamaDecoderLayer(config, layer_idx=0)

    with pytest.raises(NotImplementedError, match="source: its MLP's activation is 'gelu'"):
        BlockwiseLayer.from_llama(llama(hidden_act="gelu"), heads_q=4)
    with pytest.raises(NotImplementedError, match="attention_dropout=0.3"):
        BlockwiseLayer.from_llama(llama(attention_dropout=0.3), heads_q=4)
    with pytest.raises(ValueError, match="heads_q: 2, but the module's config has num_attention_heads=4"):
        BlockwiseLayer.from_llama(llama(), heads_q=2)
    with pytest.raises(ValueError, match="heads_kv: 1, but the module's config has num_key_value_heads=2"):
        BlockwiseLayer.from_llama(llama(), heads_q=4, heads_kv=1)
    layer = BlockwiseLayer.from_llama(llama(), heads_q=4, heads_kv=2)
    assert (layer.config.heads_q, layer.config.heads_kv, layer.config.ffn) == (4, 2, "swiglu")


def test_autocast_is_refused_by_name(device):
    """Under torch.autocast the layer's projections would come out in two dtypes; it says so, not attention."""
    layer = _layer(TINY, device)
    x = torch.randn(9, TINY.d_model, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        with pytest.raises(NotImplementedError, match="torch.autocast is not supported"):
            layer(x)


def test_the_module_trains_with_tied_parameters_and_a_weight_held_as_a_buffer(device):
    """A parameter tied under two names, and a norm weight frozen as a buffer, are weights of the module all the
    same: ``layer(x)`` reads each name, and the tied parameter's gradient is the sum of both uses."""
    layer = _layer(TINY, device, block=5)
    layer.mlp.up_proj.weight = layer.mlp.gate_proj.weight
    frozen = layer.input_layernorm.weight.detach().clone()
    del layer.input_layernorm.weight
    layer.input_layernorm.register_buffer("weight", frozen)
    x = torch.randn(17, TINY.d_model, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_()
    y = layer(x)
    y.square().sum().backward()
    w64 = {name: t.detach().double() for name, t in layer.state_dict().items()}
    for name, t in w64.items():
        t.requires_grad_(name != "input_layernorm.weight")
    w64["mlp.up_proj.weight"] = w64["mlp.gate_proj.weight"]
    x64 = x.detach().double().requires_grad_()
    y64 = reference_layer(x64, w64, TINY)
    y64.square().sum().backward()
    assert _rel(y.detach(), y64.detach()) < 1e-4 and _rel(x.grad, x64.grad) < 1e-4
    assert _rel(layer.mlp.gate_proj.weight.grad, w64["mlp.gate_proj.weight"].grad) < 1e-4
    for name, p in layer.named_parameters():
        assert _rel(p.grad, w64[name].grad) < 1e-4, name
    assert frozen.grad is None


def test_from_llama_reads_a_mistral_layer_s_sliding_window(device):
    """A Mistral layer's config holds a sliding window (each token sees itself and the ``sliding_window - 1`` tokens
    before it) that its weights cannot show: the layer built from it applies that window, and matches the module
    run with the window's mask past the window's length; an explicit ``window`` wins."""
    transformers = pytest.importorskip("transformers")
    if device != "cpu":
        pytest.skip("tiny fp32 CPU model, run under the interpreter")
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer, MistralRotaryEmbedding

    config = transformers.MistralConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, sliding_window=6,
                                        max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    mistral = MistralDecoderLayer(config, layer_idx=0)
    sizeable_weights(mistral)
    layer = BlockwiseLayer.from_llama(mistral, heads_q=4, block=8)
    assert layer.config.window == (5, 0)
    tokens = 19
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(7))
    positions = torch.arange(tokens)
    seen = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - 6)
    mask = torch.zeros(tokens, tokens).masked_fill(~seen, float("-inf"))[None, None]
    with torch.no_grad():
        out = mistral(x, attention_mask=mask, position_ids=positions[None],
                      position_embeddings=MistralRotaryEmbedding(config=config)(x, positions[None]))
        want = (out[0] if isinstance(out, tuple) else out)[0]
        got = layer(x[0])
    assert _rel(got, want.double()) < 1e-4
    assert BlockwiseLayer.from_llama(mistral, heads_q=4, window=None).config.window is None


def test_loading_two_values_into_a_tied_parameter_is_refused_by_name(device):
    """A parameter tied under two names takes one value: a source whose weights there differ is refused, naming
    both, where one of them would silently win; a source that agrees loads."""
    layer = _layer(TINY, device)
    layer.mlp.up_proj.weight = layer.mlp.gate_proj.weight
    weights = random_weights(TINY, torch.Generator().manual_seed(4), device, torch.float32)
    with pytest.raises(ValueError, match="mlp.up_proj.weight: tied to mlp.gate_proj.weight"):
        layer.load_weights(weights)
    weights["mlp.up_proj.weight"] = weights["mlp.gate_proj.weight"].clone()
    layer.load_weights(weights)
    assert torch.equal(layer.mlp.up_proj.weight, weights["mlp.gate_proj.weight"])
