"""Rows of another Triton: served, nearest version first, when the installed Triton has none for a bucket.

Every shipped row was tuned under one Triton, and a torch upgrade brings another. Dispatch then
serves, per bucket, the row of the nearest Triton version whose config the installed Triton can
run; a row of the installed Triton always wins. ``explain`` says where such a row came from,
``tilegen db list`` marks the rows served, and ``tilegen db verify --retime`` times them on the
GPU and stores them under the installed Triton. The installed Triton is played by patching
``triton.__version__``, which every reader consults at the time it reads.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import triton
from typer.testing import CliRunner

import tilegen
from tilegen import AttentionSpec, dispatch, env
from tilegen.cli import app
from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB, tuned_rows
from tilegen.db.lookup import serving_order
from tilegen.device import CPU_INTERPRETER, DeviceInfo, device_info
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import Config

SPEC = AttentionSpec(head_dim=32, mask="causal", dtype="fp32")
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_109_880_320, 232_448)
GLUON_SPEC = AttentionSpec(head_dim=128, mask="causal", dtype="bf16")
#: A shipped H200 row's config: the Gluon kernel, which only Triton 3.6 runs.
GLUON = Config(128, 64, 8, 3, tma=1, wgmma=2)
TEMPLATE = template_hash(ATTENTION_FWD)
runner = CliRunner()


@pytest.fixture
def files(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(the user's database, the shipped one), both empty, in place of the real ones."""
    user, shipped = tmp_path / "user.sqlite", tmp_path / "shipped.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(user))
    monkeypatch.setattr(env, "shipped_db_path", lambda: shipped)
    return user, shipped


def installed(monkeypatch, version: str) -> None:
    monkeypatch.setattr(triton, "__version__", version)


def store(path: Path, version: str, bucket: int, config: Config, *, spec=SPEC, device=CPU_INTERPRETER,
          time_ms: float = 1.0) -> None:
    with TuningDB(path) as db:
        db.record_best(spec=spec, device=device, template_hash=TEMPLATE, triton_version=version, bucket=bucket,
                       config=config.to_dict(), time_ms=time_ms, max_error=1e-5, trials=3)


def rows_under(version: str, spec=SPEC, device=CPU_INTERPRETER):
    return tuned_rows(spec, device, TEMPLATE, version)


def test_serving_order_is_nearest_version_first_the_older_on_a_tie():
    versions = ["3.10.0", "3.9.0", "3.8.0", "3.6.0", "3.6.5", "3.7.0", "3.7.1", "3.5.2"]
    ordered = sorted(versions, key=lambda v: serving_order(v, "3.7.1"))
    # As text "3.10.0" sorts before "3.6.0"; as versions it is the farthest of them.
    assert ordered == ["3.7.1", "3.7.0", "3.6.5", "3.6.0", "3.8.0", "3.5.2", "3.9.0", "3.10.0"]
    assert serving_order("main", "3.7.1") is None and serving_order("3.6.0", "not-a-version") is None


def test_a_row_of_an_older_triton_is_served_when_the_installed_one_has_none(files, monkeypatch):
    user, shipped = files
    store(shipped, "3.6.0", 64, Config(32, 16, 4, 1))
    installed(monkeypatch, "3.7.1")
    rows = rows_under("3.7.1")
    assert rows == {64: (Config(32, 16, 4, 1), str(shipped))}
    assert rows.tuned_under == {64: "3.6.0"} and rows.triton_version == "3.7.1"
    choice = dispatch.Table(SPEC, CPU_INTERPRETER, rows).choose(100)
    assert (choice.config, choice.tuned_bucket, choice.tuned_under) == (Config(32, 16, 4, 1), 64, "3.6.0")
    assert choice.note == "tuned under Triton 3.6.0; installed 3.7.1"


def test_a_row_of_the_installed_triton_wins_whichever_file_holds_it(files, monkeypatch):
    user, shipped = files
    store(user, "3.6.0", 64, Config(32, 16, 4, 1))  # the user's file, but another Triton
    store(shipped, "3.7.1", 64, Config(16, 16, 4, 1))
    store(user, "3.6.0", 128, Config(32, 32, 4, 1))  # no row of 3.7.1 for this bucket: served
    installed(monkeypatch, "3.7.1")
    rows = rows_under("3.7.1")
    assert rows == {64: (Config(16, 16, 4, 1), str(shipped)), 128: (Config(32, 32, 4, 1), str(user))}
    assert rows.tuned_under == {128: "3.6.0"}
    table = dispatch.Table(SPEC, CPU_INTERPRETER, rows)
    assert table.choose(64).note is None and table.choose(128).note == "tuned under Triton 3.6.0; installed 3.7.1"


def test_the_nearest_of_several_tritons_is_served(files, monkeypatch):
    user, shipped = files
    by_version = {"3.5.0": Config(16, 16, 4, 1), "3.6.0": Config(32, 16, 4, 1), "3.8.0": Config(16, 32, 4, 1),
                  "3.10.0": Config(32, 32, 4, 1)}
    for version, config in by_version.items():
        store(shipped, version, 64, config)
    installed(monkeypatch, "3.7.1")
    # 3.6.0 and 3.8.0 are one minor release away: the older wins the tie.
    assert rows_under("3.7.1")[64][0] == by_version["3.6.0"]
    # 3.8.0 and 3.10.0 are one minor release from 3.9.4 (as text "3.10.0" sorts first of all): the older.
    installed(monkeypatch, "3.9.4")
    assert rows_under("3.9.4")[64][0] == by_version["3.8.0"]
    installed(monkeypatch, "3.11.0")
    assert rows_under("3.11.0")[64][0] == by_version["3.10.0"]
    # A tie between the files goes to the user's, as for the installed Triton's rows.
    store(user, "3.6.0", 64, Config(64, 16, 4, 1))
    installed(monkeypatch, "3.7.1")
    assert rows_under("3.7.1")[64] == (Config(64, 16, 4, 1), str(user))


def test_a_row_this_triton_cannot_run_is_passed_over_for_the_next_nearest(files, monkeypatch):
    user, shipped = files
    installed(monkeypatch, "3.6.0")  # the Gluon kernel's Triton, under which its row was tuned
    store(shipped, "3.6.0", 512, GLUON, spec=GLUON_SPEC, device=H200)
    store(shipped, "3.6.0", 1024, GLUON, spec=GLUON_SPEC, device=H200)
    store(shipped, "3.5.0", 512, Config(128, 64, 8, 3, tma=1), spec=GLUON_SPEC, device=H200)
    assert rows_under("3.6.0", GLUON_SPEC, H200)[512][0] == GLUON
    installed(monkeypatch, "3.7.1")
    rows = rows_under("3.7.1", GLUON_SPEC, H200)
    # 3.6.0 is nearer, but 3.7.1 cannot run its Gluon config: 3.5.0's row serves 512, and 1024 has none.
    assert rows == {512: (Config(128, 64, 8, 3, tma=1), str(shipped))} and rows.tuned_under == {512: "3.5.0"}
    # tilegen db list says the same, judging the rows on their own GPU.
    result = runner.invoke(app, ["db", "list", "--wide", "--db", str(user)])
    assert result.exit_code == 0, result.output
    assert _unused(result.stdout) == {("3.6.0", "512"): "other Triton", ("3.6.0", "1024"): "other Triton",
                                      ("3.5.0", "512"): "other Triton (served)"}


def test_explain_says_the_row_came_from_another_triton(files, monkeypatch):
    user, shipped = files
    store(shipped, "3.6.0", 64, Config(32, 16, 4, 1))
    q, k, v = (torch.randn(1, 2, 50, 32) for _ in range(3))
    installed(monkeypatch, "3.7.1")
    choice = tilegen.explain(q, k, v, causal=True)
    assert choice.config == Config(32, 16, 4, 1) and choice.source == str(shipped)
    assert "note='tuned under Triton 3.6.0; installed 3.7.1'" in repr(choice)
    store(user, "3.7.1", 64, Config(16, 16, 4, 1))
    dispatch.reset()
    choice = tilegen.explain(q, k, v, causal=True)
    assert choice.config == Config(16, 16, 4, 1) and choice.note is None and "tuned under" not in repr(choice)


def _unused(output: str) -> dict[tuple[str, str], str]:
    """``tilegen db list --wide``'s unused column by (Triton, bucket)."""
    marks = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) == 12 and re.fullmatch(r"\d+", cells[4]):
            marks[cells[3], cells[4]] = cells[11]
    return marks


def test_db_list_marks_the_rows_dispatch_serves(files, monkeypatch):
    user, shipped = files
    store(user, "3.6.0", 64, Config(32, 16, 4, 1))  # served: no 3.7.1 row of bucket 64
    store(user, "3.5.0", 64, Config(16, 16, 4, 1))  # not served: 3.6.0 is nearer
    store(user, "3.6.0", 128, Config(32, 32, 4, 1))  # not served: the shipped file has 3.7.1's row
    store(shipped, "3.7.1", 128, Config(16, 16, 4, 1))
    store(shipped, "3.6.0", 256, Config(32, 32, 4, 1))  # served, from the shipped file
    installed(monkeypatch, "3.7.1")
    result = runner.invoke(app, ["db", "list", "--wide", "--db", str(user)])
    assert result.exit_code == 0, result.output
    assert _unused(result.stdout) == {
        ("3.5.0", "64"): "other Triton", ("3.6.0", "64"): "other Triton (served)",
        ("3.6.0", "128"): "other Triton", ("3.7.1", "128"): "", ("3.6.0", "256"): "other Triton (served)",
    }
    stderr = " ".join(result.stderr.split())
    assert "2 of the tuned configs in" in stderr  # the two not served, not the one that is
    assert "tilegen db verify --retime" in stderr
    # What the list says is what dispatch serves.
    rows = rows_under("3.7.1")
    assert rows.tuned_under == {64: "3.6.0", 256: "3.6.0"} and rows[64] == (Config(32, 16, 4, 1), str(user))


def test_retime_needs_a_gpu_and_says_so(files, monkeypatch):
    user, shipped = files
    store(shipped, "3.5.0", 64, Config(32, 16, 4, 1), device=device_info())
    monkeypatch.setattr("tilegen.cli.verify.gpu_available", lambda: False)
    result = runner.invoke(app, ["db", "verify", "--retime", "--db", str(user)])
    assert result.exit_code == 2, result.output
    assert "--retime: needs a CUDA GPU" in result.stderr and "nothing was stored" in result.stderr
    assert not user.exists()


@pytest.mark.parametrize(("extra", "message"), [
    (["--shipped"], "--retime: re-timed rows are stored in your database"),
    (["--drop-failed"], "--drop-failed: not with --retime"),
])
def test_retime_refuses_options_it_cannot_honour(files, extra, message):
    user, _ = files
    result = runner.invoke(app, ["db", "verify", "--retime", *extra, "--db", str(user)])
    assert result.exit_code == 2 and message in result.stderr, result.output


def test_retime_stores_each_served_row_under_the_installed_triton_and_an_interrupted_run_keeps_them(
        files, monkeypatch):
    """The CPU interpreter stands in for the GPU (``gpu_available`` patched): the rows are run, checked
    and timed by the tuning worker as on a GPU. The installed Triton is the real one, the rows an older's."""
    from tilegen.tuning.worker import Worker

    user, shipped = files
    here, now = device_info(), triton.__version__
    store(shipped, "3.0.0", 64, Config(32, 16, 4, 1), device=here, time_ms=5.0)
    store(user, "3.0.0", 128, Config(32, 32, 4, 1), device=here, time_ms=5.0)
    store(user, now, 256, Config(16, 16, 4, 1), device=here, time_ms=5.0)  # the installed Triton's: not re-timed
    monkeypatch.setattr("tilegen.cli.verify.gpu_available", lambda: True)
    measure, calls = Worker.measure, []

    def interrupted_at_the_second(self, task, timeout):
        calls.append(task[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(self, task, timeout)

    monkeypatch.setattr(Worker, "measure", interrupted_at_the_second)
    result = runner.invoke(app, ["db", "verify", "--retime", "--db", str(user)])
    assert result.exit_code != 0, result.output
    with TuningDB(user) as db:
        mine = {(r.triton_version, r.bucket): r for r in db.list_tuned()}
    first = Config(32, 32, 4, 1) if calls[0] == Config(32, 32, 4, 1) else Config(32, 16, 4, 1)
    retimed = [key for key in mine if key[0] == now and key[1] != 256]
    assert len(retimed) == 1, mine  # the row timed before the interrupt is kept, the other is not there
    row = mine[retimed[0]]
    assert Config(**row.config) == first and row.time_ms != 5.0 and row.provenance == "tuned"
    assert row.max_error < 1e-3 and row.tflops > 0

    monkeypatch.setattr(Worker, "measure", measure)
    calls.clear()
    result = runner.invoke(app, ["db", "verify", "--retime", "--db", str(user)])
    assert result.exit_code == 0, result.output
    assert "stored 1 re-timed row(s)" in result.stderr  # only the one the interrupted run left
    with TuningDB(user) as db:
        mine = {(r.triton_version, r.bucket): r for r in db.list_tuned()}
    assert {(now, 64), (now, 128), (now, 256)} <= set(mine)
    assert mine[now, 256].time_ms == 5.0  # the installed Triton's own row was left alone
    # Now they are the installed Triton's rows: dispatch serves none from another, and nothing is left to re-time.
    rows = tuned_rows(SPEC, here, TEMPLATE, now)
    assert rows.tuned_under == {} and rows[64] == (Config(32, 16, 4, 1), str(user))
    result = runner.invoke(app, ["db", "verify", "--retime", "--db", str(user)])
    assert result.exit_code == 0 and "nothing to re-time" in result.stdout, result.output


@pytest.mark.gpu
def test_retime_on_a_gpu(files):
    user, _ = files
    store(user, "3.0.0", 64, Config(32, 16, 4, 1), device=device_info(), time_ms=5.0)
    result = runner.invoke(app, ["db", "verify", "--retime", "--db", str(user)])
    assert result.exit_code == 0, result.output
    with TuningDB(user) as db:
        rows = {(r.triton_version, r.bucket): r for r in db.list_tuned()}
    assert rows[triton.__version__, 64].time_ms != 5.0


def test_emit_tuned_bakes_a_served_row_and_says_whose_it_was(files, tmp_path):
    user, _ = files
    store(user, "3.0.0", 64, Config(32, 16, 4, 1), device=device_info())
    module = tmp_path / "standalone.py"
    result = runner.invoke(app, ["emit", "--tuned", "--db", str(user), "--spec", SPEC.to_json(), "-o", str(module)])
    assert result.exit_code == 0, result.output
    line = next(line for line in module.read_text().splitlines() if line.startswith("    64: {"))
    assert line.endswith(f"# {user} (tuned under Triton 3.0.0; installed {triton.__version__})"), line


def test_the_rows_are_read_once_per_table_not_per_call(files, monkeypatch):
    from tilegen.db import lookup

    user, shipped = files
    store(shipped, "3.6.0", 64, Config(32, 16, 4, 1))
    store(user, "3.5.0", 128, Config(16, 16, 4, 1))
    reads = []
    read_tuned = lookup.read_tuned
    monkeypatch.setattr(lookup, "read_tuned", lambda *args: reads.append(args[0]) or read_tuned(*args))
    installed(monkeypatch, "3.7.1")
    q, k, v = (torch.randn(1, 2, 50, 32) for _ in range(3))
    for n in (50, 50, 100):
        tilegen.attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], causal=True)
    assert sorted(reads) == sorted([user, shipped])  # one query per file, for the first call only


def test_a_served_row_that_fails_to_compile_is_skipped_at_its_first_launch(files, monkeypatch, caplog):
    """The fallback every tuned row has: the row is skipped with one warning naming its Triton, the default runs."""
    import dataclasses
    import json
    import logging
    import sqlite3

    from tilegen.families import registry
    from tilegen.families.attention_fwd.reference import attention_reference

    user, _ = files
    store(user, "3.0.0", 64, Config(32, 16, 4, 1))
    with sqlite3.connect(user) as conn:  # behind the writers' checks: a block tl.arange refuses
        conn.execute("UPDATE tg_tuned_configs SET config_json = ?", (json.dumps(Config(48, 16, 4, 1).to_dict()),))
    monkeypatch.setitem(registry._by_name, ATTENTION_FWD.name,
                        dataclasses.replace(ATTENTION_FWD, feasible=lambda spec, config, device: None))
    q, k, v = (torch.randn(1, 2, 50, 32) for _ in range(3))
    assert tilegen.explain(q, k, v, causal=True).tuned_under == "3.0.0"
    with caplog.at_level(logging.WARNING, logger="tilegen.dispatch"):
        out = tilegen.attention(q, k, v, causal=True)
    ref = attention_reference(q, k, v, causal=True)[0]
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-4
    warnings = [r.getMessage() for r in caplog.records if "skipping the tuned config" in r.getMessage()]
    assert len(warnings) == 1 and f"tuned under Triton 3.0.0; installed {triton.__version__}" in warnings[0]
    assert tilegen.explain(q, k, v, causal=True).source == "default"
