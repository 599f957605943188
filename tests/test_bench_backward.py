"""``tilegen bench backward``: its argument checks, and its smoke path (tiny shapes, the interpreter
without a GPU) once ``tilegen.attention`` backpropagates."""

from __future__ import annotations

import json

import pytest
import torch.nn.functional as F
from typer.testing import CliRunner

from tilegen.bench import backward as bench
from tilegen.cli import app

runner = CliRunner()


@pytest.mark.parametrize("args, message", [
    (["--heads", "32/7"], "--heads: expected QUERY/KV pairs"),
    (["--heads", "32-8"], "--heads: expected QUERY/KV pairs"),
    (["--heads", "32/0"], "--heads: expected QUERY/KV pairs"),
    (["--seqlens", "1024,x"], "--seqlens: expected comma-separated positive whole numbers"),
    (["--dims", "0"], "--dims: expected comma-separated positive whole numbers"),
    (["--smoke", "--dims", "16,7"], "--dims: 7 is no head dim the kernels take"),
    (["--masks", "sliding"], "--masks: unknown ['sliding']"),
    (["--peers", "tilegen,fa3"], "--peers: unknown ['fa3']"),
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--smoke", "--memory"], "--memory: measures the CUDA allocator's peaks"),
    (["--smoke", "--peers", "tilegen,cudnn"], "--peers: without a GPU (--smoke) only tilegen, math run"),
    (["--rounds", "0"], "--rounds: expected at least 1, got 0"),
])
def test_bad_arguments_fail_in_one_line_before_any_work(args, message):
    result = runner.invoke(app, ["bench", "backward", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_the_help_line_says_what_it_measures():
    result = runner.invoke(app, ["bench", "--help"])
    assert result.exit_code == 0 and "Attention-training benchmark" in result.output


def _math(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


@pytest.mark.parametrize("wrong", [False, True])
def test_the_smoke_path_with_a_differentiable_stand_in(monkeypatch, tmp_path, capsys, wrong):
    """The benchmark's own machinery, whatever tilegen's backward does: a stand-in that is SDPA passes the
    check and is timed; one whose gradients are off fails its cells, and the run exits 1."""
    def fake(q, k, v, causal=False):
        return _math(q, k, v, causal) * (1.1 if wrong else 1.0)

    monkeypatch.setattr(bench.tilegen, "attention", fake)
    code = bench.main(["--smoke", "--heads", "2/1", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert code == (1 if wrong else 0)
    rows = json.loads((tmp_path / "backward.json").read_text())["rows"]
    assert [r["cell"] for r in rows] == ["N=33 d=16 2/1 causal fp32", "N=33 d=16 2/1 full fp32"]
    for row in rows:
        assert row["check"]["passed"] is not wrong
        assert "bwd_tflops" in row["math"] and ("error" in row["tilegen"]) is wrong
    assert lines[-3].split() == ["cell", "tilegen", "math", "tilegen/cudnn"]
    assert "| tilegen check (worst rel. err) |" in (tmp_path / "backward.md").read_text()
    if bench.pyplot() is not None:
        assert (tmp_path / "backward.png").read_bytes()[:4] == b"\x89PNG"


def test_a_peer_that_does_not_run_is_na(monkeypatch):
    def missing(q, k, v):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(bench, "_peers", lambda cell, names, det: {"tilegen": _math, "cudnn": missing})
    row = bench.bench_cell(bench.Cell(33, 16, 2, 2, False, "fp32", batch=1), ["tilegen", "cudnn"], "cpu", smoke=True)
    assert row["check"]["passed"] and row["cudnn"] == {"error": "RuntimeError: No available kernel. Aborting execution."}
    table = bench.short_table([row], ["tilegen", "cudnn"]).splitlines()
    assert table[1].split()[-2:] == ["n/a", "-"]


def test_a_tilegen_run_that_does_not_run_is_told_apart_from_a_wrong_gradient(monkeypatch):
    # A config out of shared memory raised in the check, and was reported as "failed the gradient check".
    def out_of_memory(q, k, v, causal=False):
        raise RuntimeError("out of resource: shared memory, Required: 264192")

    monkeypatch.setattr(bench, "_peers", lambda cell, names, det: {"tilegen": out_of_memory, "math": _math})
    row = bench.bench_cell(bench.Cell(33, 16, 2, 2, False, "fp32", batch=1), ["tilegen", "math"], "cpu", smoke=True)
    assert not row["check"]["passed"] and row["tilegen"]["error"].startswith("did not run: RuntimeError: out of")
    assert "bwd_ms" in row["math"]


def test_rounds_take_turns_in_a_rotating_order_and_report_each_peers_median(monkeypatch):
    calls, times = [], iter([(3.0, 1.0), (2.0, 5.0), (4.0, 2.0), (1.0, 6.0), (5.0, 3.0), (6.0, 4.0)])

    def timed(fn, q, k, v, dout, smoke):
        calls.append(fn.__name__)
        return next(times)

    def tilegen(q, k, v):
        return _math(q, k, v)

    def math(q, k, v):
        return _math(q, k, v)

    monkeypatch.setattr(bench, "_peers", lambda cell, names, det: {"tilegen": tilegen, "math": math})
    monkeypatch.setattr(bench, "_times", timed)
    row = bench.bench_cell(bench.Cell(33, 16, 2, 2, False, "fp32", batch=1), ["tilegen", "math"], "cpu", smoke=True,
                           rounds=3)
    assert calls == ["tilegen", "math", "math", "tilegen", "tilegen", "math"]
    assert row["tilegen"]["bwd_ms_rounds"] == [1.0, 6.0, 3.0] and row["tilegen"]["bwd_ms"] == 3.0
    assert row["tilegen"]["fwd_bwd_ms"] == 3.0 and row["math"]["bwd_ms"] == 4.0 and row["math"]["fwd_bwd_ms"] == 4.0


def test_the_smoke_run_checks_and_times_tilegens_backward(tmp_path):
    code = bench.main(["--smoke", "--masks", "causal", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "backward.json").read_text())["rows"]
    assert code == 0 and all(r["check"]["passed"] and "bwd_ms" in r["tilegen"] for r in rows), rows


def test_the_ragged_smoke_run_checks_and_times_both(tmp_path, capsys):
    """--ragged: the packed batch's gradients checked against SDPA's math backend, then the ragged and the
    dense backward timed at the same tokens (under the interpreter the times mean nothing)."""
    code = bench.main(["--smoke", "--ragged", "--heads", "4/2", "--masks", "causal", "--seqlens", "33",
                       "--out", str(tmp_path)])
    assert code == 0
    rows = json.loads((tmp_path / "backward_ragged.json").read_text())["rows"]
    assert rows[0]["check"]["passed"] and sum(rows[0]["lengths"]) == 33
    assert "ratio" in capsys.readouterr().out


def test_ragged_lengths_pack_the_cells_tokens():
    cell = bench.Cell(1024, 64, 32, 8, True)
    lengths = bench.ragged_lengths(cell)
    assert sum(lengths) == 16384 and all(1 <= n < 7 * 1024 // 4 for n in lengths) and len(set(lengths)) > 1


def test_the_ragged_smoke_run_times_forced_configs(tmp_path):
    """--ragged --configs: the ragged backward again under each config, its gradients checked against the
    dispatched config's first."""
    configs = [{"block_m1": 16, "block_n1": 32, "num_warps1": 4, "num_stages1": 1, "block_m2": 32, "block_n2": 16,
                "num_warps2": 4, "num_stages2": 1},
               {"block_m1": 16, "block_n1": 32, "num_warps1": 4, "num_stages1": 1, "block_m2": 16, "block_n2": 32,
                "num_warps2": 4, "num_stages2": 1, "atomic_dq": 1},
               {"block_m1": 24, "block_n1": 32, "num_warps1": 4, "num_stages1": 1, "block_m2": 32, "block_n2": 16,
                "num_warps2": 4, "num_stages2": 1}]  # feasible refuses it: reported, not timed
    code = bench.main(["--smoke", "--ragged", "--heads", "4/2", "--masks", "causal", "--seqlens", "33",
                       "--configs", json.dumps(configs), "--out", str(tmp_path)])
    assert code == 0
    [row] = json.loads((tmp_path / "backward_ragged.json").read_text())["rows"]
    forced = [row[key] for key in row if key.startswith("ragged ")]
    assert len(forced) == 3 and all("bwd_ms" in f and f["error_vs_dispatched"] < 1e-4 for f in forced[:2]), row
    assert forced[2] == {"error": "infeasible: block_m1=24: the template asserts a power of two and a multiple of 16"}
