"""Tuning that scales out: a PostgreSQL server as the database, processes sharing studies, ``db pull``.

A real PostgreSQL runs for the session from the ``pgserver`` package (in a temporary
folder); every test gets a database of its own on it. Without ``pgserver`` and
``psycopg``, or where the server cannot start, the server tests are skipped, saying why.
Covered: migrations from empty; two tune processes on one study measure exactly what one
does; kill -9 of a tune process mid-trial (its trial ends failed, the tune finishes);
``db list`` while tunes write; ``db pull`` into SQLite and dispatch from that file;
``--db`` on every ``db`` subcommand; and one-line errors for bad servers, URLs and ``--gpus``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import triton

from helpers import checkout_pythonpath

from tilegen import AttentionSpec
from tilegen.cli.spec_args import resolve_spec
from tilegen.codegen.render import template_hash
from tilegen.db import SCHEMA_REVISION, TuningDB
from tilegen.device import CPU_INTERPRETER, DeviceInfo
from tilegen.families import family_of
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import Config
from tilegen.key import TuningKey
from tilegen.tuning.tuner import WORKER_ATTR

ROOT = Path(__file__).resolve().parents[1]
SPEC = AttentionSpec(head_dim=16)  # 9 feasible configs under the interpreter, each measured in about a second
TUNE = ["tune", "--head-dim", "16", "--seqlens", "16"]
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_110_126_080, 232_448)  # its memory overflows 32 bits
_names = itertools.count()


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(), **extra}
    env.pop("TILEGEN_TUNE_INJECT", None)
    env.update(extra)
    return env


def _tilegen(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tilegen", *args], env=_env(**env), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _start(*args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tilegen", *args], env=_env(**env), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="session")
def pg_server():
    try:
        import pgserver
        import psycopg  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the server tests need pgserver and psycopg (pip install pgserver \"psycopg[binary]\"): {e}")
    # A short path: the server's Unix socket lives in this folder, and socket paths are limited to ~100 bytes.
    folder = tempfile.mkdtemp(prefix="tgpg")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = pgserver.get_server(folder, cleanup_mode="delete")
    except Exception as e:  # pgserver raises whatever initdb or pg_ctl reports
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"pgserver could not start PostgreSQL here: {type(e).__name__}: {e}")
    yield server
    server.cleanup()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh, empty database on the session's server, as a postgresql+psycopg URL."""
    from sqlalchemy.engine import make_url

    name = f"tg_test_{os.getpid()}_{next(_names)}"
    pg_server.psql(f"CREATE DATABASE {name};")
    return make_url(pg_server.get_uri()).set(drivername="postgresql+psycopg", database=name).render_as_string(
        hide_password=False)


def _key(bucket: int = 16) -> TuningKey:
    return TuningKey.current(SPEC, CPU_INTERPRETER, bucket)


def _studies(url: str) -> dict[str, list]:
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = optuna.storages.RDBStorage(url)
        return {s.study_name: optuna.load_study(study_name=s.study_name, storage=storage).get_trials(deepcopy=False)
                for s in optuna.get_all_study_summaries(storage)}


def _grid() -> set[str]:
    return {str(c) for c in family_of(SPEC).candidates(SPEC, CPU_INTERPRETER)}


def _measured(url: str) -> list[str]:
    with TuningDB(url) as db:
        return [str(Config.from_dict(t.config)) for t in db.trials_in_studies(_key().study_name)]


# -- the schema ----------------------------------------------------------------------


def test_migrations_from_empty_create_the_models_schema_beside_optunas(pg_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import create_engine, inspect

    from tilegen.db.models import Base

    with TuningDB(pg_url) as db:
        db.record_best(spec=SPEC, device=H200, template_hash=template_hash(ATTENTION_FWD),
                       triton_version=triton.__version__, bucket=1024, config=Config(64, 64, 4, 2).to_dict(),
                       time_ms=0.5, max_error=1e-3, trials=3)
        assert [row.gpu_key for row in db.list_tuned()] == [H200.key]
    _studies(pg_url)  # Optuna's own tables, in the same database
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())
        assert {"tg_gpus", "tg_variants", "tg_tuned_configs", "tg_trials", "tg_alembic_version"} <= tables
        assert {"studies", "trials", "alembic_version"} <= tables
        assert conn.exec_driver_sql("SELECT version_num FROM tg_alembic_version").all() == [(SCHEMA_REVISION,)]
        # Optuna's tables are not tilegen's to model: compare tilegen's alone.
        tilegens = {"include_name": lambda name, kind, _parent: kind != "table" or name.startswith("tg_")}
        context = MigrationContext.configure(conn, opts={"version_table": "tg_alembic_version", **tilegens})
        assert compare_metadata(context, Base.metadata) == []
    engine.dispose()


def test_processes_opening_an_empty_server_database_at_once_migrate_it_once(pg_url):
    script = f"from tilegen.db import TuningDB; TuningDB({pg_url!r}).close()"
    procs = [subprocess.Popen([sys.executable, "-c", script], env=_env(), cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    with TuningDB(pg_url) as db:
        assert db.list_tuned() == []


# -- processes sharing studies -------------------------------------------------------------


def test_two_tune_processes_on_one_study_measure_what_one_process_does_while_db_list_reads(pg_url):
    # Each trial lasts a second at least, so both processes are started before the grid is done.
    slow = json.dumps(dict.fromkeys(_grid(), "sleep:1"))
    procs = [_start(*TUNE, "--sampler", "grid", "--db", pg_url, TILEGEN_TUNE_INJECT=slow) for _ in range(2)]
    listed = 0
    while listed < 3 and any(proc.poll() is None for proc in procs):
        time.sleep(2)  # into the trials, past the tables' creation
        run = _tilegen("db", "list", "--db", pg_url)
        assert run.returncode == 0, run.stderr
        listed += 1
    assert listed >= 1
    assert "attention_fwd_bf16_d16" in _tilegen("db", "list", "--db", pg_url).stdout
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    measured = _measured(pg_url)
    assert sorted(measured) == sorted(_grid())  # every config once: none lost, none doubled
    studies = _studies(pg_url)
    assert list(studies) == [_key().study_name]  # one study, not one per process
    trials = studies[_key().study_name]
    assert not [t for t in trials if t.state.name == "RUNNING"]
    assert len({t.user_attrs[WORKER_ATTR] for t in trials if t.state.name == "COMPLETE"}) == 2


def test_a_tune_process_killed_mid_trial_leaves_a_failed_trial_and_the_tune_finishes(pg_url):
    import optuna

    slow = "BM32-BN32-w4-s1"
    slow_json = next(c.to_json() for c in family_of(SPEC).candidates(SPEC, CPU_INTERPRETER) if str(c) == slow)
    tune = _start(*TUNE, "--sampler", "grid", "--workers", "2", "--heartbeat", "1", "--db", pg_url,
                  TILEGEN_TUNE_INJECT=json.dumps({slow: "sleep:8"}))
    victim, deadline = None, time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and tune.poll() is None:
        time.sleep(0.3)
        try:
            trials = _studies(pg_url).get(_key().study_name, [])
        except Exception:  # the tables are being created
            continue
        for trial in trials:
            if trial.state.name == "RUNNING" and trial.params.get("config_json") == slow_json:
                victim = trial
    assert victim is not None, "the slow trial never ran"
    os.kill(int(victim.user_attrs[WORKER_ATTR].rpartition(":")[2]), signal.SIGKILL)
    _, err = tune.communicate(timeout=300)
    assert tune.returncode == 0, err
    assert "died (killed by SIGKILL); starting another" in err
    trials = _studies(pg_url)[_key().study_name]
    states = {t.number: t.state for t in trials}
    assert states[victim.number] == optuna.trial.TrialState.FAIL
    assert optuna.trial.TrialState.RUNNING not in states.values()
    assert sorted(_measured(pg_url)) == sorted(_grid())  # the killed one measured again, once


def test_a_server_lost_during_a_tune_ends_it_in_one_line_leaving_no_trial_it_cannot_reap(pg_server, pg_url):
    from sqlalchemy.engine import make_url

    name = make_url(pg_url).database
    slow = "BM32-BN32-w4-s1"
    slow_json = next(c.to_json() for c in family_of(SPEC).candidates(SPEC, CPU_INTERPRETER) if str(c) == slow)
    tune = _start(*TUNE, "--sampler", "grid", "--heartbeat", "1", "--db", pg_url,
                  TILEGEN_TUNE_INJECT=json.dumps({slow: "sleep:6"}))
    running, deadline = False, time.monotonic() + 120
    while not running and time.monotonic() < deadline and tune.poll() is None:
        time.sleep(0.3)
        try:
            trials = _studies(pg_url).get(_key().study_name, [])
        except Exception:  # the tables are being created
            continue
        running = any(t.state.name == "RUNNING" and t.params.get("config_json") == slow_json for t in trials)
    assert running, "the slow trial never ran"
    # The server goes away for this database: its connections end and new ones are refused.
    pg_server.psql(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false;")
    pg_server.psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}';")
    try:
        _, err = tune.communicate(timeout=300)
    finally:
        pg_server.psql(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true;")
    assert tune.returncode == 2, err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("error: "), err
    assert len([line for line in err.splitlines() if "error" in line.lower()]) == 1, err
    # A trial it could not fail carries its process's label, so the next tune reaps it.
    trials = _studies(pg_url)[_key().study_name]
    assert all(WORKER_ATTR in t.user_attrs for t in trials if t.state.name == "RUNNING")


# -- pull, and dispatch from the pulled file -----------------------------------------------------


def test_db_pull_copies_this_machines_rows_into_sqlite_and_dispatch_reads_them(pg_url, tmp_path):
    run = _tilegen(*TUNE, "--seqlens", "16,32", "--trials", "2", "--db", pg_url)
    assert run.returncode == 0, run.stderr
    with TuningDB(pg_url) as db:
        db.record_best(spec=SPEC, device=H200, template_hash=template_hash(ATTENTION_FWD),
                       triton_version=triton.__version__, bucket=1024, config=Config(64, 64, 4, 2).to_dict(),
                       time_ms=0.5, max_error=1e-3, trials=3)
        on_server = {row.bucket: row for row in db.list_tuned() if row.gpu_key == CPU_INTERPRETER.key}
    local = tmp_path / "pulled.sqlite"
    run = _tilegen("db", "pull", "--from", pg_url, "--db", str(local))
    assert run.returncode == 0, run.stderr
    assert "***" in run.stderr and "postgres:@" not in run.stderr  # no password in what it prints
    with TuningDB(local) as db:
        rows = db.list_tuned()
        assert {(r.gpu_key, r.bucket, r.provenance) for r in rows} == {(CPU_INTERPRETER.key, 16, "pulled"),
                                                                       (CPU_INTERPRETER.key, 32, "pulled")}
        assert {r.bucket: r.config for r in rows} == {b: r.config for b, r in on_server.items()}
        assert {t.provenance for t in db.trials_for(SPEC.hash)} == {"pulled"}

    h200 = _tilegen("db", "pull", "--from", pg_url, "--db", str(tmp_path / "h200.sqlite"), "--gpu", H200.key)
    assert h200.returncode == 0, h200.stderr
    with TuningDB(tmp_path / "h200.sqlite") as db:
        assert [(r.gpu_key, r.bucket) for r in db.list_tuned()] == [(H200.key, 1024)]

    script = textwrap.dedent("""
        import json, torch, tilegen
        q, k, v = (torch.randn(1, 2, 32, 16, dtype=torch.bfloat16) for _ in range(3))
        choice = tilegen.explain(q, k, v)
        out = tilegen.attention(q, k, v)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        print(json.dumps({"source": choice.source, "config": str(choice.config),
                          "error": float((out.float() - ref).abs().max())}))
    """)
    # TILEGEN_DB names the server for tune and db; dispatch reads the local file and never the server.
    fresh = subprocess.run([sys.executable, "-c", script], env=_env(TILEGEN_DB=str(local)), cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    seen = json.loads(fresh.stdout.splitlines()[-1])
    assert seen["source"] == str(local)
    assert seen["config"] == str(Config.from_dict(on_server[32].config))
    assert seen["error"] < 2e-2


def test_dispatch_never_reads_a_server_named_by_tilegen_db(monkeypatch, tmp_path):
    from tilegen import env

    monkeypatch.setenv("TILEGEN_DB", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert env.db_target() == "postgresql+psycopg://nobody@127.0.0.1:1/none"
    assert env.db_path().name == "tuning.sqlite" and "://" not in str(env.db_path())


def test_every_db_subcommand_takes_a_server(pg_url, tmp_path):
    from typer.testing import CliRunner

    from tilegen.cli import app

    with TuningDB(pg_url) as db:
        db.record_best(spec=SPEC, device=H200, template_hash=template_hash(ATTENTION_FWD),
                       triton_version=triton.__version__, bucket=1024, config=Config(64, 64, 4, 2).to_dict(),
                       time_ms=0.5, max_error=1e-3, trials=3)
    runner = CliRunner()
    export = tmp_path / "rows.json"
    for args in (["db", "list", "--db", pg_url], ["db", "--db", pg_url, "show", SPEC.hash[:6]],
                 ["db", "export", str(export), "--db", pg_url], ["db", "import", str(export), "--db", pg_url],
                 ["db", "prune", "--yes", "--db", pg_url], ["db", "verify", "--db", pg_url]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
    assert json.loads(export.read_text())["tuned"][0]["gpu_key"] == H200.key


# -- bad input: one line, exit status 2, before anything is measured -------------------------------------


def _one_line_error(run, *needles: str) -> str:
    """``run``: a finished process, or a CliRunner result (these checks run in-process: no start-up cost)."""
    code = getattr(run, "returncode", getattr(run, "exit_code", None))
    text = run.stderr if isinstance(run, subprocess.CompletedProcess) else run.output
    assert code == 2, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert "Traceback" not in text
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _cli(*args: str):
    from typer.testing import CliRunner

    from tilegen.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@pytest.mark.parametrize("command", [TUNE, ["db", "list"], ["db", "show", "abc"], ["db", "prune", "--yes"]])
@pytest.mark.parametrize("url, needles", [
    ("mysql://user@host/tilegen", ("--db:", "unsupported database URL scheme 'mysql'", "postgresql+psycopg://")),
    ("bogus://whatever", ("--db:", "unsupported database URL scheme 'bogus'")),
    ("postgresql+psycopg://tg@127.0.0.1:1/tilegen", ("--db:", "cannot reach the database server", "host and port")),
])
def test_a_bad_server_url_fails_in_one_line(command, url, needles):
    _one_line_error(_cli(*command, "--db", url), *needles)


def test_wrong_credentials_and_a_missing_database_fail_in_one_line(pg_server, pg_url):
    from sqlalchemy.engine import make_url

    stranger = make_url(pg_url).set(username="nobody", password="secret").render_as_string(hide_password=False)
    line = _one_line_error(_tilegen(*TUNE, "--db", stranger), "--db:", "cannot log in", "user name and password")
    assert "secret" not in line
    missing = make_url(pg_url).set(database="no_such_db").render_as_string(hide_password=False)
    _one_line_error(_cli("db", "list", "--db", missing), "--db:", "does not exist", "createdb")
    _one_line_error(_cli("db", "pull", "--from", stranger, "--db", "/tmp/x.sqlite"), "--from:", "cannot log in")


def test_a_server_database_of_a_newer_schema_is_refused(pg_url):
    from sqlalchemy import create_engine

    TuningDB(pg_url).close()
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE tg_alembic_version SET version_num = '9999_future'")
    engine.dispose()
    for command in (TUNE, ["db", "list"]):
        _one_line_error(_cli(*command, "--db", pg_url), "--db:", "newer tilegen schema (revision 9999_future)",
                        "Upgrade tilegen")


@pytest.mark.parametrize("args, needles", [
    (["--gpus", "zero"], ("--gpus:", "expected GPU indices such as 0,1 or all")),
    (["--gpus", "0,0"], ("--gpus:", "GPU 0 is given twice")),
    (["--gpus", "-1"], ("--gpus:", "start at 0")),
    (["--gpus", "7"], ("--gpus:", "no GPU 7")),
    (["--gpus", "all"], ("--gpus:", "no CUDA GPU", "--workers")),
    (["--workers", "0"], ("--workers:", "positive")),
    (["--workers", "2", "--gpus", "0"], ("--workers:", "not both")),
    (["--heartbeat", "0"], ("--heartbeat:", "positive")),
])
def test_bad_gpus_and_workers_fail_in_one_line(args, needles, tmp_path):
    if _has_cuda() and args[:2] in (["--gpus", "all"], ["--gpus", "7"], ["--workers", "2"]):
        pytest.skip("these say what a machine without a GPU answers")
    _one_line_error(_cli(*TUNE, "--db", str(tmp_path / "t.sqlite"), *args), *needles)
    assert not (tmp_path / "t.sqlite").exists()  # refused before the database was even opened


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# -- the benchmark's smoke run ---------------------------------------------------------------------


def test_scaleout_benchmark_smoke_run(pg_server, tmp_path):
    # Two variants in one command: the report names each bucket after its variant.
    presets = ("default", "mha-d128-causal")
    run = subprocess.run([sys.executable, "-m", "tilegen.bench.scaleout", "--smoke", "--preset", ",".join(presets),
                          "--out", str(tmp_path)], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "scaleout.json").read_text())
    assert report["smoke"] is True
    names = [resolve_spec(None, preset).name for preset in presets]
    assert sorted(report["grid_size"]) == sorted(f"{name}/16" for name in names)
    assert sorted(report["parallel"]["winners"]) == sorted(report["single"]["winners"]) == sorted(report["grid_size"])
    # Each bucket's winners: the same config, or both timed again back to back.
    for pair in report["winners"].values():
        same = pair["parallel"]["config"] == pair["single"]["config"]
        assert pair["retimed_ratio"] == 1.0 if same else pair["retimed_ratio"] > 0 and len(pair["retimed_ms"]) == 2
    for name in ("parallel", "single"):
        assert report[name]["trials_lost"] == 0
        assert all(count == report["grid_size"][str(bucket)] for bucket, count in report[name]["finished"].items())
        # Where the time went, from the tuner's debug lines: one measured trial per finished config.
        phases = report[name]["phases"]
        assert phases["trials"] == sum(report[name]["finished"].values())
        assert 1 <= len(phases["first_trial_per_process_s"]) <= (2 if name == "parallel" else 1)
        # The tune's own time, from its first fork to its last result: within the run's wall time.
        assert 0 < phases["after_fork_s"] < report[name]["wall_s"]
    assert report["speedup_after_fork"] == round(report["single"]["phases"]["after_fork_s"]
                                                 / report["parallel"]["phases"]["after_fork_s"], 3)
