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
