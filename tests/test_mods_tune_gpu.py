"""A mod spec's tuning trial on a GPU: test_mods_tune.py's tests run on the CPU interpreter only (its module skips
them elsewhere), so the GPU's own trial lives here."""

from __future__ import annotations

import pytest
import torch
from test_mods_tune import MODS, _importable

from tilegen.device import device_info


@pytest.mark.gpu
@pytest.mark.parametrize("family_spec", [
    {"family": "attention_fwd", "head_dim": 64, "q_per_kv": 2, "mask": "causal"},
    {"family": "attention_bwd", "head_dim": 64, "q_per_kv": 2, "mask": "causal"},
    {"family": "attention_varlen", "head_dim": 64, "q_per_kv": 2, "mask": "causal"},
], ids=["forward", "backward", "ragged"])
def test_a_trial_on_the_gpu_builds_its_mods_there(tmp_path, monkeypatch, family_spec):
    """A tune's problem makes its tensors on "cuda", which no tensor's device equals ("cuda:0"): the mods' captured
    tensors are checked against the current device, and the trial runs and passes its check."""
    from tilegen.families import family_of, spec_from_json
    from tilegen.mods import sources
    from tilegen.tuning.measure import measure

    (tmp_path / "tune_mods.py").write_text(MODS)
    _importable(tmp_path, monkeypatch)
    monkeypatch.setenv(sources.ENV, '{"score_mod": "tune_mods:make_alibi"}')
    spec = spec_from_json(family_spec).replace(score_mod=sources.canonical_text("tune_mods:make_alibi", "score_mod"))
    family = family_of(spec)
    bucket = family.buckets.of((512, 4)) if family.buckets.batch_unit is not None else 512
    device = device_info(torch.cuda.current_device())
    problem = family.problem(spec, bucket, on_gpu=True)
    assert measure(problem, family.default_config(spec, device, bucket), 0)["status"] == "ok"
