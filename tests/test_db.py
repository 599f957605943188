"""The tuning database: schema and migrations, merging rules, lookup precedence, bad files, concurrency."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import sqlite3
from pathlib import Path

import pytest
import triton
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

from tilegen import AttentionSpec, env
from tilegen.codegen.render import template_hash
from tilegen.db import SCHEMA_REVISION, DatabaseError, TuningDB, studies_url, tuned_rows
from tilegen.db.migrate import known_revisions
from tilegen.db.models import Base
from tilegen.db.store import imported_study
from tilegen.db.validate import RowError
from tilegen.device import CPU_INTERPRETER, DeviceInfo
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import Config

SPEC = AttentionSpec(head_dim=64, mask="causal", dtype="fp16")
OTHER_SPEC = AttentionSpec(head_dim=128, dtype="bf16")
H100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 85_000_000_000, 232_448)
KEY = dict(spec=SPEC, device=CPU_INTERPRETER, template_hash=template_hash(ATTENTION_FWD), triton_version=triton.__version__)
TABLES = {"tg_gpus", "tg_variants", "tg_tuned_configs", "tg_trials", "tg_alembic_version"}


def config(block_m: int = 32, block_n: int = 32) -> dict[str, int]:
    return Config(block_m, block_n, 4, 1).to_dict()


def record(db: TuningDB, bucket: int, time_ms: float, *, trials: int = 10, **key) -> bool:
    key = {**KEY, **key}
    return db.record_best(
        **key, bucket=bucket, config=config(), time_ms=time_ms, max_error=1e-3, trials=trials,
    )


def trial(db: TuningDB, number: int, *, status: str = "ok", study: str = "study", **key) -> None:
    key = {**KEY, **key}
    db.record_trial(
        **key, bucket=64, study_name=study, trial_number=number, config=config(16 << (number % 3)),
        status=status, time_ms=1.0 + number if status == "ok" else None, reason=None if status == "ok" else "boom",
    )


@pytest.fixture
def db(tmp_path):
    with TuningDB(tmp_path / "tuning.sqlite") as database:
        yield database


def test_opening_an_empty_file_creates_the_schema_at_head(tmp_path):
    path = tmp_path / "empty.sqlite"
    path.touch()
    TuningDB(path).close()
    with sqlite3.connect(path) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert tables == TABLES  # prefixed, so Optuna's tables can share the file
        assert conn.execute("SELECT version_num FROM tg_alembic_version").fetchall() == [(SCHEMA_REVISION,)]
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_opening_creates_missing_folders(tmp_path):
    path = tmp_path / "a" / "b" / "tuning.sqlite"
    TuningDB(path).close()
    assert path.is_file()


def test_schema_revision_is_the_newest_migration():
    assert known_revisions()[-1] == SCHEMA_REVISION


def test_migrations_create_exactly_the_models_schema(db):
    engine = create_engine(f"sqlite:///{db.path}")
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": "tg_alembic_version"})
        assert compare_metadata(context, Base.metadata) == []
    engine.dispose()


def test_record_best_keeps_the_faster_row_and_the_larger_trial_count(db):
    assert record(db, 64, 2.0, trials=10) is True
    assert record(db, 64, 3.0, trials=25) is False  # slower: not stored, but the trial count grows
    assert db.best(**KEY)[64].time_ms == 2.0
    assert db.best(**KEY)[64].trials == 25
    assert record(db, 64, 1.5, trials=5) is True
    row = db.best(**KEY)[64]
    assert (row.time_ms, row.trials) == (1.5, 25)


def test_best_is_keyed_by_gpu_triton_and_template(db):
    record(db, 64, 1.0)
    record(db, 128, 1.0, device=H100)
    record(db, 256, 1.0, triton_version="3.5.0")
    record(db, 512, 1.0, template_hash="0" * 16)
    record(db, 1024, 1.0, spec=OTHER_SPEC)
    assert list(db.best(**KEY)) == [64]
    assert list(db.best(**{**KEY, "device": H100})) == [128]
    assert len(db.list_tuned()) == 5


def test_record_trial_is_idempotent_on_study_and_number(db):
    trial(db, 0, status="compile_error")
    trial(db, 1)
    trial(db, 0)  # the same trial again: replaces, never duplicates
    trials = db.trials_for(SPEC.hash)
    assert [(t.trial_number, t.status, t.time_ms) for t in trials] == [(0, "ok", 1.0), (1, "ok", 2.0)]


def test_record_trial_rejects_an_unknown_status(db):
    with pytest.raises(ValueError, match="status: expected one of ok, wrong, compile_error"):
        trial(db, 0, status="crashed")


def test_tuned_rows_prefer_the_user_database_per_bucket(tmp_path, monkeypatch):
    shipped, user = tmp_path / "shipped.sqlite", tmp_path / "user.sqlite"
    with TuningDB(shipped) as db:
        record(db, 64, 1.0)
        record(db, 128, 1.0)
    with TuningDB(user) as db:
        record(db, 128, 9.0)  # slower than the shipped row, and still the one used: the user's file wins
        record(db, 256, 1.0)
    monkeypatch.setattr(env, "shipped_db_path", lambda: shipped)
    monkeypatch.setenv("TILEGEN_DB", str(user))
    rows = tuned_rows(SPEC, CPU_INTERPRETER, KEY["template_hash"], KEY["triton_version"])
    assert {bucket: source for bucket, (_, source) in rows.items()} == {64: str(shipped), 128: str(user), 256: str(user)}
    assert all(isinstance(cfg, Config) for cfg, _ in rows.values())


def test_tuned_rows_never_create_a_missing_user_database(tmp_path, monkeypatch):
    monkeypatch.setattr(env, "shipped_db_path", lambda: tmp_path / "no-shipped.sqlite")
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path / "missing" / "tuning.sqlite"))
    assert tuned_rows(SPEC, CPU_INTERPRETER, KEY["template_hash"], KEY["triton_version"]) == {}
    assert not (tmp_path / "missing").exists()


def test_tuned_rows_serve_the_shipped_ones_under_a_tilegen_db_in_no_users_home(tmp_path, monkeypatch, caplog):
    """A TILEGEN_DB of "~name/..." for a user unknown here names no file, as a missing one: the shipped rows serve,
    with one warning naming the variable, not an error from every op."""
    shipped = tmp_path / "shipped.sqlite"
    with TuningDB(shipped) as db:
        record(db, 64, 1.0)
    monkeypatch.setattr(env, "shipped_db_path", lambda: shipped)
    monkeypatch.setenv("TILEGEN_DB", "~tilegen-no-such-user/tuning.sqlite")
    with caplog.at_level(logging.WARNING, logger="tilegen.db"):
        rows = tuned_rows(SPEC, CPU_INTERPRETER, KEY["template_hash"], KEY["triton_version"])
    assert {bucket: source for bucket, (_, source) in rows.items()} == {64: str(shipped)}
    assert "TILEGEN_DB: ~tilegen-no-such-user/tuning.sqlite" in caplog.text


def test_a_sqlite_file_uri_is_refused_by_the_api_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatabaseError, match="not a file: URI"):
        TuningDB(f"file:{tmp_path / 'x.sqlite'}")
    assert list(tmp_path.iterdir()) == []


def test_tuned_rows_read_a_writers_wal_in_a_folder_the_reader_cannot_write(tmp_path, monkeypatch):
    # A team's database that another user's tune is writing: its rows sit in the -wal until a checkpoint, and a
    # reader that cannot create files there must still see them (read as immutable, it saw none).
    import tilegen.db.sqlite as sqlite_core

    user = tmp_path / "team.sqlite"
    monkeypatch.setattr(env, "shipped_db_path", lambda: tmp_path / "no-shipped.sqlite")
    monkeypatch.setenv("TILEGEN_DB", str(user))
    real_access = os.access
    monkeypatch.setattr(sqlite_core.os, "access",
                        lambda path, mode: False if mode == os.W_OK else real_access(path, mode))
    with TuningDB(user) as writer:
        record(writer, 64, 1.0)
        assert Path(f"{user}-wal").stat().st_size > 0  # the row is in the -wal, not yet in the file
        rows = tuned_rows(SPEC, CPU_INTERPRETER, KEY["template_hash"], KEY["triton_version"])
        assert {bucket: source for bucket, (_, source) in rows.items()} == {64: str(user)}
    # Closed: the rows are checkpointed into the file and the -wal is gone; a reader there reads the file alone.
    assert tuned_rows(SPEC, CPU_INTERPRETER, KEY["template_hash"], KEY["triton_version"]).keys() == {64}


def test_tuned_rows_warn_once_on_a_broken_user_database_and_use_the_shipped_one(tmp_path, monkeypatch, caplog):
    shipped, user = tmp_path / "shipped.sqlite", tmp_path / "user.sqlite"
    with TuningDB(shipped) as db:
        record(db, 64, 1.0)
    user.write_bytes(os.urandom(4096))
    monkeypatch.setattr(env, "shipped_db_path", lambda: shipped)
    monkeypatch.setenv("TILEGEN_DB", str(user))
    with caplog.at_level(logging.WARNING, logger="tilegen.db"):
        for _ in range(2):
            rows = tuned_rows(SPEC, CPU_INTERPRETER, KEY["template_hash"], KEY["triton_version"])
            assert {b: s for b, (_, s) in rows.items()} == {64: str(shipped)}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"not a tilegen database / corrupt: {user}" in warnings[0]


def test_export_import_round_trip_into_a_fresh_database(db, tmp_path):
    record(db, 64, 1.0)
    record(db, 128, 2.0, device=H100, spec=OTHER_SPEC)
    trial(db, 0)
    trial(db, 1, status="wrong")
    exported = json.loads(json.dumps(db.export_json()))  # through text, as the CLI does
    with TuningDB(tmp_path / "fresh.sqlite") as fresh:
        assert fresh.import_json(exported) == 4
        again = fresh.export_json()
        assert {row["provenance"] for name in ("tuned", "trials") for row in again[name]} == {"imported"}
        assert _without_provenance(again) == _without_provenance(_filed_as_imported(exported))
        assert fresh.import_json(exported) == 0  # nothing new the second time
        assert fresh.import_json(again) == 0  # nor from the copy, whose studies are filed as imported already


def _filed_as_imported(data: dict) -> dict:
    """An export as an import files it: its trials under their studies' imported names."""
    return {**data, "trials": [{**row, "study_name": imported_study(row["study_name"])} for row in data["trials"]]}


def _without_provenance(data: dict) -> dict:
    return {**data, **{name: [{k: v for k, v in row.items() if k != "provenance"} for row in data[name]]
                       for name in ("tuned", "trials")}}


def test_import_merges_keeping_the_faster_row(db, tmp_path):
    record(db, 64, 1.0)
    record(db, 128, 5.0)
    with TuningDB(tmp_path / "other.sqlite") as other:
        record(other, 64, 2.0)
        record(other, 128, 4.0)
        assert other.import_json(db.export_json()) == 1  # only bucket 64 improves
        assert {b: r.time_ms for b, r in other.best(**KEY).items()} == {64: 1.0, 128: 4.0}


def test_import_with_replace_takes_the_files_rows_and_its_studies_trials(db, tmp_path):
    """A re-tune measured another way: its slower row wins, and its studies replace the stored
    ones; a study it does not hold keeps its trials."""
    record(db, 64, 1.0, trials=10)
    for number in range(3):
        trial(db, number)
    trial(db, 0, study="other study")
    with TuningDB(tmp_path / "retune.sqlite") as retune:
        record(retune, 64, 2.0, trials=8)
        trial(retune, 7)
        exported = retune.export_json()
    db.import_json(exported)
    assert {b: (r.time_ms, r.trials) for b, r in db.best(**KEY).items()} == {64: (1.0, 10)}
    assert sorted(t.trial_number for t in db.trials_in_studies("study")) == [0, 1, 2, 7]
    db.import_json(exported, replace=True)
    # The row counts the re-tune's trials, not the larger count of the measurements it replaced.
    assert {b: (r.time_ms, r.trials) for b, r in db.best(**KEY).items()} == {64: (2.0, 8)}
    assert [t.trial_number for t in db.trials_in_studies("study")] == [7]
    assert [t.trial_number for t in db.trials_in_studies("other study")] == [0]


def test_import_with_replace_keeps_the_fastest_of_the_files_own_rows_for_a_key(db, tmp_path):
    """A file holding one key twice (exports of two re-tunes joined): the file wins over the stored row, and among its
    own rows the faster, whichever comes last."""
    record(db, 64, 1.0)
    with TuningDB(tmp_path / "retune.sqlite") as retune:
        record(retune, 64, 2.0)
        exported = retune.export_json()
    [row] = exported["tuned"]
    for times in ((2.0, 3.0), (3.0, 2.0)):
        joined = {**exported, "tuned": [{**row, "time_ms": t} for t in times]}
        db.import_json(joined, replace=True)
        assert {b: r.time_ms for b, r in db.best(**KEY).items()} == {64: 2.0}


def test_import_numbers_a_rerun_studys_trials_after_the_imported_ones(db, tmp_path):
    """A study run again into a fresh file numbers its trials from 0 too: the import files its new measurements
    under the imported study, after the trials an earlier import filed there, leaves out what this database
    measured itself, and a second import of the same file adds nothing."""
    for number in range(3):
        trial(db, number)
    exports = []
    for retune in range(2):
        with TuningDB(tmp_path / f"rerun{retune}.sqlite") as rerun:
            trial(rerun, 0)  # the stored trial 0 itself ...
            rerun.record_trial(**KEY, bucket=64, study_name="study", trial_number=1, config=config(128 << retune),
                               status="ok", time_ms=0.5, reason=None)  # ... and a new measurement
            exports.append(rerun.export_json())
    assert [db.import_json(exported) for exported in exports] == [1, 1]
    trials = {(t.study_name, t.trial_number): (t.config["block_m"], t.time_ms) for t in db.trials_in_studies("study")}
    assert trials == {("study", 0): (16, 1.0), ("study", 1): (32, 2.0), ("study", 2): (64, 3.0),
                      ("study-imported", 1): (128, 0.5), ("study-imported", 2): (256, 0.5)}
    assert db.import_json(exports[0]) == 0


def test_a_databases_trials_come_back_through_another_adding_nothing_and_replace_clears_both_names(db, tmp_path):
    """An export of this database imported elsewhere and brought back (its trials now under the imported name) holds
    this database's own measurements: nothing is added. A --replace by such a file clears the study it measured
    here as well as the imported one."""
    for number in range(3):
        trial(db, number)
    with TuningDB(tmp_path / "b.sqlite") as other:
        assert other.import_json(db.export_json()) == 3
        back = other.export_json()
    assert {row["study_name"] for row in back["trials"]} == {"study-imported"}
    assert db.import_json(back) == 0
    assert [(t.study_name, t.trial_number) for t in db.trials_in_studies("study")] == [("study", n) for n in range(3)]
    # A tune confirming its winner times a trial again (same study, number and config): the export still carries
    # the first time, and is still this database's own trial.
    db.record_trial(**KEY, bucket=64, study_name="study", trial_number=2, config=config(64), status="ok",
                    time_ms=7.0, reason=None)
    assert db.import_json(back) == 0
    assert [t.time_ms for t in db.trials_in_studies("study")] == [1.0, 2.0, 7.0]
    with TuningDB(tmp_path / "c.sqlite") as retune, TuningDB(tmp_path / "d.sqlite") as colleague:
        retune.record_trial(**KEY, bucket=64, study_name="study", trial_number=0, config=config(64), status="ok",
                            time_ms=9.0, reason=None)
        colleague.import_json(retune.export_json())
        passed_on = colleague.export_json()
    db.import_json(passed_on, replace=True)
    assert [(t.study_name, t.config["block_m"], t.time_ms) for t in db.trials_in_studies("study")] == [
        ("study-imported", 64, 9.0)]


def test_an_import_takes_no_trial_number_of_a_study_being_tuned(db, tmp_path):
    """A tune numbers its study's trials as Optuna hands them out: an import of that study's trials from elsewhere,
    made while it runs, must leave those numbers free, or the tune's next write is refused and its trial lost."""
    trial(db, 0)  # the live study's first trial; Optuna has handed out 1 and 2 already
    with TuningDB(tmp_path / "elsewhere.sqlite") as other:
        for number in range(4):
            other.record_trial(**KEY, bucket=64, study_name="study", trial_number=number, config=config(32 << number),
                               status="ok", time_ms=9.0 + number, reason=None)
        assert db.import_json(other.export_json()) == 4
    trial(db, 1)
    trial(db, 2)
    assert [(t.study_name, t.trial_number) for t in db.trials_in_studies("study")] == [
        ("study", 0), ("study", 1), ("study", 2), *(("study-imported", n) for n in range(4))]


@pytest.mark.parametrize(
    "mutate, message",
    [
        pytest.param(lambda d: [], "expected a JSON object", id="not-an-object"),
        pytest.param(lambda d: {**d, "format": "other"}, "expected a JSON object with \"format\"", id="foreign-format"),
        pytest.param(lambda d: {**d, "format_version": 99}, "format_version: this tilegen reads", id="newer-format"),
        pytest.param(lambda d: {**d, "tuned": {}}, "tuned: expected a list", id="section-not-a-list"),
        pytest.param(lambda d: _drop(d, "tuned", "time_ms"), "tuned[0].time_ms: missing", id="missing-field"),
        pytest.param(lambda d: _set(d, "tuned", bucket="64"), "tuned[0].bucket: expected an integer", id="wrong-type"),
        pytest.param(lambda d: _set(d, "tuned", gpu_key="nope"), "tuned[0].gpu_key: 'nope' is not in", id="unknown-gpu"),
        pytest.param(lambda d: _set(d, "trials", status="meh"), "trials[0].status: expected one of", id="bad-status"),
        pytest.param(lambda d: _set(d, "variants", spec_hash="0" * 16), "is not the hash of its spec", id="bad-hash"),
    ],
)
def test_import_rejects_a_malformed_document_and_writes_nothing(db, tmp_path, mutate, message):
    record(db, 64, 1.0)
    trial(db, 0)
    data = mutate(db.export_json())
    with TuningDB(tmp_path / "fresh.sqlite") as fresh:
        with pytest.raises(ValueError, match="malformed tilegen export") as error:
            fresh.import_json(data)
        assert message in str(error.value)
        assert fresh.list_tuned() == [] and fresh.variants() == []


def _set(data: dict, section: str, **changes) -> dict:
    data[section][0].update(changes)
    return data


def _drop(data: dict, section: str, field: str) -> dict:
    del data[section][0][field]
    return data


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "readonly"])
def test_a_newer_schema_is_refused_with_both_revisions(db, readonly):
    db.close()
    with sqlite3.connect(db.path) as conn:
        conn.execute("UPDATE tg_alembic_version SET version_num = '9999_future'")
    with pytest.raises(DatabaseError) as error:
        TuningDB(db.path, readonly=readonly)
    assert str(error.value) == (
        f"{db.path} was written by a newer tilegen schema (revision 9999_future); this tilegen knows up to "
        f"revision {SCHEMA_REVISION}. Upgrade tilegen or use another database file"
    )


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "readonly"])
def test_a_corrupt_file_is_refused(tmp_path, readonly):
    path = tmp_path / "junk.sqlite"
    junk = os.urandom(8192)
    path.write_bytes(junk)
    with pytest.raises(DatabaseError, match="not a tilegen database / corrupt: .*junk.sqlite"):
        TuningDB(path, readonly=readonly)
    assert path.read_bytes() == junk


@pytest.mark.parametrize("where", ["under-a-file", "is-a-folder"])
def test_an_unusable_location_is_refused_naming_the_path(tmp_path, where):
    (tmp_path / "file").write_text("not a folder")
    path = tmp_path / "file" / "tuning.sqlite" if where == "under-a-file" else tmp_path
    with pytest.raises(DatabaseError, match=f"cannot .*{re.escape(str(path))}"):
        TuningDB(path)


def _the_shipped_rows_beside(user_db, tmp_path, monkeypatch, caplog) -> str:
    """Dispatch's rows with ``TILEGEN_DB`` at ``user_db`` beside a shipped file of one row: they must be the shipped
    file's, with one warning, which is returned."""
    shipped = tmp_path / "shipped.sqlite"
    with TuningDB(shipped) as db:
        record(db, 64, 1.0)
    monkeypatch.setattr(env, "shipped_db_path", lambda: shipped)
    monkeypatch.setenv("TILEGEN_DB", str(user_db))
    with caplog.at_level(logging.WARNING, logger="tilegen.db"):
        rows = tuned_rows(SPEC, CPU_INTERPRETER, KEY["template_hash"], KEY["triton_version"])
    assert {bucket: source for bucket, (_, source) in rows.items()} == {64: str(shipped)}
    (warning,) = [r.getMessage() for r in caplog.records]
    return warning


def test_a_path_the_system_cannot_look_up_costs_dispatch_its_rows_and_an_open_one_line(tmp_path, monkeypatch, caplog):
    """A database path whose lookup itself fails (a folder this user may not enter; here a name past the file
    system's limit, which fails the same way for root too): dispatch serves the shipped rows with one warning
    instead of raising from every op, and an open raises ``DatabaseError`` naming the file."""
    unreachable = tmp_path / ("x" * 300 + ".sqlite")
    warning = _the_shipped_rows_beside(unreachable, tmp_path, monkeypatch, caplog)
    assert str(unreachable) in warning and "File name too long" in warning
    for readonly in (False, True):
        with pytest.raises(DatabaseError, match=f"cannot reach the tilegen database {re.escape(str(unreachable))}: "
                                                "File name too long"):
            TuningDB(unreachable, readonly=readonly)


def test_dispatch_says_a_tilegen_db_naming_a_folder_is_one(tmp_path, monkeypatch, caplog):
    folder = tmp_path / "databases"
    folder.mkdir()
    warning = _the_shipped_rows_beside(folder, tmp_path, monkeypatch, caplog)
    assert f"{folder} is a folder" in warning, warning  # not SQLite's "disk I/O error"


def test_readonly_open_never_writes(db, tmp_path):
    record(db, 64, 1.0)
    db.close()
    before = db.path.read_bytes()
    with TuningDB(db.path, readonly=True) as ro:
        assert list(ro.best(**KEY)) == [64]
        with pytest.raises(DatabaseError, match="is open read-only"):
            record(ro, 128, 1.0)
    assert db.path.read_bytes() == before
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    with pytest.raises(DatabaseError, match="not a tilegen database"):
        TuningDB(empty, readonly=True)  # no migration on a read-only open
    assert empty.stat().st_size == 0
    with pytest.raises(DatabaseError, match="no tilegen database at"):
        TuningDB(tmp_path / "missing.sqlite", readonly=True)


def test_prune_removes_stale_rows_only(db):
    record(db, 64, 1.0)
    record(db, 64, 1.0, device=H100)  # another GPU: not stale
    record(db, 128, 1.0, triton_version="3.5.0")
    record(db, 256, 1.0, template_hash="0" * 16, spec=OTHER_SPEC)
    trial(db, 0)
    trial(db, 1, triton_version="3.5.0")
    trial(db, 2, template_hash="0" * 16)
    assert db.prune() == 4
    assert {(r.gpu_key, r.bucket) for r in db.list_tuned()} == {(CPU_INTERPRETER.key, 64), (H100.key, 64)}
    assert [t.trial_number for t in db.trials_for(SPEC.hash)] == [0]
    assert db.variants(OTHER_SPEC.hash) == []  # left without rows: gone too
    assert db.prune() == 0


def test_prune_by_tilegen_version_keeps_only_that_version(db):
    record(db, 64, 1.0)
    assert db.prune(keep_tilegen="0.0.1") == 1
    assert db.list_tuned() == []


def test_studies_live_beside_the_database():
    assert studies_url("/data/tilegen/tuning.sqlite") == "sqlite:////data/tilegen/tuning.optuna.sqlite"


def _writer(path: Path, name: str, n: int, bases: tuple[float, float], start) -> None:
    """One writer process: n trials of its own study and n best rows on buckets both processes share."""
    start.wait()  # both open (and migrate) the fresh file at the same moment
    key = dict(spec=SPEC, device=CPU_INTERPRETER, template_hash="t", triton_version="x")
    with TuningDB(path) as db:
        for i in range(n):
            db.record_trial(**key, bucket=64, study_name=name, trial_number=i, config=config(), status="ok",
                            time_ms=i + 1)
            db.record_best(
                **key, bucket=16 << (i % 4), config=config(), time_ms=bases[i % 2] + i, max_error=0.0, trials=i
            )


def test_two_writer_processes_lose_nothing(tmp_path):
    path, n = tmp_path / "shared.sqlite", 40
    # Best times are base + i, the base differing per process and parity of i: the fastest per bucket is known.
    bases = {"a": (100.0, 50.0), "b": (70.0, 200.0)}
    # Forked, so the writers start without paying tilegen's import again; each opens its own connections.
    context = multiprocessing.get_context("fork")
    start = context.Barrier(len(bases))
    writers = [context.Process(target=_writer, args=(path, name, n, base, start)) for name, base in bases.items()]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        assert writer.exitcode == 0
    with TuningDB(path, readonly=True) as db:
        trials = db.trials_for(SPEC.hash)
        assert sorted((t.study_name, t.trial_number) for t in trials) == [(s, i) for s in "ab" for i in range(n)]
        best = {r.bucket: (r.time_ms, r.trials) for r in db.list_tuned()}
    expected = {}
    for i in range(n):
        bucket = 16 << (i % 4)
        fastest = min(base[i % 2] + i for base in bases.values())
        time_ms, trials_count = expected.get(bucket, (float("inf"), 0))
        expected[bucket] = (min(time_ms, fastest), max(trials_count, i))
    assert best == expected


# -- what a writer accepts ------------------------------------------------------------------

BAD_BEST = {
    "not-a-power-of-two": (dict(config=Config(48, 32, 4, 1).to_dict()), "block_m=48: the template asserts a power"),
    "zero-time": (dict(time_ms=0.0), "time_ms: expected a positive, finite number"),
    "negative-time": (dict(time_ms=-1.0), "time_ms: expected a positive, finite number"),
    "infinite-time": (dict(time_ms=float("inf")), "time_ms: expected a positive, finite number"),
    "bucket-17": (dict(bucket=17), "bucket: 17 is not a bucket of attention_fwd"),
    "unknown-knob": (dict(config={**config(), "block_k": 16}), "block_k: unknown knob"),
    "missing-knob": (dict(config={"block_m": 16}), "config: block_n: missing"),
}


@pytest.mark.parametrize("case", BAD_BEST)
def test_record_best_refuses_a_row_the_kernel_cannot_run_or_a_bad_number(db, case):
    changes, message = BAD_BEST[case]
    row = dict(**KEY, bucket=64, config=config(), time_ms=1.0, max_error=1e-3, trials=3)
    with pytest.raises(RowError, match=re.escape(message)):
        db.record_best(**{**row, **changes})
    assert db.list_tuned() == []


def test_an_ok_trial_must_be_runnable_but_a_failed_one_may_not_be(db):
    bad = Config(48, 32, 4, 1).to_dict()
    with pytest.raises(RowError, match="block_m=48"):
        db.record_trial(**KEY, bucket=64, study_name="s", trial_number=0, config=bad, status="ok", time_ms=1.0)
    db.record_trial(**KEY, bucket=64, study_name="s", trial_number=0, config=bad, status="infeasible", reason="no")
    assert [t.status for t in db.trials_for(SPEC.hash)] == ["infeasible"]


def test_a_trial_is_never_overwritten_by_another_config(db):
    trial(db, 0)
    with pytest.raises(DatabaseError, match="trials are never overwritten"):
        db.record_trial(**KEY, bucket=64, study_name="study", trial_number=0, config=config(64), status="ok",
                        time_ms=0.5)
    assert [(t.config, t.time_ms) for t in db.trials_for(SPEC.hash)] == [(config(16), 1.0)]


@pytest.mark.parametrize("case", ["not-a-power-of-two", "zero-time", "negative-time", "bucket-17", "unknown-knob",
                                  "missing-knob"])
def test_import_refuses_a_bad_row_or_skips_it_when_asked(db, tmp_path, case):
    record(db, 64, 1.0)
    record(db, 128, 2.0)
    data = db.export_json()
    changes, message = BAD_BEST[case]
    data["tuned"][0].update(changes)
    with TuningDB(tmp_path / "fresh.sqlite") as fresh:
        with pytest.raises(ValueError, match="refused tilegen export: tuned\\[0\\]") as error:
            fresh.import_json(data)
        assert message in str(error.value) and "--skip-bad" in str(error.value)
        assert fresh.list_tuned() == []
        assert fresh.import_json(data, skip_bad=True) == 1
        assert [r.bucket for r in fresh.list_tuned()] == [128]
        assert len(fresh.skipped) == 1 and message in fresh.skipped[0]


def test_import_refuses_an_ok_trial_with_a_config_the_kernel_cannot_run(db, tmp_path):
    trial(db, 0)
    data = db.export_json()
    data["trials"][0]["config"] = Config(48, 16, 4, 1).to_dict()
    with TuningDB(tmp_path / "fresh.sqlite") as fresh, pytest.raises(ValueError, match="trials\\[0\\].*block_m=48"):
        fresh.import_json(data)


def test_imported_rows_are_marked_and_a_local_tune_that_beats_them_is_not(db, tmp_path):
    record(db, 64, 2.0)
    with TuningDB(tmp_path / "fresh.sqlite") as fresh:
        fresh.import_json(db.export_json())
        assert fresh.best(**KEY)[64].provenance == "imported"
        record(fresh, 64, 1.0)
        assert fresh.best(**KEY)[64].provenance == "tuned"


def test_an_older_schema_is_upgraded_in_place_keeping_its_rows(tmp_path):
    path = tmp_path / "old.sqlite"
    with TuningDB(path) as db:
        record(db, 64, 1.0)
    _downgrade(path, "0001")
    with sqlite3.connect(path) as conn:
        assert "provenance" not in {c[1] for c in conn.execute("PRAGMA table_info(tg_tuned_configs)")}
    with TuningDB(path) as db:
        assert db.best(**KEY)[64].provenance == "tuned"
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version_num FROM tg_alembic_version").fetchall() == [(SCHEMA_REVISION,)]


def test_dispatch_reads_an_older_schema_read_only_without_upgrading_it(tmp_path, monkeypatch):
    # A shipped file of an older revision inside an installed wheel: read, never written.
    shipped = tmp_path / "shipped.sqlite"
    with TuningDB(shipped) as db:
        record(db, 64, 1.0)
    _downgrade(shipped, "0001")
    monkeypatch.setattr(env, "shipped_db_path", lambda: shipped)
    before = shipped.read_bytes()
    rows = tuned_rows(**KEY, user_db=tmp_path / "none.sqlite")
    assert list(rows) == [64] and rows[64][1] == str(shipped)
    assert shipped.read_bytes() == before


def _downgrade(path: Path, revision: str) -> None:
    from alembic import command

    from tilegen.db.migrate import _alembic_config

    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        alembic_config = _alembic_config()
        alembic_config.attributes["connection"] = conn
        command.downgrade(alembic_config, revision)
    engine.dispose()


def test_a_read_only_open_of_an_older_schema_reads_an_upgraded_copy(tmp_path):
    path = tmp_path / "old.sqlite"
    with TuningDB(path) as db:
        record(db, 64, 1.0)
    _downgrade(path, "0001")
    before = path.read_bytes()
    with TuningDB(path, readonly=True) as db:
        assert [(r.bucket, r.provenance) for r in db.list_tuned()] == [(64, "tuned")]
        with pytest.raises(DatabaseError, match="open read-only"):
            record(db, 128, 1.0)
    assert path.read_bytes() == before


def test_the_fast_reader_knows_every_revision():
    from tilegen.db.sqlite import REVISIONS

    assert tuple(known_revisions()) == REVISIONS
