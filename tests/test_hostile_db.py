"""A tuning database or export handed over by someone else: every reader checks it, nothing in it
runs, reaches the terminal raw, or ends in a traceback, and a refused input changes nothing."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
import triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from helpers import checkout_pythonpath

import tilegen
from tilegen import AttentionSpec, dispatch
from tilegen.cli import app
from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB
from tilegen.db.validate import RowError, check_gpu
from tilegen.device import CPU_INTERPRETER, DeviceInfo
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import Config
from tilegen.families.attention_fwd.reference import attention_reference

REPO = Path(__file__).resolve().parents[1]
#: What tilegen.attention builds for the tiny fp32 call below, and the key dispatch reads it under.
SPEC = AttentionSpec(head_dim=16, dtype="fp32")
KEY = dict(spec=SPEC, device=CPU_INTERPRETER, template_hash=template_hash(ATTENTION_FWD),
           triton_version=triton.__version__)
GOOD = Config(16, 16, 4, 1)
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_000_000_000, 232_448)
runner = CliRunner()
#: A value that, run as Python anywhere, leaves this file behind.
CANARY_FILE = "tilegen-canary-ran"
CANARY = f'1); open("{CANARY_FILE}", "w"); (1'


def tiny_inputs():
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 16, 16, generator=gen) for _ in range(3))


def tuned_db(path: Path) -> Path:
    """A small tuned database: rows for the tiny call's bucket and two others, and trials behind them."""
    with TuningDB(path) as db:
        for bucket, time_ms in ((16, 1.0), (64, 2.0), (256, 3.0)):
            db.record_best(**KEY, bucket=bucket, config=GOOD.to_dict(), time_ms=time_ms, max_error=1e-6, trials=3,
                           tflops=0.1, gbps=0.2)
        for number in range(3):
            db.record_trial(**KEY, bucket=16, study_name="study", trial_number=number,
                            config=Config(16 << number, 16, 4, 1).to_dict(), status="ok", time_ms=1.0 + number,
                            max_error=1e-6)
    return path


def dump(path: Path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return list(conn.iterdump())


def set_column(path: Path, table: str, column: str, value, where: str = "1") -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE {table} SET {column} = ? WHERE {where}", (value,))


def invoke(*args, env: dict[str, str] | None = None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def one_line_error(result, message: str = "") -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr


def op_reads(db: Path, monkeypatch) -> dispatch.Choice:
    """The tiny call through the op, against ``db`` as the user's database: checked against the reference."""
    monkeypatch.setenv("TILEGEN_DB", str(db))
    dispatch.reset()
    q, k, v = tiny_inputs()
    out = tilegen.attention(q, k, v)
    ref, _ = attention_reference(q, k, v)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-4
    return tilegen.explain(q, k, v)


# -- item 1: every reader validates ----------------------------------------------------------------

HOSTILE_BUCKETS = {
    "text": "16); import os; os.system('x')#",
    "float": 16.5,
    "zero": 0,
    "negative": -16,
    "off-the-rule": 17,
    "past-int64": "9" * 30,  # stays text in an INTEGER column
    "blob": b"\x00\x01",
}


@pytest.mark.parametrize("case", HOSTILE_BUCKETS)
def test_dispatch_skips_a_row_whose_bucket_is_not_its_familys_with_one_warning(tmp_path, monkeypatch, caplog, case):
    db = tuned_db(tmp_path / "t.sqlite")
    set_column(db, "tg_tuned_configs", "bucket", HOSTILE_BUCKETS[case], "bucket = 16")
    before = dump(db)
    choice = op_reads(db, monkeypatch)
    # The bucket-16 row is gone: the call takes the nearest row that passed, 64.
    assert (choice.tuned_bucket, choice.config) == (64, GOOD)
    warnings = [r.getMessage() for r in caplog.records if "ignoring a tuned row" in r.getMessage()]
    assert len(warnings) == 1 and "bucket:" in warnings[0], warnings
    assert dump(db) == before


BAD_VALUES = {
    "warps-2**80": ("config_json", json.dumps({**GOOD.to_dict(), "num_warps": 2**80}), "num_warps"),
    "tiny-time": ("time_ms", 1e-300, "time_ms"),
    "nan-time": ("time_ms", "nan", "time_ms"),
    "infinite-error": ("max_error", math.inf, "max_error"),
    "negative-tflops": ("tflops", -1.0, "tflops"),
    "infinite-tflops": ("tflops", math.inf, "tflops"),
    "negative-trials": ("trials", -3, "trials"),
    "huge-version": ("torch_version", "2" * 1_000_000, "torch_version"),
    "config-not-json": ("config_json", "{", "config"),
    "config-a-list": ("config_json", "[1]", "config"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_a_stored_value_no_writer_would_store_is_refused_by_dispatch_and_named_by_db_list(tmp_path, monkeypatch,
                                                                                          caplog, case):
    column, value, field = BAD_VALUES[case]
    db = tuned_db(tmp_path / "t.sqlite")
    set_column(db, "tg_tuned_configs", column, value, "bucket = 16")
    before = dump(db)
    assert op_reads(db, monkeypatch).tuned_bucket == 64
    assert any(field in r.getMessage() for r in caplog.records if "ignoring a tuned row" in r.getMessage())
    result = invoke("db", "list", "--db", db)
    assert result.exit_code == 0, result.output
    skipped = [line for line in result.stderr.splitlines() if line.startswith("skipped tuned row")]
    assert len(skipped) == 1 and field in skipped[0], result.stderr
    assert len(max(result.stderr.splitlines(), key=len)) < 1000  # a megabyte string is not echoed
    assert dump(db) == before


def test_rows_of_a_family_this_tilegen_does_not_know_are_still_checked(tmp_path):
    """Its bucket rule and knobs are unknown here, but its numbers, names and types are not."""
    db = tuned_db(tmp_path / "t.sqlite")
    set_column(db, "tg_variants", "family", "newer_family")
    set_column(db, "tg_tuned_configs", "time_ms", "", "bucket = 16")
    set_column(db, "tg_trials", "config_json", json.dumps({"block_m": "[bold]"}), "trial_number = 0")
    before = dump(db)
    result = invoke("db", "list", "--db", db)
    assert result.exit_code == 0, result.output
    assert [line for line in result.stderr.splitlines() if line.startswith("skipped")] == [
        f"skipped tuned row 1 of {db}: time_ms: expected a positive, finite number of milliseconds, at least 1e-06 "
        f"(1 ns), got ''"]
    assert result.stdout.count("unknown family") == 2
    result = invoke("db", "show", "--db", db, SPEC.hash)
    assert result.exit_code == 0, result.output
    assert "skipped trial row 1" in result.stderr and "config: block_m: expected an integer" in result.stderr
    assert dump(db) == before


def test_a_gpu_entry_claiming_another_capability_for_its_key_is_refused():
    entry = dict(key=H200.key, name=H200.name, capability="8.0", sm_count=132, memory_bytes=1)
    with pytest.raises(RowError, match="key: 'NVIDIA_H200-sm90' is not the key of a NVIDIA H200 of capability 8.0"):
        check_gpu(entry)


def test_import_refuses_a_gpu_that_the_database_holds_with_another_capability(tmp_path):
    db = tmp_path / "t.sqlite"
    with TuningDB(db) as database:
        database.record_best(**{**KEY, "device": H200}, bucket=64, config=GOOD.to_dict(), time_ms=1.0, max_error=0.0,
                             trials=1)
        data = database.export_json()
    data["gpus"][0]["sm_count"] = 7
    file = tmp_path / "export.json"
    file.write_text(json.dumps(data))
    before = dump(db)
    one_line_error(invoke("db", "import", file, "--db", db), "NVIDIA_H200-sm90 has sm_count 132 here")
    assert dump(db) == before


def _export(tmp_path: Path) -> dict:
    with TuningDB(tuned_db(tmp_path / "source.sqlite")) as db:
        return db.export_json()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


IMPORTS = {
    "int-past-int64": (lambda d: d["tuned"][0].update(trials=2**70), "tuned[0].trials: expected an integer of 32 bits"),
    "memory-past-int64": (lambda d: d["gpus"][0].update(memory_bytes=2**64), "memory_bytes: expected an integer of 64"),
    "date-past-range": (lambda d: d["tuned"][0].update(created_at="9999-12-31T23:59:59-05:00"),
                        "tuned[0].created_at: expected an ISO date"),
    "date-year-10000": (lambda d: d["trials"][0].update(created_at="10000-01-01"), "trials[0].created_at"),
    "nested-spec": (lambda d: d["variants"][0].update(spec_json=_nested(100_000)), "variants[0].spec_json"),
    "huge-version": (lambda d: d["tuned"][0].update(triton_version="3" * 1_000_000), "triton_version: expected 1 to 64"),
    "ansi-name": (lambda d: d["variants"][0].update(name="\x1b[2J\x1b]8;;http://x\x07evil"), "variants[0].name"),
    "markup-key": (lambda d: [d["gpus"][0].update(key="[link=http://x]k[/link]")], "gpus[0].key"),
    "other-spec-name": (lambda d: d["variants"][0].update(name="attention_fwd_other"), "is not its spec's name"),
    "negative-trial-number": (lambda d: d["trials"][0].update(trial_number=-1), "trial_number"),
    "tiny-time": (lambda d: d["tuned"][0].update(time_ms=1e-300), "time_ms"),
    "inf-error": (lambda d: d["tuned"][0].update(max_error=math.inf), "max_error"),
    "inf-tflops": (lambda d: d["tuned"][0].update(tflops=-1), "tflops"),
    # 250 characters pass as exported, but the trial is filed with the import's suffix, which readers then refuse.
    "study-name-past-the-column-once-imported": (lambda d: d["trials"][0].update(study_name="s" * 250),
                                                 "study_name: expected 1 to 255 characters, got 259"),
}


@pytest.mark.parametrize("case", IMPORTS)
def test_import_of_an_oversized_or_hostile_value_ends_in_one_line_and_changes_nothing(tmp_path, case):
    mutate, message = IMPORTS[case]
    data = _export(tmp_path)
    mutate(data)
    file = tmp_path / "export.json"
    file.write_text(json.dumps(data) if case != "inf-error" else json.dumps(data, allow_nan=True))
    db = tuned_db(tmp_path / "target.sqlite")
    before = dump(db)
    result = invoke("db", "import", file, "--db", db)
    one_line_error(result, message)
    assert "\x1b" not in result.stderr and "[link" not in result.stderr.replace("'[link", "")
    assert dump(db) == before


def test_a_refused_import_creates_no_database(tmp_path):
    data = _export(tmp_path)
    IMPORTS["tiny-time"][0](data)
    file = tmp_path / "export.json"
    file.write_text(json.dumps(data))
    db = tmp_path / "new" / "target.sqlite"
    one_line_error(invoke("db", "import", file, "--db", db), "time_ms")
    assert not db.parent.exists()


@pytest.mark.parametrize("text", [_nested(100_000), "[" + "9" * 10_000 + "]"], ids=["nested", "huge-int"])
def test_import_of_a_file_json_cannot_read_ends_in_one_line(tmp_path, text):
    file = tmp_path / "export.json"
    file.write_text(text)
    db = tuned_db(tmp_path / "target.sqlite")
    before = dump(db)
    one_line_error(invoke("db", "import", file, "--db", db), "FILE.json")
    assert dump(db) == before


def test_import_skip_bad_leaves_out_a_row_with_an_unknown_knob_and_imports_the_rest(tmp_path):
    data = _export(tmp_path)
    data["tuned"][0]["config"]["block_k"] = 16
    file = tmp_path / "export.json"
    file.write_text(json.dumps(data))
    db = tmp_path / "target.sqlite"
    result = invoke("db", "import", file, "--db", db, "--skip-bad")
    assert result.exit_code == 0, result.output
    assert "block_k: unknown knob" in result.stderr
    with TuningDB(db) as database:
        assert len(database.list_tuned()) == len(data["tuned"]) - 1


# -- item 3: printing is safe ----------------------------------------------------------------------

def test_db_list_and_show_print_no_escape_sequence_or_markup_from_the_database(tmp_path):
    db = tuned_db(tmp_path / "t.sqlite")
    hostile = "\x1b]8;;http://evil\x1b\\[bold red]x[/]\x1b[2J"
    set_column(db, "tg_variants", "name", hostile)
    set_column(db, "tg_trials", "reason", hostile)
    set_column(db, "tg_trials", "status", "infeasible")
    before = dump(db)
    for args in (("db", "list", "--db", db), ("db", "show", "--db", db, SPEC.hash)):
        result = invoke(*args)
        assert "\x1b" not in result.output, args
        assert result.exit_code in (0, 2), result.output
        # The variant's name is not a name tilegen writes: its rows are refused, each named in one line.
        assert "skipped" in result.stderr and "name: expected letters, digits" in result.stderr, result.stderr
    assert dump(db) == before


def test_a_trial_reason_is_printed_as_text_not_markup(tmp_path):
    db = tuned_db(tmp_path / "t.sqlite")
    set_column(db, "tg_trials", "reason", "[bold]\x1b[31mred[/bold]")
    result = invoke("db", "show", "--db", db, SPEC.hash)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and "[bold]" in result.stdout and "\\x1b[31mred" in result.stdout


# -- item 8: tables that fit -------------------------------------------------------------------------

def test_db_list_and_show_fit_80_columns_with_the_spec_hash_whole(tmp_path):
    db = tuned_db(tmp_path / "t.sqlite")
    for args in (("db", "list", "--db", db), ("db", "show", "--db", db, SPEC.hash[:6])):
        result = invoke(*args, env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        assert max(map(len, result.stdout.splitlines())) <= 80, result.stdout
        assert SPEC.hash in result.stdout
    wide = invoke("db", "list", "--db", db, "--wide", env={"COLUMNS": "80"})
    assert "TFLOP/s" in wide.stdout and "TFLOP/s" not in invoke("db", "list", "--db", db, env={"COLUMNS": "80"}).stdout


# -- item 2: generated source holds only values tilegen produced -------------------------------------

EMIT_HOSTILE = [("bucket", CANARY), ("bucket", 16.5), ("bucket", 2**62), ("bucket", "1e400"),
                ("config_json", json.dumps({**GOOD.to_dict(), "block_m": CANARY})),
                ("config_json", json.dumps({**GOOD.to_dict(), "block_m": 2**70})),
                ("triton_version", CANARY), ("torch_version", "\n" + CANARY)]


def test_emit_tuned_writes_no_value_it_did_not_produce(tmp_path):
    """Every hostile row at once, one per bucket; the module names only the row that passed, and imports
    without running anything."""
    db = tmp_path / "t.sqlite"
    with TuningDB(db) as database:
        for i in range(len(EMIT_HOSTILE) + 1):
            database.record_best(**KEY, bucket=16 << i, config=GOOD.to_dict(), time_ms=1.0, max_error=0.0, trials=1)
    with sqlite3.connect(db) as conn:
        for i, (column, value) in enumerate(EMIT_HOSTILE):
            conn.execute(f"UPDATE tg_tuned_configs SET {column} = ? WHERE bucket = ?", (value, 16 << i))
    module = tmp_path / "emitted.py"
    result = invoke("emit", "--tuned", "--db", db, "--spec", SPEC.to_json(), "-o", module)
    assert result.exit_code == 0, result.output
    text = module.read_text()
    assert CANARY_FILE not in text and "1e400" not in text and str(2**62) not in text and str(2**70) not in text
    table = re.search(r"^TUNED = \{(.*?)^\}", text, re.MULTILINE | re.DOTALL).group(1)
    assert re.findall(r"^    (\d+):", table, re.MULTILINE) == [str(16 << len(EMIT_HOSTILE))]
    done = subprocess.run([sys.executable, "-c", "import emitted"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / CANARY_FILE).exists()


def test_emit_tuned_comments_carry_no_line_break_from_a_database_path(tmp_path):
    folder = tmp_path / f"x\n{CANARY}\n"
    folder.mkdir()
    db = folder / "t.sqlite"
    with TuningDB(db) as database:
        database.record_best(**KEY, bucket=64, config=GOOD.to_dict(), time_ms=1.0, max_error=0.0, trials=1)
    module = tmp_path / "emitted.py"
    assert invoke("emit", "--tuned", "--db", db, "--spec", SPEC.to_json(), "-o", module).exit_code == 0
    assert all(not line.startswith(CANARY[:5]) for line in module.read_text().splitlines())
    spec = importlib.util.spec_from_file_location("emitted_path", module)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    assert loaded.TUNED == {64: GOOD.to_dict()}
    assert not Path(CANARY_FILE).exists()


# -- item 4: a corrupt file, a full disk ---------------------------------------------------------------

def _corrupt(path: Path, wal: bool = False) -> None:
    shutil.copy(REPO / "tuning_db" / "tuned.sqlite", path)
    with open(path, "r+b") as f:
        if wal:  # the header's write and read versions: 2 says the file is in WAL mode
            f.seek(18)
            f.write(b"\x02\x02")
        f.seek(4096 * 3)
        f.write(bytes(range(256)) * 80)


@pytest.mark.parametrize("wal", [False, True], ids=["rollback-journal", "wal-mode"])
@pytest.mark.parametrize("command", [("tune", "--head-dim", "16", "--sizes", "16", "--trials", "1"),
                                     ("db", "prune", "--yes"), ("db", "import", "{export}"), ("db", "list")])
def test_a_corrupt_file_is_refused_before_anything_is_written_to_it_or_beside_it(tmp_path, command, wal):
    db = tmp_path / "corrupt.sqlite"
    _corrupt(db, wal)
    export = tmp_path / "export.json"
    export.write_text(json.dumps(_export(tmp_path)))
    before, listing = db.read_bytes(), sorted(p.name for p in tmp_path.iterdir())
    result = invoke(*[a.format(export=export) for a in command], "--db", db)
    one_line_error(result, f"not a tilegen database / corrupt: {db}")
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no studies file, no -wal, no lock


_FULL = """
import os, sqlite3, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine

def full(conn, cursor, statement, params, context, executemany):
    # The disk fills for the one write named, once: the tune's cleanup after it can write again.
    if statement.lstrip().upper().startswith(("INSERT", "UPDATE")) and os.environ["FULL_TABLE"] in statement.split():
        left = int(os.environ["FULL_AFTER"])
        os.environ["FULL_AFTER"] = str(left - 1)
        if left == 0:
            raise OSError(28, "No space left on device") if os.environ["FULL_AS"] == "os" else \\
                sqlite3.OperationalError("database or disk is full")

if __name__ == "__main__":
    event.listen(Engine, "before_cursor_execute", full)
    import runpy
    sys.argv = ["tilegen", "tune", "--db", sys.argv[1], "--head-dim", "16", "--sizes", "16", "--trials", "3",
                "--sampler", "grid"]
    runpy.run_module("tilegen", run_name="__main__")
"""


@pytest.mark.parametrize("table, after, kind", [
    ("tg_trials", 1, "sqlite"),  # tilegen's record of a trial
    ("trials", 2, "sqlite"),  # Optuna finishing a trial
    ("trials", 2, "os"),
    ("trial_user_attributes", 1, "sqlite"),  # Optuna labelling the trial being created
    ("trial_values", 0, "sqlite"),
])
def test_a_full_disk_during_a_tune_ends_in_one_line_and_leaves_no_trial_running(tmp_path, table, after, kind):
    script = tmp_path / "full.py"
    script.write_text(_FULL)
    db = tmp_path / "t.sqlite"
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(), "FULL_TABLE": table, "FULL_AFTER": str(after),
           "FULL_AS": kind}
    done = subprocess.run([sys.executable, str(script), str(db)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("error: ") and ("disk is full" in last or "no space left" in last), done.stderr
    assert "Traceback" not in done.stderr
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 't.optuna.sqlite'}")
    states = [t.state for study in storage.get_all_studies() for t in storage.get_all_trials(study._study_id)]
    assert states and optuna.trial.TrialState.RUNNING not in states


# -- the fuzz test: random values in every column of a real tuned database ------------------------------

_COLUMNS = {
    "tg_gpus": ["key", "name", "capability", "sm_count", "memory_bytes"],
    "tg_variants": ["spec_hash", "template_hash", "family", "name", "spec_json"],
    "tg_tuned_configs": ["bucket", "triton_version", "torch_version", "tilegen_version", "config_json", "time_ms",
                         "tflops", "gbps", "max_error", "trials", "created_at", "provenance"],
    "tg_trials": ["bucket", "triton_version", "study_name", "trial_number", "config_json", "status", "time_ms",
                  "max_error", "reason", "created_at", "provenance"],
}
_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=16),
    st.sampled_from([CANARY, "[bold]x[/]", "\x1b[2J", "16", "1e400", "{}", json.dumps(GOOD.to_dict()),
                     json.dumps({**GOOD.to_dict(), "num_warps": 2**80}), "2026-01-01 00:00:00", "nan"]),
)


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory) -> Path:
    return tuned_db(tmp_path_factory.mktemp("fuzz") / "base.sqlite")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from([(t, c) for t, cs in _COLUMNS.items() for c in cs]), _VALUES,
                                st.sampled_from([None, 1, 2, 3])), min_size=1, max_size=4))
def test_random_values_in_any_column_never_crash_a_reader_nor_run(fuzz_base, tmp_path_factory, monkeypatch, edits):
    folder = tmp_path_factory.mktemp("case")
    db = folder / "t.sqlite"
    shutil.copy(fuzz_base, db)
    with sqlite3.connect(db) as conn:
        for (table, column), value, row in edits:  # one row by id, or every row
            with contextlib.suppress(sqlite3.IntegrityError):  # a value the schema itself refuses (NULL, a twin)
                conn.execute(f"UPDATE {table} SET {column} = ? WHERE ? IS NULL OR id = ?", (value, row, row))
    monkeypatch.chdir(folder)
    choice = op_reads(db, monkeypatch)  # never raises: a row that fails is skipped
    assert choice.config == GOOD or choice.source == "default"
    module = folder / "emitted.py"
    result = invoke("emit", "--tuned", "--db", db, "--spec", SPEC.to_json(), "-o", module)
    assert result.exit_code in (0, 2) and isinstance(result.exception, (SystemExit, type(None))), result.output
    if result.exit_code == 0:
        spec = importlib.util.spec_from_file_location("fuzzed", module)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    else:
        one_line_error(result)
    for command in (("db", "list"), ("db", "show", SPEC.hash)):  # show: the trials too
        result = invoke(*command, "--db", db)
        assert result.exit_code in (0, 2) and isinstance(result.exception, (SystemExit, type(None))), result.output
        if result.exit_code == 2:
            assert result.stderr.splitlines()[-1].startswith("error: "), result.stderr
            assert "Traceback" not in result.output
        assert "\x1b" not in result.output
    assert not (folder / CANARY_FILE).exists()


# -- files that are not tilegen's ------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [("db", "list"), ("db", "prune", "--yes"),
                                     ("tune", "--head-dim", "16", "--sizes", "16", "--trials", "1")])
def test_another_programs_sqlite_file_is_refused_and_left_as_it_was(tmp_path, command):
    """tilegen adds its tables only to a new or empty file: another program's database, or a tune's own studies
    file passed as --db, is refused in one line, its bytes (and journal mode) unchanged, nothing made beside it."""
    db = tmp_path / "app.sqlite"
    with contextlib.closing(sqlite3.connect(db)) as connection:
        connection.execute("CREATE TABLE customers (id INTEGER, name TEXT)")
        connection.commit()
    before, listing = db.read_bytes(), sorted(p.name for p in tmp_path.iterdir())
    result = invoke(*command, "--db", db)
    one_line_error(result, f"not a tilegen database: {db} holds other tables (customers)")
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing


def test_a_pipe_or_a_forged_view_as_the_database_falls_back_instead_of_blocking(tmp_path, monkeypatch, caplog):
    """Opening a named pipe blocks until a writer comes, and a view under a tilegen table's name runs whatever
    query it holds (one without end): dispatch refuses both before reading, warns and takes the default."""
    pipe = tmp_path / "pipe.sqlite"
    os.mkfifo(pipe)
    forged = tmp_path / "forged.sqlite"
    shutil.copy(REPO / "tuning_db" / "tuned.sqlite", forged)
    with contextlib.closing(sqlite3.connect(forged)) as connection:
        connection.execute("DROP TABLE tg_variants")
        connection.execute("CREATE VIEW tg_variants AS WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 "
                           "FROM n) SELECT x AS id, '' AS spec_hash, '' AS template_hash FROM n")
        connection.commit()
    for path, reason in ((pipe, "is not a regular file"), (forged, "tg_variants is not a table")):
        monkeypatch.setenv("TILEGEN_DB", str(path))
        dispatch.reset()
        with caplog.at_level(logging.WARNING, logger="tilegen.db"):
            choice = tilegen.explain(*(torch.randn(1, 1, 16, 16) for _ in range(3)))
        assert choice.source == "default"
        assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        caplog.clear()
    result = invoke("db", "list", "--db", pipe)
    one_line_error(result, "is not a regular file")
    result = invoke("db", "list", "--db", forged)
    one_line_error(result, "tg_variants is not a table")


def test_two_databases_of_one_stem_do_not_share_their_studies(tmp_path):
    """s.sqlite and s.db keep their studies in one file, s.optuna.sqlite: a tune of the second is refused in one
    line (its trials would count as the first's, whose next tune would skip configs it never measured), and the
    first's tunes go on."""
    tune = ("tune", "--head-dim", "16", "--sizes", "16", "--trials", "1")
    assert invoke(*tune, "--db", tmp_path / "s.sqlite").exit_code == 0
    result = invoke(*tune, "--db", tmp_path / "s.db")
    assert result.exit_code == 2, result.output
    last = result.stderr.strip().splitlines()[-1]  # after the tune's note that it runs under the interpreter
    assert last.startswith("error: ") and "holds the tunes of the database s.sqlite, not s.db" in last, last
    assert invoke(*tune[:-1], "2", "--db", tmp_path / "s.sqlite").exit_code == 0
    # Renamed together with its studies file, the database keeps its studies.
    for path in tmp_path.glob("s.*sqlite*"):  # with their -wal and -shm files
        path.rename(tmp_path / ("t" + path.name[1:]))
    result = invoke(*tune[:-1], "3", "--db", tmp_path / "t.sqlite")
    assert result.exit_code == 0, result.stderr


def test_a_studies_file_of_another_optuna_schema_ends_a_tune_in_one_line(tmp_path):
    """The Optuna studies beside the database set up by an Optuna release whose schema this one refuses (a newer
    one, on a disk machines share): the tune ends in one line naming the studies file, not in Optuna's traceback."""
    db, studies = tmp_path / "s.sqlite", tmp_path / "s.optuna.sqlite"
    TuningDB(db).close()
    optuna.create_study(storage=f"sqlite:///{studies}", study_name="elsewhere")
    with contextlib.closing(sqlite3.connect(studies)) as conn, conn:
        conn.execute("UPDATE alembic_version SET version_num = 'v99.0.0.a'")
    result = invoke("tune", "--head-dim", "16", "--sizes", "16", "--trials", "1", "--db", db)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    last = result.stderr.strip().splitlines()[-1]  # after the tune's note that it runs under the interpreter
    assert last.startswith(f"error: Optuna studies file {studies}: "), last
