"""Tuning a mod spec: ``tilegen tune --score-mod pkg.module:fn --mask-mod pkg.module:fn`` under the
interpreter stores a row keyed by the mod spec, whose trials ran the mods' captured tensors and were
checked against the reference with the mods; a ``tilegen.attention`` call with the same mods then
dispatches to that row. Bad paths end in one line naming the option.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tilegen
from tilegen import dispatch
from tilegen.cli import app
from tilegen.cli.spec_args import presets
from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB
from tilegen.device import CPU_INTERPRETER, device_info
from tilegen.families import relative_error
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import Config
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.mods.trace import trace

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not device_info().is_interpreter, reason="CPU-interpreter tuning tests")

MODS = textwrap.dedent("""
    import torch

    def make_alibi(*, batch, heads, n_q, n_k, device):
        # A factory: the slopes fit each tuned problem's head count.
        slopes = torch.linspace(0.1, 0.8, heads, device=device)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return alibi

    def make_failing(*, batch, heads, n_q, n_k, device):
        raise RuntimeError("no table for this shape")

    def make_too_few(*, batch, heads):
        return near

    def near(b, h, q_idx, kv_idx):  # a mod itself: a window with a sink (a window alone is a built-in)
        return (q_idx - kv_idx < 8) | (kv_idx == 0)

    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 8

    def make_documents(*, batch, heads, n_q, n_k, device):
        # Document ids per request and position; on the paged families positions run over the keys.
        docs = torch.arange(n_k, device=device) // 7 + torch.arange(batch, device=device)[:, None]

        def same_document(b, h, q_idx, kv_idx):
            return docs[b, q_idx] == docs[b, kv_idx]

        return same_document

    def chunks(b, h, q_idx, kv_idx):  # integer // and % by numbers
        return (q_idx // 64 >= kv_idx // 64) & ((q_idx + b) % 5 != 1)

    not_a_function = 3
""")


def _importable(folder: Path, monkeypatch) -> None:
    """``folder``'s ``tune_mods`` importable for one test (another test's copy forgotten)."""
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "tune_mods", raising=False)


def test_a_tuned_mod_spec_is_dispatched_to_by_a_call_with_the_same_mods(tmp_path, monkeypatch):
    (tmp_path / "tune_mods.py").write_text(MODS)
    db = tmp_path / "tuning.sqlite"
    cmd = [sys.executable, "-m", "tilegen", "tune", "--preset", "default", "--db", str(db), "--seqlens", "32",
           "--trials", "1", "--score-mod", "tune_mods:make_alibi", "--mask-mod", "tune_mods:near"]
    # From the module's folder, as a user runs it: the folder is importable.
    # This checkout first, then the caller's path (a Triton installed beside the default one must tune the rows
    # that this process reads).
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    run = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path}, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr

    _importable(tmp_path, monkeypatch)
    import tune_mods

    heads = 2
    score_mod, mask_mod = tune_mods.make_alibi(batch=1, heads=heads, n_q=32, n_k=32, device="cpu"), tune_mods.near
    spec = presets()["default"].replace(score_mod=trace(score_mod, "score_mod").canonical,
                                        mask_mod=trace(mask_mod, "mask_mod").canonical)
    key = dict(spec=spec, device=CPU_INTERPRETER, template_hash=template_hash(ATTENTION_FWD),
               triton_version=__import__("triton").__version__)
    with TuningDB(db) as tdb:
        rows = tdb.best(**key)
        assert sorted(rows) == [32]
        (trial,) = [t for t in tdb.trials_for(spec.hash) if t.bucket == 32]
        assert trial.status == "ok"
    row = Config.from_dict(rows[32].config)

    # The call's dispatch, from the database afresh: the row of the mod spec, with its config.
    monkeypatch.setenv("TILEGEN_DB", str(db))
    dispatch.reset()
    assert dispatch.table_on(spec, torch.device("cpu")).choose(32).source == str(db)
    launched = []
    real = tilegen.ops.attention.launcher_for

    def recording(launched_spec):
        launcher = real(launched_spec)

        class Recorder:
            def jit(self, *args, **kwargs):
                launched.append((launched_spec, kwargs))
                return launcher.jit(*args, **kwargs)

        return Recorder()

    monkeypatch.setattr(tilegen.ops.attention, "launcher_for", recording)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 32, 64, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    out = tilegen.attention(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)
    ((launched_spec, kwargs),) = launched
    assert launched_spec == spec
    assert {name: kwargs[name] for name in row.to_dict()} == row.to_dict()
    ref, _ = attention_reference(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)
    assert relative_error(out, ref)[0] < 1e-2

    # db verify runs a mod spec's row when given the mods it was tuned with (a trial needs their functions), and
    # says it leaves it alone otherwise, where it ended in a traceback.
    from tilegen.mods import sources

    monkeypatch.setenv(sources.ENV, "{}")  # the command exports the paths it is given; restored after the test
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    alone = runner.invoke(app, ["db", "verify", "--db", str(db)])
    assert alone.exit_code == 0, alone.output
    said = " ".join(alone.stdout.split())
    assert "1 row(s) of specs with score or mask mods the command did not name: not run" in said
    named = runner.invoke(app, ["db", "verify", "--db", str(db), "--score-mod", "tune_mods:make_alibi",
                                "--mask-mod", "tune_mods:near"])
    assert named.exit_code == 0, named.output
    assert "BM" in named.stdout and "│ ok" in named.stdout and "not run" not in named.stdout


@pytest.mark.parametrize("args, message", [
    (["--score-mod", "tune_mods"], "--score-mod: expected pkg.module:function"),
    (["--score-mod", "no_such_module:fn"], "--score-mod: cannot import module 'no_such_module'"),
    (["--mask-mod", "tune_mods:missing"], "--mask-mod: module 'tune_mods' has no attribute 'missing'"),
    (["--mask-mod", "tune_mods:not_a_function"], "--mask-mod: tune_mods:not_a_function is a int, not callable"),
    (["--mask-mod", "tune_mods:make_alibi"], "--mask-mod: tune_mods:make_alibi: mask_mod: expected 4 arguments"),
    (["--preset", "rope-d128", "--score-mod", "tune_mods:make_alibi"], "--score-mod: rope specs take no mods"),
    (["--preset", "gemma-softcap", "--score-mod", "tune_mods:make_alibi"], "--score-mod: softcap: with a score_mod"),
    (["--mask-mod", "tune_mods:window"], "--mask-mod: tune_mods:window keeps a band of diagonals, which calls run as "
                                         "the built-in window (7, None)"),
    (["--mask-mod", "tune_mods:make_failing"], "--mask-mod: the factory make_failing failed for batch=1, heads=1, "
                                               "n_q=16, n_k=16 (RuntimeError: no table for this shape)"),
    (["--mask-mod", "tune_mods:make_too_few"], "--mask-mod: the factory make_too_few failed for batch=1, heads=1, "
                                               "n_q=16, n_k=16 (TypeError: "),
], ids=["no-colon", "no-module", "no-attribute", "not-callable", "wrong-kind", "family-without-mods", "softcap",
        "a-built-in", "factory-raises", "factory-arguments"])
def test_bad_mod_options_end_in_one_line_naming_the_option(tmp_path, monkeypatch, args, message):
    (tmp_path / "tune_mods.py").write_text(MODS)
    monkeypatch.chdir(tmp_path)
    _importable(tmp_path, monkeypatch)
    result = CliRunner().invoke(app, ["tune", "--db", str(tmp_path / "fresh.sqlite"), *args])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert message in result.stderr.splitlines()[-1], result.stderr
    assert not (tmp_path / "fresh.sqlite").exists()


def test_a_mod_spec_given_whole_names_the_option_and_dispatch_suggests_a_command_that_tunes(tmp_path, monkeypatch):
    """A spec holding a mod's text (as dispatch's log shows it) cannot be tuned without the mod's function: one line
    naming --score-mod, nothing measured. The command dispatch suggests for it takes the spec without the mod and
    a --score-mod placeholder, which, filled in with the mod's path, tunes the same spec."""
    (tmp_path / "tune_mods.py").write_text(MODS)
    monkeypatch.chdir(tmp_path)
    _importable(tmp_path, monkeypatch)
    import tune_mods

    alibi = tune_mods.make_alibi(batch=1, heads=1, n_q=16, n_k=16, device="cpu")
    spec = presets()["default"].replace(score_mod=trace(alibi, "score_mod").canonical)
    (tmp_path / "spec.json").write_text(spec.to_json())
    result = CliRunner().invoke(app, ["tune", "--db", str(tmp_path / "fresh.sqlite"), "--spec",
                                      str(tmp_path / "spec.json"), "--sizes", "16", "--trials", "1"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "a spec with mods is tuned through tilegen tune --score-mod" in result.stderr.splitlines()[-1]
    assert not (tmp_path / "fresh.sqlite").exists()

    command = dispatch.tune_command(spec, 16)
    assert "score_mod" not in command and " --score-mod PKG.MODULE:FUNCTION " in command, command
    args = command.replace("PKG.MODULE:FUNCTION", "tune_mods:make_alibi").split(" ", 2)[2]
    spec_json = args[len("--spec '"):args.index("' ")]
    rest = args[args.index("' ") + 2:].split()
    result = CliRunner().invoke(app, ["tune", "--db", str(tmp_path / "tuned.sqlite"), "--spec", spec_json, *rest,
                                      "--trials", "1"])
    assert result.exit_code == 0, result.output
    with TuningDB(tmp_path / "tuned.sqlite") as db:
        assert [row.spec_hash for row in db.list_tuned()] == [spec.hash]


def test_emit_takes_the_mod_options(tmp_path, monkeypatch):
    (tmp_path / "tune_mods.py").write_text(MODS)
    _importable(tmp_path, monkeypatch)
    result = CliRunner().invoke(app, ["emit", "--preset", "default", "--mask-mod", "tune_mods:near"])
    assert result.exit_code == 0, result.stderr
    assert "def _mask_mod(b, h, q_idx, kv_idx):" in result.stdout and "_mmod" in result.stdout


@pytest.mark.parametrize("family_spec", [
    {"family": "attention_varlen", "head_dim": 32, "q_per_kv": 2, "mask": "causal", "kv_layout": "paged",
     "page_size": 16},
    {"family": "attention_varlen", "head_dim": 32, "q_per_kv": 2, "mask": "causal"},
    {"family": "attention_decode", "head_dim": 32, "q_per_kv": 2, "page_size": 16},
], ids=["paged", "ragged", "decode"])
def test_the_serving_families_trials_run_and_check_the_mods(tmp_path, monkeypatch, family_spec):
    """A trial of each serving family builds the mods from their paths (as the tune's processes do), runs
    the default config with them and passes the reference's check at the family's positions; without
    the mods the same output fails it."""
    from tilegen.families import family_of, spec_from_json
    from tilegen.mods import sources
    from tilegen.tuning.measure import measure

    (tmp_path / "tune_mods.py").write_text(MODS)
    _importable(tmp_path, monkeypatch)
    monkeypatch.setenv(sources.ENV, '{"score_mod": "tune_mods:make_alibi", "mask_mod": "tune_mods:make_documents"}')
    spec = spec_from_json(family_spec).replace(score_mod=sources.canonical_text("tune_mods:make_alibi", "score_mod"),
                                               mask_mod=sources.canonical_text("tune_mods:make_documents", "mask_mod"))
    family = family_of(spec)
    bucket = family.buckets.of((40, 3)) if family.buckets.batch_unit is not None else 40
    problem = family.problem(spec, bucket, on_gpu=False)
    config = family.default_config(spec, CPU_INTERPRETER, bucket)
    assert measure(problem, config, 0)["status"] == "ok"
    inputs = problem.inputs(0)
    outputs = problem.outputs(inputs)
    problem.launch(tilegen.dispatch.launcher_for(spec), config, inputs, outputs)
    inputs["mods"].score_mod = inputs["mods"].mask_mod = None  # the reference without the mods
    assert problem.check(inputs, outputs)[0] > problem.tolerance


def test_a_backward_trial_runs_and_checks_the_mods(tmp_path, monkeypatch):
    """The attention backward with mods is tuned as the forward is: a trial builds the mods from their paths,
    launches the dK/dV and dQ kernels with their tensors and block tables, and passes the check against autograd
    of the reference through the mods; without the mods the same gradients fail it."""
    import dataclasses

    from tilegen.families import family_of, spec_from_json
    from tilegen.mods import sources
    from tilegen.tuning.measure import measure

    (tmp_path / "tune_mods.py").write_text(MODS)
    _importable(tmp_path, monkeypatch)
    monkeypatch.setenv(sources.ENV, '{"score_mod": "tune_mods:make_alibi", "mask_mod": "tune_mods:make_documents"}')
    spec = spec_from_json({"family": "attention_bwd", "head_dim": 16, "q_per_kv": 2, "mask": "causal"}).replace(
        score_mod=sources.canonical_text("tune_mods:make_alibi", "score_mod"),
        mask_mod=sources.canonical_text("tune_mods:make_documents", "mask_mod"))
    family = family_of(spec)
    problem = family.problem(spec, 32, on_gpu=False)
    config = family.default_config(spec, CPU_INTERPRETER, 32)
    assert measure(problem, config, 0)["status"] == "ok"
    inputs = problem.inputs(0)
    outputs = problem.outputs(inputs)
    problem.launch(tilegen.dispatch.launcher_for(spec), config, inputs, outputs)
    assert problem.check(inputs, outputs)[0] < problem.tolerance
    plain = dataclasses.replace(inputs[-1], score_mod=None, mask_mod=None)
    assert problem.check((*inputs[:-1], plain), outputs)[0] > problem.tolerance
