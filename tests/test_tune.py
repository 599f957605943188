"""``tilegen tune`` and the tuner: studies, failures, resumption, concurrency, and dispatch of the result.

Everything runs under Triton's interpreter at tiny lengths (buckets 16 to 64), where
the search space is nine block-size configs and a trial takes well under a second.
Tests that need a process of their own (a kill, two tunes at once, a fresh dispatch)
start ``python -m tilegen``; the rest drive ``Tuner`` in this process.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import triton
from typer.testing import CliRunner

from helpers import checkout_pythonpath

from tilegen.cli import app
from tilegen.cli.spec_args import presets
from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB, studies_url
from tilegen.device import CPU_INTERPRETER, device_info
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import Config
from tilegen.tuning import INJECT_ENV, Tuner, TuningKey

ROOT = Path(__file__).resolve().parent.parent
SPEC = presets()["default"]  # bf16, head dim 64, causal
KEY = dict(spec=SPEC, device=CPU_INTERPRETER, template_hash=template_hash(ATTENTION_FWD), triton_version=triton.__version__)

pytestmark = pytest.mark.skipif(not device_info().is_interpreter, reason="CPU-interpreter tuning tests")


def _env(**extra: str) -> dict[str, str]:
    """This process's environment (interpreter, cache folder) with the checkout importable first; the rest of its
    ``PYTHONPATH`` stays, so a subprocess imports the Triton and torch this process does (rows of another Triton
    would be stale to the parent)."""
    return {**os.environ, "PYTHONPATH": checkout_pythonpath(), **extra}


def _tune_cmd(db: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "tilegen", "tune", "--preset", "default", "--db", str(db), *args]


def _trials(db: Path, bucket: int) -> list:
    with TuningDB(db) as tdb:
        return [t for t in tdb.trials_for(SPEC.hash) if t.bucket == bucket]


def _configs(trials) -> Counter:
    return Counter(str(Config.from_dict(t.config)) for t in trials)


def test_study_name_spells_out_every_part_of_the_key():
    key = TuningKey.current(SPEC, CPU_INTERPRETER, 1024)
    assert key.study_name == (
        f"{SPEC.name}-{SPEC.hash}-cpu-interpreter-sm00-tpl{KEY['template_hash']}-triton{triton.__version__}-n1024"
    )
    assert key.fields() == {**KEY, "bucket": 1024}


def test_tuned_configs_reach_dispatch_in_a_fresh_process(tmp_path):
    db = tmp_path / "tuning.sqlite"
    run = subprocess.run(_tune_cmd(db, "--seqlens", "16,32", "--trials", "3"), env=_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Triton interpreter" in run.stderr
    # The file alone holds the rows, as one copies or ships it: the tune checkpointed its write-ahead log.
    alone = tmp_path / "copied.sqlite"
    shutil.copyfile(db, alone)
    with TuningDB(alone) as copied:
        assert sorted(copied.best(**KEY)) == [16, 32]
    with TuningDB(db) as tdb:
        best = {bucket: str(Config.from_dict(row.config)) for bucket, row in tdb.best(**KEY).items()}
    assert sorted(best) == [16, 32]

    script = textwrap.dedent("""
        import json, torch, tilegen
        from tilegen.families.attention_fwd.reference import attention_reference
        seen = {}
        for n in (16, 32):
            q, k, v = (torch.randn(1, 2, n, 64, dtype=torch.bfloat16) for _ in range(3))
            choice = tilegen.explain(q, k, v, causal=True)
            out = tilegen.attention(q, k, v, causal=True)
            ref, _ = attention_reference(q, k, v, causal=True)
            error = float((out.double() - ref).norm() / ref.norm())
            seen[n] = {"config": str(choice.config), "source": choice.source,
                       "tuned_bucket": choice.tuned_bucket, "error": error}
        print(json.dumps(seen))
    """)
    fresh = subprocess.run([sys.executable, "-c", script], env=_env(TILEGEN_DB=str(db)), cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    seen = {int(n): choice for n, choice in json.loads(fresh.stdout.splitlines()[-1]).items()}
    for n in (16, 32):
        assert seen[n]["config"] == best[n]
        assert seen[n]["source"] == str(db)
        assert seen[n]["tuned_bucket"] == n
        assert seen[n]["error"] < 1e-2


def test_failing_configs_get_their_status_and_never_win(tmp_path, monkeypatch):
    # The grid reaches every injected config. The default config fails too, so the best
    # cannot be the config dispatch would use anyway.
    failures = {str(ATTENTION_FWD.default_config(SPEC, CPU_INTERPRETER, 64)): "compile_error", "BM16-BN16-w4-s1": "wrong",
                "BM64-BN32-w4-s1": "crash", "BM32-BN16-w4-s1": "hang"}
    monkeypatch.setenv(INJECT_ENV, json.dumps(failures))
    with (
        TuningDB(tmp_path / "tuning.sqlite") as tdb,
        Tuner(tdb, CPU_INTERPRETER, sampler="grid", trial_timeout=5) as tuner,
    ):
        result = tuner.tune(SPEC, 32)
        trials = _trials(tdb.path, 32)
        best = tdb.best(**KEY)[32]

    status = {str(Config.from_dict(t.config)): t.status for t in trials}
    reason = {str(Config.from_dict(t.config)): t.reason for t in trials}
    assert {c: status[c] for c in failures} == {
        str(ATTENTION_FWD.default_config(SPEC, CPU_INTERPRETER, 64)): "compile_error", "BM16-BN16-w4-s1": "wrong",
        "BM64-BN32-w4-s1": "fault", "BM32-BN16-w4-s1": "timeout",
    }
    assert "PassManager::run failed" in reason[str(ATTENTION_FWD.default_config(SPEC, CPU_INTERPRETER, 64))]
    assert "relative error" in reason["BM16-BN16-w4-s1"]
    assert "exit code 1" in reason["BM64-BN32-w4-s1"]
    # The worker was replaced after the crash and the hang: every other config still ran.
    assert all(s == "ok" for c, s in status.items() if c not in failures)
    assert len(status) == len(ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER))
    assert str(result.best.config) not in failures
    assert str(Config.from_dict(best.config)) == str(result.best.config)
    assert best.time_ms == min(t.time_ms for t in trials if t.status == "ok")


@pytest.mark.parametrize("where", ["out", "lse"])
def test_an_unwritten_element_outside_the_checked_rows_fails_the_trial(where):
    # On a GPU the reference covers batch 0's leading heads and last rows only; the NaN poison elsewhere must
    # still fail a config that leaves part of the output unwritten (a tile its schedule skipped), as the other
    # families' checks do.
    from tilegen.families.attention_fwd import AttentionSpec
    from tilegen.families.attention_fwd.reference import attention_reference

    spec = AttentionSpec(head_dim=16, mask="causal", dtype="fp32", return_lse=True)
    problem = ATTENTION_FWD.problem(spec, 16, on_gpu=False, batch=2)
    inputs = problem.inputs(seed=0)
    ref, ref_lse = attention_reference(*inputs, causal=True, scale=problem.scale)
    outputs = (ref.float(), ref_lse.float())
    assert problem.check(inputs, outputs)[0] < problem.tolerance
    outputs[where == "lse"][1, 0, 0] = math.nan
    assert problem.check(inputs, outputs) == (math.inf, math.inf)


@pytest.mark.parametrize("which", ["dq", "dk", "dv"])
def test_a_backward_wrong_in_the_last_batch_and_kv_group_fails_the_trial(which):
    """A kernel that offsets a batch or a KV head wrongly writes finite values: the check compares the last batch's
    last KV group with the reference too, not batch 0's first group alone."""
    from tilegen.families import registry
    from tilegen.families.attention_bwd import AttentionBwdSpec
    from tilegen.families.attention_bwd.reference import attention_backward_reference

    family = registry.get("attention_bwd")
    spec = AttentionBwdSpec(head_dim=16, q_per_kv=2, mask="causal", dtype="fp32")
    problem = family.problem(spec, 16, on_gpu=False, batch=2, heads_q=4)
    assert (problem.batch, problem.heads_kv) == (2, 2)
    inputs = problem.inputs(seed=0)
    q, k, v, _, dout, _ = inputs
    outputs = [t.float() for t in attention_backward_reference(q, k, v, dout, causal=True)]
    assert problem.check(inputs, outputs)[0] < problem.tolerance
    outputs["dq dk dv".split().index(which)][-1, -1, 3] += 100.0
    assert not problem.check(inputs, outputs)[0] < problem.tolerance


def test_grid_measures_every_feasible_config_once(tmp_path):
    with TuningDB(tmp_path / "tuning.sqlite") as tdb, Tuner(tdb, CPU_INTERPRETER, sampler="grid") as tuner:
        tuner.tune(SPEC, 32)
        again = tuner.tune(SPEC, 32)  # a finished study: nothing left to measure
        trials = _trials(tdb.path, 32)
    assert _configs(trials) == Counter(str(c) for c in ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER))
    assert sum(again.statuses.values()) == len(trials)


def test_grid_measures_every_config_when_finished_trials_still_look_in_flight(tmp_path, monkeypatch):
    # Another process's trial records its result before it leaves RUNNING, so for a moment its config
    # is measured and in flight at once. Here every measured config stays in flight for good: counting
    # such a config twice would stop the grid short, and the config it stopped on would be lost.
    def in_flight(self, run, trial):
        if trial is None:  # the wait after the search: nothing runs elsewhere
            return set()
        return set(run.done) - {run.space.config_of(trial.params).to_json()}

    monkeypatch.setattr(Tuner, "_in_flight", in_flight)
    with TuningDB(tmp_path / "tuning.sqlite") as tdb, Tuner(tdb, CPU_INTERPRETER, sampler="grid") as tuner:
        tuner.tune(SPEC, 16)
        trials = _trials(tdb.path, 16)
    assert _configs(trials) == Counter(str(c) for c in ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER))


def test_warm_start_measures_the_default_then_the_neighbours_best(tmp_path):
    with TuningDB(tmp_path / "tuning.sqlite") as tdb:
        neighbour = Config(64, 64, 4, 1)
        tdb.record_best(**KEY, bucket=16, config=neighbour.to_dict(), time_ms=1.0, max_error=0.0, trials=1)
        with Tuner(tdb, CPU_INTERPRETER, trials=2) as tuner:
            tuner.tune(SPEC, 32)
        trials = sorted(_trials(tdb.path, 32), key=lambda t: t.trial_number)
    order = [str(Config.from_dict(t.config)) for t in trials]
    assert order == [str(ATTENTION_FWD.default_config(SPEC, CPU_INTERPRETER, 64)), str(neighbour)]


def test_killed_tune_resumes_without_losing_or_repeating_trials(tmp_path):
    db = tmp_path / "tuning.sqlite"
    cmd = _tune_cmd(db, "--seqlens", "32", "--trials", "100")
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (db.exists() and len(_trials(db, 32)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the tune ended before it could be killed"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the tune and its worker, as a kill of the job would
        proc.wait()
    before = _configs(_trials(db, 32))
    assert 2 <= sum(before.values()) < len(ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER))

    rerun = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    after = _configs(_trials(db, 32))
    assert after == Counter(str(c) for c in ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER))  # each config exactly once
    assert all(after[c] == n for c, n in before.items())


def _interrupt_mid_trial(cmd, db, signum, status, *, running, deadline_s):
    """Run ``cmd`` with every config but the default slowed to 600 s, signal its process group once
    ``running`` trials are in flight, and check it ended in one line with ``status``; the default's
    label and the seconds from the signal to the end."""
    studies = studies_url(db)
    default = str(ATTENTION_FWD.default_config(SPEC, CPU_INTERPRETER, 32))
    # The warm start's default is measured first; whichever config a process proposes next is in flight.
    slow = {str(c): "sleep:600" for c in ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER) if str(c) != default}
    proc = subprocess.Popen(cmd, env=_env(**{INJECT_ENV: json.dumps(slow)}), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + deadline_s
        while not (_running_trials(studies) >= running and db.exists() and _trials(db, 32)):
            assert proc.poll() is None and time.monotonic() < deadline, "the tune ended before it could be interrupted"
            time.sleep(0.1)
        time.sleep(0.5)  # into the measurements
        os.killpg(proc.pid, signum)  # the tune and its processes, as a terminal's Ctrl-C or a kill of the job
        signalled = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == status, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [stderr.splitlines()[-1]], stderr
    assert errors[0].startswith(f"error: interrupted by {signal.Signals(signum).name}")
    return default, took


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_tune_ends_in_one_line_and_measures_its_trial_in_flight_on_resume(tmp_path, signum, status):
    """Ctrl-C (or a kill of the job) mid-trial: one line, the shell's status, no trial left RUNNING,
    and the config in flight queued in the study, so that the same command measures it first."""
    db = tmp_path / "tuning.sqlite"
    studies = studies_url(db)
    cmd = _tune_cmd(db, "--seqlens", "32", "--trials", "3")
    default, _ = _interrupt_mid_trial(cmd, db, signum, status, running=1, deadline_s=120)
    assert _configs(_trials(db, 32)) == Counter([default])  # the interrupted trial recorded nothing
    (name,) = optuna.get_all_study_names(studies)
    trials = optuna.load_study(study_name=name, storage=studies).get_trials(deepcopy=False)
    states = Counter(t.state.name for t in trials)
    assert states == Counter(COMPLETE=1, FAIL=1, WAITING=1), states  # none RUNNING
    failed, queued = (next(t for t in trials if t.state.name == state) for state in ("FAIL", "WAITING"))
    assert queued.params == failed.params
    interrupted = _config_of(failed.params)
    assert interrupted != default

    rerun = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    after = _configs(_trials(db, 32))
    assert after[interrupted] == 1 and sum(after.values()) == 4 and max(after.values()) == 1, after
    assert "4/0/0" in rerun.stdout  # the summary counts it


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_pool_leaves_no_trial_running_and_measures_its_trials_in_flight_on_resume(
        tmp_path, signum, status):
    """Ctrl-C (or a kill of the job) while two tune processes of --workers measure: one line soon after,
    the shell's status, no trial left RUNNING, and each config in flight queued again, as with one process."""
    db = tmp_path / "tuning.sqlite"
    studies = studies_url(db)
    cmd = _tune_cmd(db, "--seqlens", "32", "--trials", "3", "--workers", "2")
    default, took = _interrupt_mid_trial(cmd, db, signum, status, running=2, deadline_s=180)
    assert took < 30, took  # the tune processes are asked to stop, and killed after a bounded wait
    assert _configs(_trials(db, 32)) == Counter([default])  # the interrupted trials recorded nothing
    (name,) = optuna.get_all_study_names(studies)
    trials = optuna.load_study(study_name=name, storage=studies).get_trials(deepcopy=False)
    states = Counter(t.state.name for t in trials)
    assert states["RUNNING"] == 0 and states["COMPLETE"] == 1 and states["FAIL"] == 2, states
    failed = [t for t in trials if t.state.name == "FAIL"]
    queued = [t for t in trials if t.state.name == "WAITING"]
    interrupted = sorted(_config_of(t.params) for t in failed)
    assert sorted(_config_of(t.params) for t in queued) == interrupted
    assert default not in interrupted and len(set(interrupted)) == 2

    rerun = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    after = _configs(_trials(db, 32))
    assert all(after[c] == 1 for c in interrupted) and max(after.values()) == 1, after


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_dead_process_trial_queued_again_is_not_reaped_while_another_process_takes_it(tmp_path):
    """The copy of a dead process's trial carries no worker label: while a second process has taken
    it from the queue but not yet labelled it, a third one's reap would otherwise read the dead
    process's label, fail the copy and queue it again, and the config would be measured twice."""
    from tilegen.tuning.tuner import WORKER_ATTR

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with TuningDB(tmp_path / "tuning.sqlite") as db, Tuner(db, CPU_INTERPRETER, trials=3) as tuner:
        run = tuner._open(SPEC, 32, None)
        storage = run.study._storage
        trial = run.study.ask()
        trial.set_user_attr(WORKER_ATTR, f"{socket.gethostname()}:{dead.pid}")
        run.space.suggest(trial)
        tuner._reap(run)  # the dead process's trial: failed and queued again
        (copy,) = [t for t in run.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
                   if t.system_attrs.get("failed_trial") == trial.number]
        assert copy.params == storage.get_trial(trial._trial_id).params and WORKER_ATTR not in copy.user_attrs
        assert storage.set_trial_state_values(copy._trial_id, optuna.trial.TrialState.RUNNING)  # taken
        tuner._reap(run)
        assert storage.get_trial(copy._trial_id).state == optuna.trial.TrialState.RUNNING
        copies = [t for t in run.study.get_trials(deepcopy=False) if t.system_attrs.get("failed_trial") is not None]
        assert [t.number for t in copies] == [copy.number]


def _config_of(params: dict) -> str:
    """The label of the config a TPE trial's parameters name."""
    from tilegen.tuning.tuner import _Knobs

    knobs = _Knobs(Config, ATTENTION_FWD.search_space(SPEC, CPU_INTERPRETER))
    return str(knobs.config_of(params))


def _running_trials(studies: str) -> int:
    import sqlite3

    path = studies.removeprefix("sqlite:///")
    if not Path(path).exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as conn:
        try:
            return conn.execute("SELECT count(*) FROM trials WHERE state = 'RUNNING'").fetchone()[0]
        except sqlite3.OperationalError:  # the tables are still being created
            return 0


def test_concurrent_tunes_on_one_database_both_complete(tmp_path):
    db = tmp_path / "tuning.sqlite"  # fresh: both processes create the database and the studies file
    procs = [
        subprocess.Popen(_tune_cmd(db, "--seqlens", n, "--trials", "4"), env=_env(), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for n in ("16", "32")
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err
    for bucket in (16, 32):
        assert sum(_configs(_trials(db, bucket)).values()) == 4
    with TuningDB(db) as tdb:
        assert sorted(tdb.best(**KEY)) == [16, 32]


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(["--preset", "nope"], "unknown preset 'nope'", id="unknown-preset"),
        pytest.param(["--seqlens", "abc"], "--seqlens", id="seqlens-not-a-number"),
        pytest.param(["--seqlens", "0"], "--seqlens", id="seqlens-zero"),
        pytest.param(["--seqlens", "16,,32"], "--seqlens", id="seqlens-empty-item"),
        pytest.param(["--sampler", "random"], "--sampler", id="unknown-sampler"),
        pytest.param(["--trials", "0"], "--trials", id="trials-zero"),
        pytest.param(["--compile-ahead", "-1"], "--compile-ahead", id="compile-ahead-negative"),
        pytest.param(["--db", "{tmp}/corrupt.sqlite"], "corrupt", id="corrupt-db"),
        pytest.param(["--db", "{tmp}/ok.sqlite"], "Optuna studies file", id="corrupt-studies-file"),
        pytest.param(["--db", "{tmp}/ok.sqlite"], "ok.optuna.sqlite: file is not a database", id="corrupt-studies-cause"),
        pytest.param(["--db", "{tmp}/locked.sqlite", "--seqlens", "16", "--trials", "1"],
                     "locked.optuna.sqlite.lock: Is a directory", id="studies-lock-unusable"),
    ],
)
def test_bad_input_exits_with_one_line_and_no_traceback(tmp_path, args, message):
    (tmp_path / "corrupt.sqlite").write_bytes(b"this is not an SQLite database" * 100)
    (tmp_path / "ok.optuna.sqlite").write_bytes(b"this is not an SQLite database" * 100)
    (tmp_path / "locked.optuna.sqlite.lock").mkdir()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = CliRunner().invoke(app, ["tune", "--db", str(tmp_path / "fresh.sqlite"), *args])
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit)  # a clean exit, not an escaped exception
    assert result.stderr.splitlines()[-1].startswith("error: ")
    assert message in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.output


class _ScriptedWorker:
    """Answers every measurement from a fixed table of times, without running a kernel."""

    def __init__(self, times: dict[str, float]):
        self.times = times
        self.measured: list[str] = []

    def measure(self, task, timeout) -> dict:
        self.measured.append(str(task[2]))
        return {"status": "ok", "time_ms": self.times[str(task[2])], "max_error": 0.0, "reason": None}

    def close(self) -> None:
        pass


def test_a_study_from_categorical_knobs_resumes(tmp_path):
    """Studies made when TPE's knobs were categorical by value still resume: the names differ."""
    db_path = tmp_path / "tuning.sqlite"
    key = TuningKey.current(SPEC, CPU_INTERPRETER, 16)
    configs = ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER)
    times = {str(c): 1.0 + i for i, c in enumerate(configs)}
    with TuningDB(db_path) as db:
        old = optuna.create_study(storage=studies_url(db_path), study_name=key.study_name)
        trial = old.ask()
        for name, value in configs[0].to_dict().items():
            trial.suggest_categorical(name, [value, value * 2])
        old.tell(trial, 1.0)
        worker = _ScriptedWorker(times)
        with Tuner(db, CPU_INTERPRETER, trials=3, worker=worker) as tuner:
            result = tuner.tune(SPEC, 16)
    assert len(worker.measured) == 3 and len(set(worker.measured)) == 3
    assert str(result.best.config) == min(worker.measured, key=times.__getitem__)


def test_the_studies_file_is_written_in_wal_mode(tmp_path):
    """Optuna's default (a rollback journal, synced in full on every commit) made a trial's bookkeeping slower."""
    import sqlite3

    db_path = tmp_path / "tuning.sqlite"
    times = {str(c): 1.0 + i for i, c in enumerate(ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER))}
    with TuningDB(db_path) as db, Tuner(db, CPU_INTERPRETER, trials=2, worker=_ScriptedWorker(times)) as tuner:
        tuner.tune(SPEC, 16)
    studies = sqlite3.connect(studies_url(db_path).removeprefix("sqlite:///"))
    try:
        assert studies.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert studies.execute("SELECT COUNT(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0] == 2
    finally:
        studies.close()


def test_warm_start_off_leaves_the_default_to_the_sampler(tmp_path):
    times = {str(c): 1.0 for c in ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER)}
    default = str(ATTENTION_FWD.default_config(SPEC, CPU_INTERPRETER, 16))
    firsts = []
    for seed, warm_start in [(0, True)] + [(s, False) for s in range(5)]:
        worker = _ScriptedWorker(times)
        with TuningDB(tmp_path / f"tuning-{seed}-{warm_start}.sqlite") as db, Tuner(
            db, CPU_INTERPRETER, trials=1, worker=worker, warm_start=warm_start, seed=seed
        ) as tuner:
            tuner.tune(SPEC, 16)
        firsts.append(worker.measured)
    assert firsts[0] == [default]
    assert all(len(f) == 1 for f in firsts[1:]) and any(f != [default] for f in firsts[1:])


def test_a_tune_after_an_import_never_overwrites_the_imported_trials(tmp_path):
    # The imported trials were numbered by a study this machine's studies file does not hold.
    configs = ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER)
    times = {str(c): 1.0 + i for i, c in enumerate(configs)}
    with TuningDB(tmp_path / "elsewhere.sqlite") as db, Tuner(
        db, CPU_INTERPRETER, trials=3, worker=_ScriptedWorker(times)
    ) as tuner:
        tuner.tune(SPEC, 16)
        exported = db.export_json()
    key = TuningKey.current(SPEC, CPU_INTERPRETER, 16)
    with TuningDB(tmp_path / "fresh.sqlite") as db:
        db.import_json(exported)
        imported = {(t.study_name, t.trial_number): (t.config, t.time_ms) for t in db.trials_for(SPEC.hash)}
        assert {name for name, _ in imported} == {f"{key.study_name}-imported"}
        for _ in range(2):  # a new study, then that study resumed
            worker = _ScriptedWorker(times)
            with Tuner(db, CPU_INTERPRETER, trials=2, worker=worker) as tuner:
                tuner.tune(SPEC, 16)
            assert len(worker.measured) == 2
        trials = db.trials_for(SPEC.hash)
        kept = {(t.study_name, t.trial_number): (t.config, t.time_ms) for t in trials}
        assert {k: kept[k] for k in imported} == imported  # every imported trial as it was
        assert len(trials) == 3 + 2 + 2
        assert {t.study_name for t in trials} == {f"{key.study_name}-imported", key.study_name}
        assert len({json.dumps(t.config, sort_keys=True) for t in trials}) == 7  # no config measured twice
        assert db.best(**KEY)[16].time_ms == 1.0


def test_a_tune_against_a_read_only_database_fails_before_measuring(tmp_path, monkeypatch):
    import tilegen.db.store as store

    db = tmp_path / "tuning.sqlite"
    TuningDB(db).close()
    real_access = os.access
    monkeypatch.setattr(store.os, "access", lambda path, mode: False if mode == os.W_OK else real_access(path, mode))
    started = []
    monkeypatch.setattr("tilegen.tuning.worker.Worker._start", lambda self, fork=False: started.append(self))
    result = CliRunner().invoke(app, ["tune", "--db", str(db), "--seqlens", "16", "--trials", "1"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1].startswith(f"error: cannot write the tilegen database {db}")
    assert started == []


# -- the measuring worker's start, and tune processes that fork theirs ------------------------------


def test_the_worker_runs_before_the_first_trial_and_not_for_a_tune_with_nothing_to_measure(tmp_path):
    import multiprocessing

    from tilegen.tuning import Reporter

    class Probe(Reporter):
        """Looks, as each bucket opens (before its first trial), for the measuring child."""

        def __init__(self):
            self.children = []

        def start(self, key, budget, best) -> None:
            self.children.append(sorted(p.name for p in multiprocessing.active_children()))

    opened = Probe()
    with TuningDB(tmp_path / "tuning.sqlite") as tdb:
        with Tuner(tdb, CPU_INTERPRETER, trials=1, reporter=opened) as tuner:
            tuner.tune(SPEC, 16)
        assert opened.children == [["tilegen-tune-worker"]]
        collected = Probe()
        with Tuner(tdb, CPU_INTERPRETER, reporter=collected) as tuner:
            tuner.collect([(SPEC, 16)])  # what the parent of --workers does: it measures nothing
        assert collected.children == [[]]
    assert len(_trials(tmp_path / "tuning.sqlite", 16)) == 1


@pytest.mark.parametrize("fork", [True, False])
def test_compile_processes_start_after_the_worker_has_cuda(fork):
    from tilegen.tuning.worker import Worker

    with Worker() as worker:
        assert not worker.cuda_up.value
        worker.start(fork=fork)
        # Set by the child once its CUDA context exists (none under the interpreter): what
        # the compile processes wait for before creating theirs.
        deadline = time.monotonic() + 120
        while not worker.cuda_up.value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.cuda_up.value


def test_a_forked_worker_runs_cpu_ops_after_its_parent_ran_parallel_ones(tmp_path):
    """The parent's CPU thread pool, started by a parallel op, is no pool in a fork: a child that
    entered it would wait forever (the first trial timed out). A fresh interpreter, so that the
    worker is forked (this process may hold other threads, and then spawns it)."""
    script = textwrap.dedent("""
        import json, torch
        from tilegen.cli.spec_args import presets
        from tilegen.device import CPU_INTERPRETER
        from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
        from tilegen.triton_internals.interpreter import patch_interpreter
        from tilegen.tuning.process import forkable
        from tilegen.tuning.worker import Worker

        patch_interpreter()
        x = torch.randn(512, 512)
        (x @ x).sum()  # starts this process's CPU thread pool
        assert forkable()
        spec, family = presets()["default"], ATTENTION_FWD
        with Worker() as worker:
            worker.start(fork=True)
            task = (family, family.problem(spec, 16, on_gpu=False), family.default_config(spec, CPU_INTERPRETER, 16), 0)
            result = worker.measure(task, 30)
            assert worker._forked
        print(json.dumps(result["status"]))
    """)
    done = subprocess.run([sys.executable, "-c", script], env=_env(TRITON_INTERPRET="1",
                          TILEGEN_CACHE_DIR=str(tmp_path)), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == '"ok"', done.stdout[-2000:]


def test_a_worker_that_cannot_start_fails_the_tune_with_its_reason(tmp_path, monkeypatch):
    from tilegen.tuning import WorkerError

    monkeypatch.setenv(INJECT_ENV, "{not json")  # the child reads it as it starts, and fails
    with (
        TuningDB(tmp_path / "tuning.sqlite") as tdb,
        Tuner(tdb, CPU_INTERPRETER, trials=1) as tuner,
        pytest.raises(WorkerError, match="the tuning worker failed to start: JSONDecodeError"),
    ):
        tuner.tune(SPEC, 16)
    # A tune process of --workers forks its child, and spawns one when that fails; this one fails too.
    run = subprocess.run(_tune_cmd(tmp_path / "pool.sqlite", "--seqlens", "16", "--trials", "1", "--workers", "1"),
                         env=_env(**{INJECT_ENV: "{not json"}), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: interpreter worker 0: the tuning worker failed to start: JSONDecodeError"), last
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("maps, answer, initialized", [
    ("7f00 r-xp /usr/lib/libc.so.6\n", None, False),  # no driver loaded: nothing to ask
    ("7f00 r-xp /usr/lib/libcuda.so.580.159.04\n", 3, False),  # loaded (torch does at import), cuInit not called
    ("7f00 r-xp /usr/lib/libcuda.so.580.159.04\n", 0, True),  # the driver answers: initialized
])
def test_a_fork_is_refused_once_the_cuda_driver_is_initialized_not_once_it_is_loaded(monkeypatch, maps, answer,
                                                                                        initialized):
    import io

    from tilegen.tuning import process as worker_module

    asked = []

    class Driver:
        def cuDeviceGetCount(self, count):  # noqa: N802 - the driver API's name
            asked.append(count)
            return answer

    monkeypatch.setattr(worker_module, "open", lambda path, *a, **k: io.StringIO(maps), raising=False)
    monkeypatch.setattr(worker_module.ctypes, "CDLL", lambda name, mode=0: Driver())
    assert worker_module._driver_initialized() is initialized
    assert len(asked) == (answer is not None)
    monkeypatch.setattr(worker_module, "_driver_initialized", lambda: initialized)
    assert worker_module.forkable() is (not initialized and __import__("threading").active_count() == 1)


def test_no_fork_when_the_driver_state_cannot_be_told(monkeypatch):
    from tilegen.tuning import process as worker_module

    def no_library(name, mode=0):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(worker_module, "open", lambda *a, **k: __import__("io").StringIO("/lib/libcuda.so.1\n"),
                        raising=False)
    monkeypatch.setattr(worker_module.ctypes, "CDLL", no_library)
    assert worker_module._driver_initialized() is None
    assert worker_module.forkable() is False


def test_a_forked_worker_that_cannot_start_is_replaced_by_a_spawned_one(monkeypatch, caplog):
    import logging

    from tilegen.tuning import worker as worker_module

    def no_cuda():
        raise RuntimeError("no CUDA in this copy")

    # The fork inherits these patches; a spawned child imports the module afresh and has neither.
    monkeypatch.setattr(worker_module, "forkable", lambda: True)
    monkeypatch.setattr(worker_module, "_start_cuda", no_cuda)
    caplog.set_level(logging.DEBUG, logger="tilegen.tuning.worker")
    family = ATTENTION_FWD
    task = (family, family.problem(SPEC, 16, on_gpu=False), family.default_config(SPEC, CPU_INTERPRETER, 16), 0)
    with worker_module.Worker() as worker:
        worker.start(fork=True)
        result = worker.measure(task, 120)
    assert result["status"] == "ok", result
    assert "forked worker failed to start" in caplog.text and "no CUDA in this copy" in caplog.text


#: Two small variants for one command: fast under the interpreter, and different kernels.
_TWO_VARIANTS = json.dumps([{"family": "attention_fwd", "head_dim": 16, "dtype": "fp32", "mask": "causal"},
                            {"family": "attention_fwd", "head_dim": 16, "dtype": "fp32", "mask": "none", "q_per_kv": 2}])


@pytest.mark.parametrize("pool", [[], ["--workers", "2"]])
def test_one_command_tunes_several_variants_every_config_of_each_once(tmp_path, pool):
    from tilegen.families import spec_from_json

    db = tmp_path / "tuning.sqlite"
    run = subprocess.run([sys.executable, "-m", "tilegen", "tune", "--spec", _TWO_VARIANTS, "--seqlens", "16",
                          "--sampler", "grid", "--db", str(db), *pool],
                         env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    family = ATTENTION_FWD
    with TuningDB(db) as tdb:
        for item in json.loads(_TWO_VARIANTS):
            spec = spec_from_json(item)
            trials = [t for t in tdb.trials_for(spec.hash) if t.bucket == 16]
            # Every feasible config of each variant measured once: none lost to the other, none twice.
            assert _configs(trials) == Counter(str(c) for c in family.candidates(spec, CPU_INTERPRETER)), spec.name
            assert tdb.best(spec=spec, device=CPU_INTERPRETER, template_hash=template_hash(family),
                            triton_version=triton.__version__)[16].time_ms > 0
            assert spec.name in run.stdout  # a summary table per variant


@pytest.mark.parametrize("args, expected", [
    (["--preset", "default,nope"], "error: Invalid value for --preset: unknown preset 'nope'"),
    (["--preset", "default,"], "error: Invalid value for --preset: expected comma-separated preset names"),
    (["--spec", "[5]"], "error: Invalid value for --spec: item 0: expected a spec object, got 5"),
    (["--spec", "[]"], "error: Invalid value for --spec: the list of specs is empty"),
    (["--spec", '[{"family": "attention_fwd", "head_dim": 64}, {"family": "attention_fwd", "head_dim": 7}]'],
     "error: Invalid value for --spec: item 1: head_dim"),
    (["--preset", "default,mha-d128", "--head-dim", "64"], "error: Invalid value: give one of --spec, --preset"),
])
def test_a_bad_variant_list_ends_in_one_line_naming_the_item(tmp_path, args, expected):
    result = CliRunner().invoke(app, ["tune", *args, "--sizes", "16", "--db", str(tmp_path / "t.sqlite")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1].startswith(expected), result.stderr
    assert not (tmp_path / "t.sqlite").exists()


def test_a_pool_replaces_a_crashed_worker_and_measures_every_config_once(tmp_path):
    # Each tune process forks its first worker; the crash ends that one, and a spawned one carries on.
    crash = "BM64-BN32-w4-s1"
    db = tmp_path / "tuning.sqlite"
    run = subprocess.run(_tune_cmd(db, "--seqlens", "16", "--sampler", "grid", "--workers", "2"),
                         env=_env(**{INJECT_ENV: json.dumps({crash: "crash"})}), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    trials = _trials(db, 16)
    assert _configs(trials) == Counter(str(c) for c in ATTENTION_FWD.candidates(SPEC, CPU_INTERPRETER))
    status = {str(Config.from_dict(t.config)): t.status for t in trials}
    assert status.pop(crash) == "fault"
    assert set(status.values()) == {"ok"}


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (children inherit it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    return pids


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads processes' environments from /proc")
def test_a_pool_whose_command_fails_before_its_plan_stops_its_tune_processes(tmp_path):
    # The tune processes start before the parent checks the sampler and opens the database;
    # a command that fails then ends in one line and leaves none of them (or their workers) behind.
    marker = f"TILEGEN_TEST_MARKER_{os.getpid()}_{time.monotonic_ns()}"
    run = subprocess.run(_tune_cmd(tmp_path / "t.sqlite", "--seqlens", "16", "--sampler", "bogus", "--workers", "2"),
                         env=_env(**{marker: "1"}), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "--sampler" in run.stderr and "Traceback" not in run.stderr, run.stderr
    deadline = time.monotonic() + 20
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)  # a forked worker notices its parent's death within its polling interval
    assert _processes_with(marker) == []
    assert not (tmp_path / "t.sqlite").exists()  # nothing was opened, let alone measured


_POOL_THEN_SLEEP = """
import sys, time
from tilegen.tuning.pool import Pool
with Pool([None, None]) as pool:
    print(" ".join(str(p.pid) for p in pool.procs.values()), flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads processes' command lines from /proc")
def test_a_pool_forks_its_tune_processes_and_they_leave_when_it_dies_before_the_plan(tmp_path):
    # Forked, each holds copies of the parent's ends of the plan pipes; unless it closes them it
    # never reads EOF, and would wait for a plan forever once the parent is killed.
    marker = f"TILEGEN_TEST_MARKER_{os.getpid()}_{time.monotonic_ns()}"
    parent = subprocess.Popen([sys.executable, "-c", _POOL_THEN_SLEEP], env=_env(**{marker: "1"}), cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2
        own = Path(f"/proc/{parent.pid}/cmdline").read_bytes()
        for pid in pids:
            # A copy runs the parent's command line; a spawned process runs multiprocessing's.
            assert Path(f"/proc/{pid}/cmdline").read_bytes() == own
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []


class _DeadOnArrival:
    """A tune process that died before reading its plan: its pipe is closed, its exit code set."""

    started = 0

    def __init__(self, target=None, args=(), name=None, daemon=None):
        self.pid = 0
        self.exitcode = None

    def start(self):
        _DeadOnArrival.started += 1
        self.exitcode = 1

    def join(self, timeout=None):
        pass

    def kill(self):
        pass


class _ClosedPipe:
    def send(self, obj):
        raise BrokenPipeError(32, "Broken pipe")

    def close(self):
        pass


class _Context:
    Process = _DeadOnArrival

    def Pipe(self, duplex=True):  # noqa: N802 - multiprocessing's name
        return _ClosedPipe(), _ClosedPipe()

    def Queue(self):  # noqa: N802 - multiprocessing's name
        import queue

        class _Events(queue.Queue):
            def close(self):
                pass

        return _Events()


def test_a_pool_restarts_a_process_that_died_before_its_plan_and_gives_up_in_one_line(monkeypatch):
    from tilegen.tuning import pool as pool_module

    monkeypatch.setattr(pool_module.multiprocessing, "get_context", lambda method: _Context())
    _DeadOnArrival.started = 0
    echoed = []
    setup = pool_module.Setup(db="x.sqlite", sampler="grid", seed=0, timeout=None, trial_timeout=1.0, heartbeat=20)
    plan = pool_module.Plan(jobs=((SPEC, 16, 1),))
    with pool_module.Pool([None]) as pool, pytest.raises(pool_module.PoolError, match="died .* 4 times"):
        pool.prepare(setup)
        pool.run(plan, {}, None, echo=echoed.append, restarts=3)  # sending to a closed pipe is not the error
    assert _DeadOnArrival.started == 4 and len(echoed) == 3


def test_the_bookkeeping_benchmark_times_a_grid_of_instant_trials():
    run = subprocess.run([sys.executable, "-m", "tilegen.bench.bookkeeping", "--dbs", "sqlite", "--runs", "1"],
                         env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    [line] = [line for line in run.stdout.splitlines() if line.startswith("sqlite: ")]
    assert float(line.split()[1]) > 0 and "ms per trial" in line
    bad = subprocess.run([sys.executable, "-m", "tilegen.bench.bookkeeping", "--dbs", "mysql"],
                         env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--dbs: expected sqlite and/or postgresql, got 'mysql'" in bad.stderr


def _take_queued(db_path: str, study_name: str, results, count: int) -> None:
    from tilegen.tuning.tuner import _storage

    optuna.logging.set_verbosity(optuna.logging.CRITICAL)
    with TuningDB(db_path) as tdb:
        storage, _ = _storage(tdb, 60)
        study = optuna.load_study(study_name=study_name, storage=storage)
        results.put([study._pop_waiting_trial_id() for _ in range(count)])


def test_processes_taking_queued_trials_never_take_one_twice(tmp_path):
    """Optuna takes a queued trial by a read and a write; on SQLite three processes taking them at once
    took some twice (300 queued, 315-318 taken) until the studies' lock made the take one step."""
    import multiprocessing

    db = tmp_path / "tuning.sqlite"
    with TuningDB(db) as tdb:
        study = optuna.create_study(study_name="queue", storage=optuna.storages.RDBStorage(
            tdb.studies_url(), engine_kwargs=tdb.studies_engine()))
        for x in range(150):
            study.enqueue_trial({"x": x})
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    procs = [context.Process(target=_take_queued, args=(str(db), "queue", results, 150)) for _ in range(3)]
    for p in procs:
        p.start()
    taken = [t for _ in procs for t in results.get(timeout=120) if t is not None]
    for p in procs:
        p.join(timeout=60)
    assert sorted(taken) == sorted({t._trial_id for t in study.get_trials(deepcopy=False)}), Counter(taken).most_common(3)


@pytest.mark.parametrize("runs, queued", [
    ("IIIIIIII", 8), ("DDDD", 3), ("IDDDD", 4), ("DDDIIID", 6), ("DIDIDID", 6),
])
def test_an_interrupt_always_queues_its_config_again_and_only_deaths_count_toward_the_retries(runs, queued):
    """I: the trial was interrupted (Ctrl-C); D: its process died (Optuna's retry callback queues it, at most
    _RETRIES times). How many times in a row the config was queued again before it was given up."""
    from optuna.trial import TrialState

    from tilegen.tuning.tuner import _requeue_interrupted, _retry_callback

    study = optuna.create_study()
    _, retry = _retry_callback()  # Optuna's, as the tuner's storage runs it
    study.enqueue_trial({"x": 3})
    count = 0
    for run in runs:
        trial = study.ask({"x": optuna.distributions.IntDistribution(0, 9)})
        assert trial.params == {"x": 3}  # the queued config is what runs next
        study.tell(trial, state=TrialState.FAIL)
        frozen = study._storage.get_trial(trial._trial_id)
        if run == "I":
            _requeue_interrupted(study, frozen)
        else:
            retry(study, frozen)
        if not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            break
        count += 1
    assert count == queued


def test_a_worker_whose_start_is_interrupted_closes_and_passes_the_interrupt_on(monkeypatch):
    """Ctrl-C (or a spawn that fails, EAGAIN) inside the child's start leaves a process that never started: closing
    the worker must not try to join it, or an AssertionError would hide the interrupt."""
    import multiprocessing

    from tilegen.tuning.worker import Worker

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(multiprocessing.get_context("spawn").Process, "start", interrupted)
    worker = Worker()
    with pytest.raises(KeyboardInterrupt):
        worker.start()
    worker.close()


def test_a_second_interrupt_while_the_worker_is_reaped_leaves_it_closable():
    """A second Ctrl-C soon after the first lands while the killed child is reaped; once os.waitpid has reaped it,
    multiprocessing never records its exit and takes it for running, so closing the worker must not close that
    process again, or a ValueError ends the tune in a traceback in place of its one line."""
    import multiprocessing

    from tilegen.tuning.worker import Worker

    worker = Worker()
    worker._conn, _ = multiprocessing.get_context("fork").Pipe()
    worker._proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    worker._proc.start()
    worker._ready = True
    proc = worker._proc
    join = proc.join

    def interrupted_after_the_reap(timeout=None):
        proc.join = join  # once: the interrupt lands in the kill's join
        os.waitpid(proc.pid, 0)
        raise KeyboardInterrupt

    proc.join = interrupted_after_the_reap
    with pytest.raises(KeyboardInterrupt):
        worker._kill()
    worker.close()
