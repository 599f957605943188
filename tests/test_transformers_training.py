"""tilegen trains inside a transformers Llama: attention through ``AttentionInterface``
(``tilegen.integrations.transformers``), and ``BlockwiseLayer.from_llama`` in place of a ``LlamaDecoderLayer``.

Tolerance: the bf16 noise floor. Every model and layer here holds bf16-representable weights, and the
reference is the same transformers model (or layer) run in fp32 on them, TF32 off. The floor of a quantity
(the loss, the output, the gradient of the input or of a parameter) is the relative error
``||got - ref|| / ||ref||`` that transformers' own attention reaches in bf16 (eager and SDPA for the model,
the larger of the two; SDPA for the layer). tilegen in bf16 must stay within ``FACTOR`` = 2 times that floor
(the same two tilegen's other bf16 gradient tests allow), or within bf16's unit roundoff 2**-8 where the
floor is smaller still. Everything but attention is the same code in all of them, so a wrong mask, scale,
head grouping or backward shows as errors many times the floor.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding  # noqa: E402

from tilegen import BlockwiseLayer  # noqa: E402
from tilegen.integrations import transformers as tilegen_hf  # noqa: E402

FACTOR = 2.0
BF16_UNIT = 2.0 ** -8

BATCH, TOKENS, LAYERS = 2, 256, 4
DIMS = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
            rms_norm_eps=1e-5,
            # Above the default 0.02, so that attention scores spread and the softmax is far from uniform.
            initializer_range=0.05)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tilegen_hf.register()


@pytest.fixture(autouse=True)
def _ieee_fp32():
    """The fp32 reference runs its matmuls in full fp32, not TF32."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(saved)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    ref = ref.double()
    return float((got.double() - ref).norm() / ref.norm())


def _config(impl: str) -> LlamaConfig:
    config = LlamaConfig(**DIMS)
    config._attn_implementation = impl
    return config


def _model(impl: str, state: dict[str, torch.Tensor], dtype: torch.dtype) -> LlamaForCausalLM:
    model = LlamaForCausalLM(_config(impl))
    assert model.config._attn_implementation == impl
    model.load_state_dict(state)
    return model.to(device="cuda", dtype=dtype).train()


def _bf16_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config("eager"))
    return {name: t.bfloat16().float() for name, t in model.state_dict().items()}


def _loss_and_grads(model: LlamaForCausalLM, ids: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[name] = p.grad.detach().float()
    return loss.detach().float(), grads


def _within_floor(errors: dict[str, float], floors: dict[str, float]) -> list[str]:
    return [f"{name}: {errors[name]:.3g} against a floor of {floors[name]:.3g}"
            for name in errors if errors[name] > max(FACTOR * floors[name], BF16_UNIT)]


def _ids(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, DIMS["vocab_size"], (BATCH, TOKENS), generator=gen).cuda()


def test_llama_trains_with_tilegen_attention_at_the_bf16_noise_floor(monkeypatch):
    state = _bf16_state()
    ids = _ids()
    ref_loss, ref_grads = _loss_and_grads(_model("eager", state, torch.float32), ids)

    errors = {}
    for impl in ("eager", "sdpa", "tilegen"):
        calls = []
        if impl == "tilegen":
            real = tilegen_hf.attention_seq_major

            def counting(*args, **kwargs):
                calls.append(kwargs["causal"])
                return real(*args, **kwargs)

            monkeypatch.setattr(tilegen_hf, "attention_seq_major", counting)
        loss, grads = _loss_and_grads(_model(impl, state, torch.bfloat16), ids)
        if impl == "tilegen":
            # tilegen ran every layer, causal: the model did not fall back to another implementation.
            assert calls == [True] * LAYERS
        errors[impl] = {"loss": _rel(loss, ref_loss), **{name: _rel(g, ref_grads[name]) for name, g in grads.items()}}

    floors = {name: max(errors["eager"][name], errors["sdpa"][name]) for name in errors["tilegen"]}
    assert set(floors) == {"loss", *ref_grads}
    bad = _within_floor(errors["tilegen"], floors)
    assert not bad, "tilegen bf16 beyond the bf16 noise floor:\n" + "\n".join(bad)


def test_a_padded_batch_runs_ragged_at_the_bf16_noise_floor(monkeypatch):
    state = _bf16_state()
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    mask[1, TOKENS - 5:] = 0  # right padding
    real = mask.bool()

    def logits(impl, dtype):
        with torch.no_grad():
            return _model(impl, state, dtype).eval()(input_ids=ids, attention_mask=mask, use_cache=False).logits

    ref = logits("eager", torch.float32)
    calls = []
    varlen = tilegen_hf.padded_call  # varlen_attention_padded with the offsets' key the mask's layout keeps
    monkeypatch.setattr(tilegen_hf, "padded_call", lambda *a, **kw: calls.append(1) or varlen(*a, **kw))
    got = logits("tilegen", torch.bfloat16)
    assert calls == [1] * LAYERS
    floor = max(_rel(logits(impl, torch.bfloat16)[real], ref[real]) for impl in ("eager", "sdpa"))
    error = _rel(got[real], ref[real])
    assert error <= max(FACTOR * floor, BF16_UNIT), f"{error:.3g} against a floor of {floor:.3g}"


def test_a_mask_without_padding_runs_as_plain_causal():
    model = _model("tilegen", _bf16_state(), torch.bfloat16).eval()
    ids = _ids()
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        ones = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    assert torch.equal(plain, ones)


def _rope_theta(config: LlamaConfig) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # newer transformers keep it in rope_parameters
        theta = config.rope_parameters["rope_theta"]
    return float(theta)


@pytest.mark.parametrize("block", [None, 64], ids=["default-block", "block64"])
def test_blockwise_layer_trains_in_place_of_a_llama_decoder_layer(block):
    # SDPA: with no mask the transformers layer is causal through module.is_causal (eager would attend to all).
    config = _config("sdpa")
    torch.manual_seed(0)
    ref_layer = LlamaDecoderLayer(config, layer_idx=0)
    with torch.no_grad():
        for p in ref_layer.parameters():
            p.copy_(p.bfloat16().float())
    ref_layer = ref_layer.cuda().train()
    hf_layer = copy.deepcopy(ref_layer).to(torch.bfloat16)
    tg_layer = BlockwiseLayer.from_llama(hf_layer, heads_q=DIMS["num_attention_heads"],
                                         heads_kv=DIMS["num_key_value_heads"], eps=config.rms_norm_eps,
                                         rope_theta=_rope_theta(config), block=block)
    assert {name for name, _ in tg_layer.named_parameters()} == {name for name, _ in ref_layer.named_parameters()}

    rotary = LlamaRotaryEmbedding(config=config).cuda()
    positions = torch.arange(TOKENS, device="cuda")[None]
    gen = torch.Generator().manual_seed(2)
    x32 = torch.randn(BATCH, TOKENS, DIMS["hidden_size"], generator=gen).bfloat16().float().cuda()
    dy = torch.randn(BATCH, TOKENS, DIMS["hidden_size"], generator=gen).bfloat16().float().cuda()

    def run_transformers(layer, dtype):
        x = x32.detach().clone().to(dtype).requires_grad_()
        cos, sin = rotary(x, positions)
        y = layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        y = y[0] if isinstance(y, tuple) else y  # older transformers return a tuple
        (y.float() * dy).sum().backward()
        return y.detach().float(), x.grad.float(), {name: p.grad.float() for name, p in layer.named_parameters()}

    ref_y, ref_dx, ref_dw = run_transformers(ref_layer, torch.float32)
    hf_y, hf_dx, hf_dw = run_transformers(hf_layer, torch.bfloat16)

    x = x32.detach().clone().bfloat16().requires_grad_()
    y = tg_layer(x)
    (y.float() * dy).sum().backward()
    tg_dw = {name: p.grad.float() for name, p in tg_layer.named_parameters()}

    # The layer's own contribution (out - x): the residual would dilute an error in it.
    errors = {"out - x": _rel(y.detach().float() - x32, ref_y - x32), "x.grad": _rel(x.grad, ref_dx),
              **{name: _rel(g, ref_dw[name]) for name, g in tg_dw.items()}}
    floors = {"out - x": _rel(hf_y - x32, ref_y - x32), "x.grad": _rel(hf_dx, ref_dx),
              **{name: _rel(g, ref_dw[name]) for name, g in hf_dw.items()}}
    bad = _within_floor(errors, floors)
    assert not bad, "BlockwiseLayer bf16 beyond the bf16 noise floor:\n" + "\n".join(bad)
