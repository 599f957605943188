"""``tilegen.bench.mods``'s tuning factories: each builds, at any tuned shape, a mod of the same canonical text as
the benchmark's (so rows tuned through it serve the benchmark's calls), and `tilegen tune` takes them by path."""

from __future__ import annotations

import pytest
import torch

from tilegen.bench import mods as bench
from tilegen.mods.sources import canonical_text
from tilegen.mods.trace import trace


@pytest.mark.parametrize("name, factory, kind", [
    ("alibi", "tune_alibi", "score_mod"),
    ("relative-bias", "tune_relative_bias", "score_mod"),
    ("document", "tune_document", "mask_mod"),
    ("prefix-lm", "tune_prefix_lm", "mask_mod"),
    ("window-1024+64-global", "tune_window_global", "mask_mod"),
])
def test_each_factory_traces_to_the_benchmarks_mod(name, factory, kind):
    score_mod, mask_mod, _ = bench._mods(torch.Generator().manual_seed(0), device="cpu")[name]
    want = trace(score_mod if kind == "score_mod" else mask_mod, kind).canonical
    assert canonical_text(f"tilegen.bench.mods:{factory}", kind) == want
    for batch, heads, n in ((1, 2, 17), (8, 32, 1000)):
        mod = getattr(bench, factory)(batch=batch, heads=heads, n_q=n, n_k=n, device=torch.device("cpu"))
        assert trace(mod, kind).canonical == want


def test_the_document_and_prefix_tensors_cover_every_position_and_sequence():
    ids = bench._doc_ids(1000, "cpu")
    assert ids.shape == (1000,) and ids.dtype == torch.int32 and torch.equal(ids.unique(), torch.arange(4).int())
    assert torch.equal(torch.bincount(bench._doc_ids(4096, "cpu")), torch.tensor([1500, 700, 1200, 696]))
    assert bench._prefixes(6, 4096, "cpu").tolist() == [512, 1024, 2048, 100, 512, 1024]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_the_config_sweep_runs_each_config_it_names_and_reports_one_that_fails(backward, monkeypatch):
    """``--configs``: each config is the one the call runs (the family's rule swapped, then put back), checked
    against the default config's result; a config the kernel refuses is reported, not raised."""
    import time

    from tilegen import dispatch
    from tilegen.families import registry

    monkeypatch.setattr(bench, "B", 1), monkeypatch.setattr(bench, "HQ", 2), monkeypatch.setattr(bench, "N", 40)
    monkeypatch.setattr(bench, "D", 16)
    monkeypatch.setattr(bench, "_bench", lambda fn: (lambda t: (fn(), time.perf_counter() - t)[1] * 1e3)(
        time.perf_counter()))
    family = registry.get("attention_bwd" if backward else "attention_fwd")
    rule = family.default_rule
    seen = []
    real = dispatch.Table._resolve
    monkeypatch.setattr(dispatch.Table, "_resolve", lambda self, bucket: seen.append(real(self, bucket)) or seen[-1])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    score_mod, mask_mod, _ = bench._mods(gen, device="cpu")["alibi+causal"]
    small = ({"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 1} if not backward else
             {"block_m1": 16, "block_n1": 32, "num_warps1": 4, "num_stages1": 1, "block_m2": 32, "block_n2": 16,
              "num_warps2": 4, "num_stages2": 1})
    bad = {**small, ("block_m" if not backward else "block_m1"): 24}  # not a power of two: refused
    rows = bench.sweep("alibi+causal", score_mod, mask_mod, q, k, v, [small, bad], backward)
    assert isinstance(rows[0]["us"], float) and rows[0]["error vs default"] < 2e-2
    assert isinstance(rows[1]["us"], str) and "Error" in rows[1]["us"]
    assert str(family.config_type(**small)) in {str(c.config) for c in seen}
    assert family.default_rule is rule


def test_the_backward_columns_take_turns_over_checked_providers_and_report_medians(monkeypatch):
    """``--rounds``: every provider whose gradients agree with Flex's is timed once a round, the order rotating,
    each column the median of its rounds; one whose gradients disagree is reported wrong and not timed."""
    made, order, times = {}, [], {"flex": iter([3.0, 1.0, 2.0]), "tilegen": iter([1.0, 5.0, 4.0])}

    def timed(fn):
        fn()  # the backward it times, on the graph of one provider's output
        (name,) = {made[id(c.cell_contents)] for c in fn.__closure__ if id(c.cell_contents) in made}
        order.append(name)
        return next(times[name])

    monkeypatch.setattr(bench, "_bench", timed)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 17, 16, generator=gen) for _ in range(3))

    def provider(name, wrong=False):
        def fn(q, k, v):
            out = (q @ k.transpose(-1, -2)).softmax(-1) @ (v * 2 if wrong else v)
            made[id(out)] = name
            return out
        return fn

    row = {}
    bench._backward_row(row, 1e9, provider("flex"), provider("tilegen"), provider("builtin", wrong=True), q, k, v,
                        rounds=3)
    assert order == ["flex", "tilegen", "tilegen", "flex", "flex", "tilegen"]
    assert row["flex bwd us"] == 2000.0 and row["tilegen bwd us"] == 4000.0
    assert row["builtin bwd us"].startswith("wrong: relative error")
    assert row["flex / tilegen bwd"] == 0.5 and row["tilegen bwd error vs flex"] < 1e-6


def test_a_provider_whose_backward_timing_raises_is_reported_and_the_row_completes(monkeypatch):
    def timed(fn):
        fn()
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(bench, "_bench", timed)
    q, k, v = (torch.randn(1, 2, 17, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def attend(q, k, v):
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v

    row = {}
    bench._backward_row(row, 1e9, attend, attend, None, q, k, v, rounds=2)
    assert row["flex bwd us"].startswith("OutOfMemoryError: CUDA out of memory")
    assert row["tilegen bwd us"].startswith("OutOfMemoryError") and "flex / tilegen bwd" not in row
