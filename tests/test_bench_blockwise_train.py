"""``tilegen.bench.blockwise --train``: the training-step benchmark's CPU smoke run and its argument errors,
and the training example (examples/train_blockwise.py) for a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import checkout_pythonpath

from tilegen.bench import blockwise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": checkout_pythonpath()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke path is the CPU interpreter's")
def test_the_smoke_training_step_checks_tilegen_against_the_unfused_layer(tmp_path):
    out = tmp_path / "train.json"
    result = subprocess.run([sys.executable, "-m", "tilegen.bench.blockwise", "--smoke", "--train", "--runs", "1",
                             "--lengths", "24", "--no-fit", "--blocks", "8", "--out", str(out)],
                            env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "train" and data["fit"] == []
    rows = {r["provider"]: r for r in data["rows"]}
    assert set(rows) == {*blockwise.TRAIN_PROVIDERS, "tilegen block=8"}
    assert rows["tilegen block=8"]["status"] == "ok" and rows["tilegen block=8"]["correct"] is True
    tilegen_row = rows["tilegen"]
    assert tilegen_row["status"] == "ok" and tilegen_row["correct"] is True and tilegen_row["time_ms"] > 0
    names = {"input", *blockwise.SMOKE_LAYER.weight_shapes()}
    assert set(tilegen_row["grad_errors"]) == names
    assert max(tilegen_row["grad_errors"].values()) < blockwise.TOLERANCE
    assert rows["transformers"]["status"] in ("ok", "n/a")


def test_the_training_steps_take_turns_and_report_each_providers_median(monkeypatch):
    """With the steps stubbed: one timed step of each provider a round, the order rotating, each time the median of
    its rounds; a provider whose timed step runs out of memory is marked so, the others still timed."""
    order = []
    times = {"unfused": [3.0, 1.0, 2.0], "tilegen": [5.0, 4.0, 6.0]}

    def made(name, config, w, device):
        def step(x, dout, keep=False):
            return torch.zeros(1) if keep else None
        step.provider = name
        return step, {}

    def timed(step, x, dout, runs):
        order.append(step.provider)
        if step.provider == "transformers":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return times[step.provider].pop(0)

    monkeypatch.setattr(blockwise, "_train_step", made)
    monkeypatch.setattr(blockwise, "_peak_run", lambda step, x, dout: (None, None, 0.0))
    monkeypatch.setattr(blockwise, "_time_ms", timed)
    monkeypatch.setattr(blockwise, "_grads", lambda x, params: {"input": torch.zeros(1)})
    monkeypatch.setattr(blockwise, "_loss", lambda out, dout: 1.0)
    monkeypatch.setattr(blockwise, "_errors", lambda a, b, x: (0.0, 0.0))
    rows = blockwise.train_sweep(blockwise.SMOKE_LAYER, [8], 3, torch.device("cpu"),
                                 ("unfused", "transformers", "tilegen"))
    assert order == ["unfused", "transformers", "tilegen", "tilegen", "unfused", "tilegen", "unfused"]
    by_name = {r["provider"]: r for r in rows}
    assert by_name["unfused"]["time_ms"] == 2.0 and by_name["tilegen"]["time_ms"] == 5.0
    assert by_name["transformers"]["status"] == "oom" and "time_ms" not in by_name["transformers"]


def test_the_inference_runs_take_turns_and_report_each_providers_median(monkeypatch):
    """The inference sweep, its runs stubbed: one timed run of each provider a round, the order rotating."""
    order = []
    times = {name: [float(i + 1), 9.0, 0.5] for i, name in enumerate(blockwise.PROVIDERS)}

    def provider(name, config, chunk):
        def run(x, w):
            return x
        run.provider = name
        return run

    def timed(run, x, w, runs):
        order.append(run.provider)
        return times[run.provider].pop(0)

    monkeypatch.setattr(blockwise, "_provider", provider)
    monkeypatch.setattr(blockwise, "_peak_run", lambda run, x, w: (x, None, 0.0))
    monkeypatch.setattr(blockwise, "_time_ms", timed)
    names = [p for p in blockwise.PROVIDERS if p != "tilegen"]
    monkeypatch.setattr(blockwise, "PROVIDERS", tuple(names))
    rows = blockwise.sweep(blockwise.SMOKE_LAYER, [8], 1, 3, torch.device("cpu"))
    k = len(names)
    assert order == [names[(r + i) % k] for r in range(3) for i in range(k)]
    assert [r["time_ms"] for r in rows] == [float(i + 1) for i in range(k)]  # the median of i + 1, 9 and 0.5


@pytest.mark.parametrize("argv, message", [
    (["--train"], "run it on a GPU, or pass --smoke"),
    (["--smoke", "--train", "--runs", "0"], "--runs: expected at least 1"),
    (["--smoke", "--train", "--lengths", "8,x"], "--lengths: expected comma-separated ints"),
    (["--smoke", "--train", "--lengths", "0"], "--lengths: expected positive token counts"),
    (["--smoke", "--train", "--fit-budget-s", "-1"], "--fit-budget-s: expected a non-negative"),
    (["--smoke", "--train", "--blocks", "8,x"], "--blocks: expected comma-separated ints"),
    (["--smoke", "--train", "--blocks", "0"], "--blocks: expected positive query blocks"),
    (["--smoke", "--blocks", "8"], "--blocks: expected positive query blocks, with --train"),
])
def test_bad_arguments_fail_before_any_work(argv, message, monkeypatch):
    if torch.cuda.is_available() and "--smoke" not in argv:
        pytest.skip("on a GPU --train runs")
    monkeypatch.setattr(blockwise, "train_sweep", lambda *a: pytest.fail("nothing should run"))
    with pytest.raises(SystemExit, match=message.replace("(", r"\(")):
        blockwise.main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU defaults")
def test_the_training_example_runs_a_few_steps_and_matches_the_reference(tmp_path):
    out = tmp_path / "curves.json"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_blockwise.py"), "--steps", "3",
                             "--batch", "1", "--layers", "1", "--out", str(out)],
                            env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    losses = data["losses"]
    assert len(losses["tilegen BlockwiseLayer"]) == 3
    assert data["max_abs_loss_difference"]["tilegen BlockwiseLayer"] < 1e-4


@pytest.mark.parametrize("argv, message", [
    (["--heads", "3/2"], "heads_q"),
    (["--head-dim", "0"], "head_dim"),
])
def test_the_training_example_refuses_a_bad_layer_in_one_line(argv, message, tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_blockwise.py"), "--steps", "1",
                             *argv, "--out", str(tmp_path / "curves.json")],
                            env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1]
