"""examples/generate.py: greedy generation with continuous batching from tilegen's serving ops (paged prefill,
append, paged decode, RoPE) on a tiny transformers Llama, token for token against transformers' own greedy
``generate``. On the CPU under the interpreter (eager padded decode steps); on a GPU the same checks run with the
decode step captured in CUDA graphs."""

import importlib.util
import json
import pathlib
import sys

import pytest
import torch

pytest.importorskip("transformers")

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def _load():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("tilegen_example_generate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen = _load()


def _model(**extra):
    return gen.build_model({**gen.TINY, **extra}, 2, torch.float32, DEVICE)


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, gen.TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def _reference(model, prompt, new):
    """transformers' greedy tokens for one request alone (no padding)."""
    return gen.hf_generate(model, torch.tensor([prompt], device=DEVICE), new, "dynamic")[0].tolist()


# Four requests of odd prompt lengths; pages of 8 tokens, so the 17-token prompt spans three. With 6 pages and
# buckets (2, 4): requests 0 and 1 start at step 0 (bucket 2), request 3 joins at step 1 (batch 3, padded to 4),
# request 2 arrives at step 2 but its 3 pages are only free once requests 1 and 3 have finished.
LENGTHS, NEW, ARRIVAL = (5, 9, 17, 6), (6, 4, 5, 3), (0, 0, 2, 1)


@pytest.fixture(scope="module")
def served():
    model = _model()
    prompts = _prompts(LENGTHS)
    refs = [_reference(model, p, n) for p, n in zip(prompts, NEW)]
    engine = gen.Engine(model, page_size=8, num_pages=6, max_batch=4, max_seq_len=32, buckets=(2, 4))
    assert engine.cuda_graphs == HAS_CUDA
    requests = [gen.Request(p, n, a) for p, n, a in zip(prompts, NEW, ARRIVAL)]
    outputs = engine.generate(requests)
    return model, engine, requests, outputs, refs


def test_greedy_tokens_equal_transformers_generate(served):
    _, engine, _, outputs, refs = served
    assert [len(o) for o in outputs] == list(NEW)
    assert outputs == refs
    # No EOS, nothing forced: each step's tokens went to the next on the device, read back once at the end.
    assert engine.stats["overlapped"] == 1 and engine._pending == []


def test_requests_join_and_leave_between_steps(served):
    _, engine, requests, _, _ = served
    joined = [r.joined for r in requests]
    assert joined == [0, 0, 3, 1]  # request 2 waited a step for pages after it arrived
    assert [r.finished for r in requests] == [4, 2, 6, 2]
    assert engine.stats["prefills"] == 3
    # Batches of 3 and 1 ran padded to the buckets 4 and 2.
    assert engine.stats["padded_slots"] > 0
    if HAS_CUDA:
        assert engine.stats["graph_replays"] == engine.stats["decode_steps"]


def test_pages_are_freed_and_reused(served):
    _, engine, requests, _, _ = served
    assert sorted(engine.free) == list(range(engine.num_pages)) and engine.unreserved == engine.num_pages
    assert all(not r.pages and not r.reserved for r in requests)
    owners: dict[int, set[int]] = {}
    for request, page in engine.page_log:
        owners.setdefault(page, set()).add(request)
    assert any(len(o) > 1 for o in owners.values()), owners  # a page went to a second request
    assert engine.stats["peak_pages"] <= engine.num_pages
    # The 17-token prompt and its 4 fed-back tokens took ceil(21 / 8) pages.
    assert sum(1 for request, _ in engine.page_log if request == 2) == 3


def test_the_engine_serves_again_and_stops_at_eos(served):
    model, engine, _, _, refs = served
    eos = refs[0][2]
    stop = refs[0].index(eos) + 1
    engine.eos_token_id = eos
    try:
        outputs = engine.generate([gen.Request(_prompts(LENGTHS)[0], NEW[0])])
    finally:
        engine.eos_token_id = None
    assert outputs == [refs[0][:stop]]
    assert engine.stats["overlapped"] == 0  # an EOS decides the schedule: every step waits for its tokens
    assert sorted(engine.free) == list(range(engine.num_pages))


def test_projections_are_joined_without_copying_the_weights(served):
    model, engine, *_ = served
    for layer, fused in zip(model.model.layers, engine.fused):
        attn, mlp = layer.self_attn, layer.mlp
        assert fused is not None
        for joined, parts in ((fused.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)),
                              (fused.gate_up, (mlp.gate_proj, mlp.up_proj))):
            torch.testing.assert_close(joined, torch.cat([m.weight for m in parts]), rtol=0, atol=0)
            assert all(m.weight.untyped_storage().data_ptr() == joined.untyped_storage().data_ptr() for m in parts)
    again = gen.Engine(model, page_size=8, num_pages=6, max_batch=4, max_seq_len=32, buckets=(2, 4))
    assert [f.qkv.data_ptr() for f in again.fused] == [f.qkv.data_ptr() for f in engine.fused]  # viewed, not re-joined


def test_a_layer_with_biases_runs_its_own_projections():
    model = _model(attention_bias=True, mlp_bias=True)
    prompts = _prompts(LENGTHS[:2])
    refs = [_reference(model, p, n) for p, n in zip(prompts, NEW)]
    engine = gen.Engine(model, page_size=8, num_pages=6, max_batch=4, max_seq_len=32, buckets=(2, 4))
    assert engine.fused == [None, None]
    assert engine.generate([gen.Request(p, n) for p, n in zip(prompts, NEW)]) == refs


def test_bad_requests_are_refused_before_anything_runs():
    model = _model()
    engine = gen.Engine(model, page_size=8, num_pages=3, max_batch=2, max_seq_len=32)
    good = gen.Request([1, 2, 3], 2)
    cases = [
        (gen.Request([], 3), "prompt: empty"),
        (gen.Request([1] * 30, 4), "past the engine's capacity of 32"),  # 33 positions
        (gen.Request([1] * 20, 8), "past the cache capacity of 3 pages"),  # 27 positions, 4 pages
        (gen.Request([1, 61], 2), "outside the vocabulary of 61"),
        (gen.Request([1, 2], 0), "max_new_tokens: expected at least 1"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.generate([good, bad])
    assert good.output == [] and engine._buckets == {}  # refused before any step
    assert sorted(engine.free) == [0, 1, 2] and engine.unreserved == 3
    with pytest.raises(ValueError, match="page_size: 4 is not supported"):
        gen.Engine(model, page_size=4)


def test_rope_tables_are_the_models_own_and_length_dependent_ones_are_refused():
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    model = _model(rope_parameters=llama3, max_position_embeddings=256)
    engine = gen.Engine(model, page_size=8, num_pages=4, max_batch=1, max_seq_len=200)
    positions = torch.tensor([[0, 1, 17, 100, 199]], device=DEVICE)
    cos, sin = model.model.rotary_emb(model.model.embed_tokens.weight[:1], positions)
    assert torch.equal(engine.cos[positions[0]], cos[0]) and torch.equal(engine.sin[positions[0]], sin[0])
    plain = gen.Engine(_model(max_position_embeddings=256), page_size=8, num_pages=4, max_batch=1, max_seq_len=200)
    assert not torch.allclose(plain.cos[positions[0]], engine.cos[positions[0]])  # the scaling is in the table
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        gen.Engine(_model(rope_parameters=dynamic), page_size=8)


@pytest.mark.parametrize("model_type,extra", [
    ("qwen3", {}),  # q and k normalized per head
    ("olmo2", {}),  # the same, and its norms after each sublayer
    ("gemma", {"hidden_activation": "gelu_pytorch_tanh"}),  # the embedding scaled by sqrt(hidden_size)
    ("granite", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 4.0}),
    ("phi3", {"pad_token_id": 0}),  # q, k and v in one module
])
def test_a_decoder_that_is_not_llamas_layer_is_refused(model_type, extra):
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**gen.TINY, "num_hidden_layers": 1, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="^model: "):
        gen.Engine(model, page_size=8)


def test_a_mistral_without_a_window_and_a_qwen2_are_served_as_llama():
    import transformers

    for model_type in ("mistral", "qwen2"):
        config = transformers.AutoConfig.for_model(model_type, **{**gen.TINY, "num_hidden_layers": 2,
                                                                  "sliding_window": None})
        model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
        prompt = _prompts([7])[0]
        outputs = gen.Engine(model, page_size=8, num_pages=4, max_batch=1, max_seq_len=32).generate(
            [gen.Request(prompt, 4)])
        assert outputs == [_reference(model, prompt, 4)], model_type


@pytest.mark.skipif(HAS_CUDA, reason="the command's CPU smoke run (on a GPU it builds Llama-3-8B widths)")
def test_the_command_runs_and_matches_transformers(tmp_path, capsys):
    out = tmp_path / "results.json"
    assert gen.main(["--batch", "2", "--prompt", "5", "--new", "3", "--hf-cache", "dynamic", "--prefill-tokens", "5,10",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [2]
    row = rows[0]
    assert row["hf"]["cache"] == "dynamic" and not row["hf"]["torch_compile"]
    assert row["match_first32"] == 1.0 and row["match_all"] == 1.0
    assert row["tilegen"]["tokens_per_s"] > 0 and row["tilegen"]["stats"]["decode_steps"] == 3
    assert row["tilegen"]["stats"]["prefills"] == 2  # a budget of one prompt a step
    [both] = row["tilegen_budgets"]
    assert both["prefill_tokens"] == 10 and both["stats"]["prefills"] == 1 and both["stats"]["decode_steps"] == 2
    assert both["same_tokens_as_first_budget"]
    assert "match@32" in capsys.readouterr().out


def test_fp8_pages_serve_the_same_requests(served):
    """The engine over FP8 pages (e4m3, scale 1.0): every request is served from float8 pages through
    append_kv's quantization, and greedy decoding mostly keeps the unquantized cache's tokens (the tiny
    model's random weights make a flip at a near tie possible, not a different answer)."""
    model, _, _, outputs, _ = served
    engine = gen.Engine(model, page_size=8, num_pages=6, max_batch=4, max_seq_len=32, buckets=(2, 4),
                        kv_dtype=torch.float8_e4m3fn)
    assert engine.k_pages.dtype == torch.float8_e4m3fn
    prompts = _prompts(LENGTHS)
    quantized = engine.generate([gen.Request(p, n, a) for p, n, a in zip(prompts, NEW, ARRIVAL)])
    assert [len(o) for o in quantized] == list(NEW)
    assert gen.match_share(quantized, outputs) >= 0.75


def test_teacher_forced_logits_compare_two_caches_over_the_same_tokens(served):
    """The FP8 report's machinery: forced tokens are what each request feeds back, every step's logits are
    kept, and FP8 pages' logits differ from the unquantized cache's within FP8's precision."""
    model, _, _, outputs, _ = served
    prompts = _prompts(LENGTHS[:2])
    args = dict(page_size=8, num_pages=6, max_batch=2, max_seq_len=32, buckets=(2,))
    forced = [[(t + 1) % model.config.vocab_size for t in o] for o in outputs[:2]]  # not the argmax
    requests = [gen.Request(p, n, forced=f) for p, n, f in zip(prompts, NEW[:2], forced)]
    outs = gen.Engine(model, keep_logits=True, **args).generate(requests)
    assert outs == [f[:n] for f, n in zip(forced, NEW[:2])]
    assert [len(r.logits) for r in requests] == list(NEW[:2])
    assert all(row.shape == (model.config.vocab_size,) and torch.isfinite(row).all() for r in requests
               for row in r.logits)
    fp8 = gen.logit_agreement(model, prompts, 3, torch.float8_e4m3fn, **args)
    assert fp8["requests"] == 2 and fp8["steps"] == 3
    assert 0 < fp8["rel_error_median"] < 0.25 and 0.5 <= fp8["top1_agreement"] <= 1
    with pytest.raises(ValueError, match="forced"):
        gen.Engine(model, **args).generate([gen.Request(prompts[0], 3, forced=[1])])
