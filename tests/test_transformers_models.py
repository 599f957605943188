"""Tiny transformers models with ``attn_implementation="tilegen"`` against the same models in transformers'
own attention (SDPA; eager for Gemma 2, which has no SDPA path), fp32, random weights: the logits of real
tokens within 1e-4 relative, with padding left and right, packed sequences, a cached decode, a sliding
window, softcap, gradients of padded and packed batches, 4-d masks, and the fallback for a mask tilegen
cannot serve.

Tolerance: both sides are fp32 with the same weights; only attention differs, and tilegen's fp32 kernel is
within about 1e-6 of a float64 reference, so 1e-4 leaves room for a few layers' accumulation and nothing
for a wrong mask, scale or window (those show as errors of 1e-2 and more). Padded positions are compared
for finiteness only: their values are arbitrary in transformers (tilegen gives zeros)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tilegen.integrations import transformers as tilegen_hf  # noqa: E402

# CPU models and inputs, so the interpreter's kernels: on a GPU machine the bf16 checks of
# tests/test_transformers_training.py run the compiled kernels instead.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tiny fp32 CPU models, run under the interpreter")

REL = 1e-4
VOCAB = 61
DIMS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
            # Above the default 0.02, so that scores spread and a wrong mask shows.
            initializer_range=0.2)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    tilegen_hf._warned.clear()
    yield
    tilegen_hf._warned.clear()


def _pair(config_cls, model_cls, reference: str = "sdpa", **extra):
    """(transformers' model, the same weights on tilegen), both eval, fp32."""
    torch.manual_seed(0)
    config = config_cls(**{**DIMS, **extra})
    config._attn_implementation = reference
    ref = model_cls(config).eval()
    model = tilegen_hf.use_tilegen(copy.deepcopy(ref))
    assert model.config._attn_implementation == "tilegen" and ref.config._attn_implementation == reference
    return ref, model


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return _pair(LlamaConfig, LlamaForCausalLM)


def _ids(batch, n, seed=1):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _rel(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


class _Calls:
    """Which tilegen op each attention call ran, and how many fell back."""

    def __init__(self, monkeypatch):
        self.ops = []
        # The dense calls go through attention_seq_major (tilegen.attention writing transformers' layout).
        # The ragged calls go through varlen_attention_padded (packed rows read in place; padded_call where the
        # mask's layout keeps the offsets' key) or, gathered, varlen_attention.
        for name, op in (("attention_seq_major", "attention"), ("varlen_attention", "varlen_attention"),
                         ("varlen_attention_padded", "varlen_attention"), ("padded_call", "varlen_attention")):
            real = getattr(tilegen_hf, name)

            def spy(*args, _real=real, _op=op, **kwargs):
                self.ops.append(_op)
                return _real(*args, **kwargs)

            monkeypatch.setattr(tilegen_hf, name, spy)
        real_decode = tilegen_hf._decode

        def decode(*args, **kwargs):  # a padded decoding step on PagedDecode, when it serves the call
            out = real_decode(*args, **kwargs)
            if out is not None:
                self.ops.append("decode")
            return out

        monkeypatch.setattr(tilegen_hf, "_decode", decode)


def _compare(ref, model, mask=None, real=None, **inputs):
    with torch.no_grad():
        want = ref(attention_mask=mask, **inputs).logits
        got = model(attention_mask=mask, **inputs).logits
    assert torch.isfinite(got).all()
    if real is None:
        real = torch.ones(got.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    assert _rel(got[real], want[real]) < REL
    return got


def test_no_padding_runs_the_dense_kernel(monkeypatch):
    ref, model = _llama()
    calls = _Calls(monkeypatch)
    _compare(ref, model, input_ids=_ids(2, 13))
    ones = torch.ones(2, 13, dtype=torch.long)
    _compare(ref, model, ones, input_ids=_ids(2, 13))
    assert calls.ops == ["attention"] * 4


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_runs_varlen(side, monkeypatch):
    ref, model = _llama()
    calls = _Calls(monkeypatch)
    ids = _ids(3, 11)
    mask = torch.ones_like(ids)
    if side == "left":
        mask[0, :4] = 0
        mask[2, :9] = 0
    else:
        mask[0, 7:] = 0
        mask[2, 2:] = 0
    _compare(ref, model, mask, input_ids=ids)
    assert calls.ops == ["varlen_attention"] * 2


def test_packed_sequences_by_position_ids_and_by_flash_kwargs(monkeypatch):
    ref, model = _llama()
    lengths = [5, 9, 3]
    ids = _ids(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        # Each sequence alone, in transformers' attention: what packing must reproduce.
        want = torch.cat([ref(input_ids=part).logits for part in ids.split(lengths, dim=1)], dim=1)
        # No cache: transformers reads restarting position ids as packing only then (training).
        sdpa = ref(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert _rel(sdpa, want) < REL

    calls = _Calls(monkeypatch)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        cu = torch.tensor([0, 5, 14, 17])
        # The keyword arguments transformers' padding-free collator adds; no position ids restarting here,
        # so the offsets alone must separate the sequences.
        by_kwargs = model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9,
                         use_cache=False).logits
    assert calls.ops == ["varlen_attention"] * 4
    assert _rel(got, want) < REL
    assert _rel(by_kwargs, want) < REL


def test_cached_greedy_decode_of_a_left_padded_batch(monkeypatch):
    ref, model = _llama()
    ids = _ids(2, 9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    calls = _Calls(monkeypatch)
    with torch.no_grad():
        want = ref.generate(**kwargs)
        got = model.generate(**kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert _rel(torch.stack(got.logits), torch.stack(want.logits)) < REL
    # The prefill with the padded row is ragged; every decoding step after it reads transformers' cache in place
    # through PagedDecode; 2 layers each.
    assert calls.ops == ["varlen_attention"] * 2 + ["decode"] * 6


def test_cached_decode_without_padding_is_bottom_right_causal(monkeypatch):
    ref, model = _llama()
    ids = _ids(1, 10)
    calls = _Calls(monkeypatch)
    with torch.no_grad():
        outs = []
        for m in (ref, model):
            first = m(input_ids=ids[:, :7], use_cache=True)
            # Three queries against ten keys: the last 3 rows of the causal mask.
            outs.append(m(input_ids=ids[:, 7:], cache=first.past_key_values, use_cache=True).logits)
        full = ref(input_ids=ids).logits[:, 7:]
    assert _rel(outs[1], outs[0]) < REL and _rel(outs[1], full) < REL
    assert calls.ops == ["attention"] * 4


@pytest.mark.parametrize("padded", [False, True])
def test_mistral_sliding_window(padded, monkeypatch):
    from transformers import MistralConfig, MistralForCausalLM
    ref, model = _pair(MistralConfig, MistralForCausalLM, sliding_window=4)
    ids = _ids(2, 15)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
    calls = _Calls(monkeypatch)
    _compare(ref, model, mask, input_ids=ids)
    # A window of 4 is narrower than the sequence: without it the logits differ far beyond REL.
    assert calls.ops == ["varlen_attention" if padded else "attention"] * 2


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_mistral_sliding_window_decode_of_a_left_padded_batch(cache):
    from transformers import MistralConfig, MistralForCausalLM
    ref, model = _pair(MistralConfig, MistralForCausalLM, sliding_window=4)
    ids = _ids(2, 9)  # the prompt is longer than the window: the cache keeps fewer keys than the mask has
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True, cache_implementation=cache)
    with torch.no_grad():
        want = ref.generate(**kwargs)
        got = model.generate(**kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert _rel(torch.stack(got.logits), torch.stack(want.logits)) < REL


def test_mistral_static_cache_decode_past_a_window_longer_than_the_prompt():
    """With a static cache, generate builds each step's mask ahead of the forward and hands the builder's 2-d mask,
    cut to the window's keys (columns from kv_offset on), back to the model, which builds its mask from it again: the
    builder must place that cut mask's columns as it cut them. A window longer than the prompt keeps padding in the
    cut mask once decoding passes it."""
    from transformers import MistralConfig, MistralForCausalLM
    ref, model = _pair(MistralConfig, MistralForCausalLM, sliding_window=8)
    ids = _ids(2, 7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True, cache_implementation="static")
    with torch.no_grad():
        want = ref.generate(**kwargs)
        got = model.generate(**kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert _rel(torch.stack(got.logits), torch.stack(want.logits)) < REL


@pytest.mark.parametrize("model", ["llama", "qwen2-sliding"])
def test_static_cache_greedy_decode_without_padding(model):
    """A static cache holds more slots than it has written; with no padding transformers hands the mask builder no
    mask, and the slots past the last query must still be cut (else the bottom-right causal call reads them)."""
    if model == "llama":
        ref, model = _llama()
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM
        ref, model = _pair(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, sliding_window=4,
                           max_window_layers=1, layer_types=["full_attention", "sliding_attention"])
    ids = _ids(2, 9)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                  pad_token_id=0, return_dict_in_generate=True, output_logits=True, cache_implementation="static")
    with torch.no_grad():
        want = ref.generate(**kwargs)
        got = model.generate(**kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert _rel(torch.stack(got.logits), torch.stack(want.logits)) < REL


def test_a_static_cache_forward_without_a_mask():
    from transformers import StaticCache
    ref, model = _llama()
    ids = _ids(2, 7)
    with torch.no_grad():
        want, got = (m(input_ids=ids, cache=StaticCache(config=m.config, max_cache_len=16)).logits
                     for m in (ref, model))
    assert _rel(got, want) < REL


@pytest.mark.parametrize("kind", ["2-d", "4-d"])
def test_a_static_cache_decoding_loop_with_a_mask_of_the_caches_length(kind, monkeypatch):
    """A decoding loop over a static cache may pass a mask of the cache's full length, zeros on the slots not written
    yet (a 2-d one, or a 4-d one of its own): the queries sit at the cache position, not on the mask's last columns.
    Row 1 is left-padded."""
    from transformers import StaticCache
    ref, model = _llama()
    ids, length = _ids(2, 5), 12
    padding = torch.ones(2, length, dtype=torch.bool)
    padding[1, :2] = False

    def mask(start, n):  # the slots written once n more tokens are
        written = padding & (torch.arange(length) < start + n)
        if kind == "2-d":
            return written.long()
        causal = torch.arange(length)[None] <= torch.arange(start, start + n)[:, None]
        return causal[None, None] & written[:, None, None, :]

    steps = []
    calls = _Calls(monkeypatch)
    for m in (ref, model):
        cache = StaticCache(config=m.config, max_cache_len=length)
        with torch.no_grad():
            out = m(input_ids=ids, attention_mask=mask(0, 5), cache=cache, use_cache=True)
            logits = [out.logits[:, -1]]
            for t in range(5, 8):
                out = m(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask(t, 1), cache=cache,
                        use_cache=True)
                logits.append(out.logits[:, -1])
        steps.append(torch.stack(logits, 1))
    assert torch.isfinite(steps[1]).all() and _rel(steps[1], steps[0]) < REL
    assert len(calls.ops) == 8  # every call in tilegen, none fell back


def test_exaone4_full_attention_layers_pass_no_window():
    """EXAONE 4's global layers pass sliding_window=None while their module holds the config's window: the call's
    None wins, as in transformers' own attention."""
    from transformers import Exaone4Config, Exaone4ForCausalLM
    ref, model = _pair(Exaone4Config, Exaone4ForCausalLM, sliding_window=4, sliding_window_pattern=2)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [4, 4]
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    # 12 tokens, three times the window: a windowed global layer differs far beyond REL.
    _compare(ref, model, input_ids=_ids(2, 12))


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(0)
    config = BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
                        init_std=0.2, attn_implementation="sdpa")
    ref = BartForConditionalGeneration(config).eval()
    return ref, tilegen_hf.use_tilegen(copy.deepcopy(ref))


def test_cross_attention_with_as_many_decoder_as_encoder_tokens():
    """The encoder's padding mask pads cross-attention's keys only: with the decoder as long as the encoder (seq2seq
    with fixed padding), every decoder row is real and attends the real encoder tokens, in tilegen's own call and in
    the eager fallback that output_attentions takes."""
    ref, model = _bart()
    ids = _ids(2, 6)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # the encoder's row 1 is right-padded
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=_ids(2, 6, seed=2))
    with torch.no_grad():
        want = ref(**inputs).logits
        got = model(**inputs).logits
    assert torch.isfinite(got).all() and _rel(got, want) < REL
    eager = copy.deepcopy(ref)
    eager.set_attn_implementation("eager")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="output_attentions"):
        got = model(**inputs, output_attentions=True)
    with torch.no_grad():
        want = eager(**inputs, output_attentions=True)
    assert _rel(got.logits, want.logits) < REL
    assert all(_rel(g, w) < REL for g, w in zip(got.cross_attentions, want.cross_attentions))


def test_the_eager_fallback_keeps_the_causal_pattern():
    """output_attentions goes to the model's eager attention, which has no is_causal flag: without a mask it must
    still get the causal pattern, and its weights above the diagonal are 0."""
    ref, model = _llama()
    ref.set_attn_implementation("eager")
    ids = _ids(2, 11)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="output_attentions"):
        got = model(input_ids=ids, output_attentions=True)
    with torch.no_grad():
        want = ref(input_ids=ids, output_attentions=True)
    assert _rel(got.logits, want.logits) < REL
    assert all(not torch.triu(w, diagonal=1).any() for w in got.attentions)


def test_the_eager_fallback_over_a_static_cache_weighs_every_slot():
    """output_attentions over a static cache: the weights span every slot of the cache, as eager attention's do (zeros
    on the slots not written yet), so each step's weights have the same width whatever tilegen's mask cut."""
    from transformers import StaticCache
    ref, model = _llama()
    ref.set_attn_implementation("eager")
    ids = _ids(2, 7)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    outs = []
    for m in (ref, model):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs.append(m(input_ids=ids, attention_mask=mask, cache=StaticCache(config=m.config, max_cache_len=12),
                          output_attentions=True))
    want, got = outs
    assert _rel(got.logits[mask.bool()], want.logits[mask.bool()]) < REL
    for g, w in zip(got.attentions, want.attentions):
        assert g.shape == w.shape == (2, 4, 7, 12)
        assert _rel(g[0], w[0]) < REL and _rel(g[1, :, 2:], w[1, :, 2:]) < REL  # the real queries' rows


@pytest.mark.parametrize("head_dim", [4, 20])
def test_a_head_dim_the_kernels_do_not_take_falls_back_with_one_warning(head_dim):
    from transformers import LlamaConfig, LlamaForCausalLM
    ref, model = _pair(LlamaConfig, LlamaForCausalLM, head_dim=head_dim)
    ids = _ids(2, 9)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.warns(RuntimeWarning, match="head dim") as caught:
        _compare(ref, model, None, input_ids=ids)
        _compare(ref, model, mask, input_ids=ids)
    assert len([w for w in caught if "head dim" in str(w.message)]) == 1


def test_gemma2_softcap_sliding_and_custom_scaling(monkeypatch):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    ref, model = _pair(Gemma2Config, Gemma2ForCausalLM, reference="eager", sliding_window=4,
                       attn_logit_softcapping=2.0, final_logit_softcapping=None, query_pre_attn_scalar=8)
    ids = _ids(2, 13)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    calls = _Calls(monkeypatch)
    _compare(ref, model, mask, input_ids=ids)
    _compare(ref, model, None, input_ids=ids)
    assert calls.ops == ["varlen_attention"] * 2 + ["attention"] * 2


def test_gradients_of_a_padded_batch():
    ref, model = _llama()
    ref.train()
    model.train()
    ids = _ids(2, 10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({name: p.grad for name, p in m.named_parameters()})
    for name, want in grads[0].items():
        got = grads[1][name]
        assert got is not None and torch.isfinite(got).all(), name
        assert _rel(got, want) < REL, name


def test_gradients_of_packed_sequences():
    ref, model = _llama()
    lengths = [6, 4, 7]
    ids = _ids(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    grads = []
    for m in (ref.train(), model.train()):
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()
        grads.append({name: p.grad for name, p in m.named_parameters()})
    for name, want in grads[0].items():
        assert _rel(grads[1][name], want) < REL, name


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_4d_causal_padding_mask_runs_varlen(kind, monkeypatch):
    ref, model = _llama()
    ids = _ids(2, 11)
    padding = torch.ones_like(ids, dtype=torch.bool)
    padding[0, :4] = False
    padding[1, 9:] = False
    mask = torch.ones(11, 11, dtype=torch.bool).tril()[None, None] & padding[:, None, None, :]
    if kind == "float":  # eager's additive form
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    calls = _Calls(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compare(ref, model, mask, input_ids=ids, real=padding)
    assert not [w for w in caught if "tilegen attention" in str(w.message)]  # no fallback
    assert calls.ops == ["varlen_attention"] * 2


def test_a_custom_4d_mask_falls_back_to_sdpa_with_one_warning(monkeypatch):
    ref, model = _llama()
    n = 9
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = causal.clone()
    mask[5:, 1:3] = False  # not causal + padding: no ragged batch can express it
    mask = mask[None, None].expand(2, 1, n, n)
    ids = _ids(2, n)
    calls = _Calls(monkeypatch)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
        again = model(input_ids=ids, attention_mask=mask).logits
    ours = [w for w in caught if "tilegen attention" in str(w.message)]
    assert len(ours) == 1 and "SDPA" in str(ours[0].message)
    assert calls.ops == []
    assert _rel(got, want) < REL and torch.equal(got, again)


def test_an_overlay_mask_function_gets_sdpas_mask():
    from transformers import masking_utils

    ids = torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.long)
    overlay = masking_utils.or_masks(masking_utils.causal_mask_function, masking_utils.blockwise_overlay(ids))
    mask = tilegen_hf.mask_forward(1, 5, 5, mask_function=overlay, allow_is_causal_skip=False)
    assert mask.shape == (1, 1, 5, 5) and bool(mask[0, 0, 2, 4])  # a key after the query, by the overlay
    window = masking_utils.sliding_window_causal_mask_function(3)
    padding = torch.tensor([[False, True, True, True, True]])
    assert tilegen_hf.mask_forward(1, 5, 5, mask_function=window, attention_mask=padding) is padding or torch.equal(
        tilegen_hf.mask_forward(1, 5, 5, mask_function=window, attention_mask=padding), padding)
    assert tilegen_hf.mask_forward(1, 5, 5, mask_function=window, attention_mask=torch.ones(1, 5, dtype=torch.bool)) \
        is None
    chunked = masking_utils.chunked_causal_mask_function(2, torch.zeros(1, dtype=torch.long))
    assert tilegen_hf.mask_forward(1, 5, 5, mask_function=chunked, allow_is_causal_skip=False).shape == (1, 1, 5, 5)


def test_the_mask_builder_places_the_queries_where_transformers_has_them():
    """transformers' key j is the 2-d mask's column kv_offset + j, query i sits at q_offset + i; the attention
    function takes a causal call's queries for the mask's last columns, so the mask ends at the last query."""
    from transformers import masking_utils

    causal = masking_utils.causal_mask_function
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, :6] = True
    mask[0, :2] = False  # left padding
    # A static cache's decoding step: 12 slots, a tensor offset, a mask of the cache's length.
    got = tilegen_hf.mask_forward(2, 1, 12, q_offset=torch.tensor(5), mask_function=causal, attention_mask=mask)
    assert torch.equal(got, mask[:, :6])
    # A sliding window's cache keeps the keys from position 1 on: the mask's columns from there.
    got = tilegen_hf.mask_forward(2, 2, 5, q_offset=4, kv_offset=1, mask_function=causal, attention_mask=mask)
    assert torch.equal(got, mask[:, 1:6])
    # Bidirectional: the keys' columns, whatever the queries.
    got = tilegen_hf.mask_forward(2, 6, 12, mask_function=masking_utils.bidirectional_mask_function,
                                  attention_mask=mask)
    assert torch.equal(got, mask)
    with pytest.raises(ValueError, match="must cover every query"):
        tilegen_hf.mask_forward(2, 1, 12, q_offset=6, mask_function=causal, attention_mask=mask[:, :6])


def test_the_ragged_layout_is_computed_once_per_mask(monkeypatch):
    ref, model = _llama()
    ids = _ids(2, 9)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    built = []
    real = tilegen_hf._padding_layout

    def counting(*args):
        built.append(1)
        return real(*args)

    monkeypatch.setattr(tilegen_hf, "_padding_layout", counting)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask).logits
        # The next forward, with other padding: transformers builds another mask tensor, which gets its own layout.
        mask[0, :2] = 1
        mask[1, :4] = 0
        second = model(input_ids=ids, attention_mask=mask).logits
        want = ref(input_ids=ids, attention_mask=mask).logits
    assert len(built) == 2  # one per forward, not one per layer
    real_rows = mask.bool()
    assert _rel(second[real_rows], want[real_rows]) < REL
    assert not torch.equal(first, second)


def test_the_training_example_trains_padded_batches_as_sdpa_does(tmp_path):
    """examples/train_transformers.py for a few steps: the tilegen model (every attention call ragged, over
    right-padded batches) and the sdpa one keep the same loss."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "curves.json"
    done = subprocess.run([sys.executable, os.path.join(root, "examples", "train_transformers.py"), "--steps", "3",
                           "--layers", "1", "--out", str(out)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["padding_tokens"] > 0
    assert len(data["losses"]["transformers + tilegen attention"]) == 3
    assert data["max_abs_loss_difference"] < 1e-4


@pytest.mark.parametrize("argv", [["--heads", "3/2"], ["--heads", "5/5"]])
def test_the_training_example_refuses_a_bad_model_in_one_line(argv, tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, os.path.join(root, "examples", "train_transformers.py"), "--steps", "1",
                           *argv, "--out", str(tmp_path / "curves.json")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "--heads" in done.stderr.strip().splitlines()[-1]
