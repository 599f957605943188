"""``tilegen db`` and ``tilegen emit --tuned``: happy paths, one-line errors, and the standalone module."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton
from typer.testing import CliRunner

from helpers import checkout_pythonpath

from tilegen import AttentionSpec, dispatch
from tilegen.cli import app
from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB
from tilegen.db.store import imported_study
from tilegen.device import CPU_INTERPRETER, DeviceInfo, device_info
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import Config
from tilegen.families.attention_fwd.reference import attention_reference

SPEC = AttentionSpec(head_dim=64, mask="causal", dtype="fp16")
OTHER_SPEC = AttentionSpec(head_dim=128, dtype="bf16")
CURRENT = dict(template_hash=template_hash(ATTENTION_FWD), triton_version=triton.__version__)
runner = CliRunner()
H100_DEVICE = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 85_000_000_000, 232_448)


def _best(db: TuningDB, spec: AttentionSpec, bucket: int, time_ms: float, cfg: Config, device=CPU_INTERPRETER, **key):
    db.record_best(
        spec=spec, device=device, **{**CURRENT, **key}, bucket=bucket, config=cfg.to_dict(), time_ms=time_ms,
        max_error=1e-3, trials=12, tflops=1.5,
    )


@pytest.fixture
def populated(tmp_path) -> Path:
    """Two variants with tuned rows; three trials of SPEC, the fastest one recorded second."""
    path = tmp_path / "tuning.sqlite"
    with TuningDB(path) as db:
        _best(db, SPEC, 64, 1.0, Config(32, 16, 4, 1))
        _best(db, SPEC, 128, 2.0, Config(64, 32, 4, 1))
        _best(db, OTHER_SPEC, 64, 3.0, Config(16, 16, 4, 1))
        _best(db, SPEC, 64, 1.0, Config(16, 16, 4, 1), triton_version="0.0-old")  # stale: prune removes it
        for number, status, time_ms in ((0, "ok", 3.0), (1, "ok", 1.0), (2, "compile_error", None)):
            db.record_trial(
                spec=SPEC, device=CPU_INTERPRETER, **CURRENT, bucket=64, study_name="s", trial_number=number,
                config=Config(16 * (number + 1), 16, 4, 1).to_dict(), status=status, time_ms=time_ms,
                reason="ptxas: out of resources" if time_ms is None else None,
            )
    return path


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # not an uncaught exception
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


def test_help_names_the_dashboard_for_the_studies():
    result = invoke("db", "--help")
    assert result.exit_code == 0
    assert "optuna-dashboard sqlite:///" in result.stdout and ".optuna.sqlite" in result.stdout


def test_list_prints_every_tuned_row(populated):
    result = invoke("db", "--db", populated, "list")
    assert result.exit_code == 0, result.output
    for text in (SPEC.name, SPEC.hash, OTHER_SPEC.hash, CPU_INTERPRETER.key, "BM32-BN16-w4-s1", "BM64-BN32-w4-s1",
                 "0.0-old", "1.0000", "1.5", "1.00e-03"):
        assert text in result.stdout


def test_list_says_which_rows_dispatch_can_never_use_and_why(populated):
    with TuningDB(populated) as db:
        _best(db, OTHER_SPEC, 128, 4.0, Config(16, 16, 4, 1), template_hash="0" * 16)
        rows = db.list_tuned()
        why = {(row.spec_hash, row.bucket, row.triton_version): reason
               for row, reason in zip(rows, TuningDB.why_stale(rows))}
    old = "other Triton"
    assert why == {
        (SPEC.hash, 64, triton.__version__): None, (SPEC.hash, 128, triton.__version__): None,
        (OTHER_SPEC.hash, 64, triton.__version__): None, (SPEC.hash, 64, "0.0-old"): old,
        (OTHER_SPEC.hash, 128, triton.__version__): "template changed",
    }
    result = runner.invoke(app, ["db", "--db", str(populated), "list"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    assert "unused" in result.stdout and old in result.stdout and "template changed" in result.stdout
    assert f"2 of the tuned configs in {populated} are ones dispatch here can never use" in result.stderr
    assert invoke("db", "--db", populated, "prune", "--yes").exit_code == 0
    result = invoke("db", "--db", populated, "list")
    assert result.exit_code == 0 and "can never use" not in result.stderr
    # A row of a family this tilegen does not know: prune keeps it unless told.
    with sqlite3.connect(populated) as raw:
        raw.execute("UPDATE tg_variants SET family = 'retired_family' WHERE spec_hash = ?", (OTHER_SPEC.hash,))
    result = runner.invoke(app, ["db", "--db", str(populated), "list"], env={"COLUMNS": "1000"})
    assert "unknown family" in result.stdout
    assert "(with --all, the 1 of families this tilegen does not know)" in result.stderr, result.stderr


def test_list_reads_tilegen_db_by_default(populated, monkeypatch):
    monkeypatch.setenv("TILEGEN_DB", str(populated))
    result = invoke("db", "list")
    assert result.exit_code == 0 and SPEC.hash in result.stdout


def test_show_prints_the_spec_the_tuned_rows_and_the_trials_fastest_first(populated):
    result = invoke("db", "--db", populated, "show", SPEC.hash[:6])
    assert result.exit_code == 0, result.output
    assert '"mask": "causal"' in result.stdout and OTHER_SPEC.hash not in result.stdout
    assert "BM32-BN16-w4-s1" in result.stdout and "BM64-BN32-w4-s1" in result.stdout
    trials = result.stdout[result.stdout.index("trials"):]
    order = [trials.index(config) for config in ("BM32-BN16-w4-s1", "BM16-BN16-w4-s1", "BM48-BN16-w4-s1")]
    assert order == sorted(order)  # 1.0 ms, 3.0 ms, then the compile error
    assert "ptxas: out of resources" in trials


def test_export_then_import_into_a_fresh_database(populated, tmp_path):
    exported, fresh = tmp_path / "export.json", tmp_path / "fresh.sqlite"
    result = invoke("db", "--db", populated, "export", exported)
    assert result.exit_code == 0, result.output
    assert "exported 4 tuned configs and 3 trials" in result.stderr
    result = invoke("db", "--db", fresh, "import", exported)
    assert result.exit_code == 0, result.output
    assert "imported 7 rows" in result.stderr
    with TuningDB(populated) as a, TuningDB(fresh) as b:
        # Trials are filed under their studies' imported names, where no tune of the fresh database writes.
        want = a.export_json()
        want["trials"] = [{**row, "study_name": imported_study(row["study_name"])} for row in want["trials"]]
        assert _without_provenance(want) == _without_provenance(b.export_json())
        assert {r.provenance for r in b.list_tuned()} == {"imported"}


def test_export_to_a_dash_writes_the_json_to_stdout(populated, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("db", "--db", populated, "export", "-")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "-").exists()
    with TuningDB(populated) as db:
        assert json.loads(result.stdout) == json.loads(json.dumps(db.export_json()))
    assert "exported 4 tuned configs and 3 trials to stdout" in result.stderr


def test_import_from_a_dash_reads_stdin_as_export_writes_stdout(populated, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exported = invoke("db", "--db", populated, "export", "-")
    copy = tmp_path / "copy.sqlite"
    result = runner.invoke(app, ["db", "--db", str(copy), "import", "-"], input=exported.stdout)
    assert result.exit_code == 0, result.output
    assert f"imported 7 rows from stdin into {copy}" in result.stderr
    with TuningDB(populated) as a, TuningDB(copy) as b:
        assert sorted((r.bucket, json.dumps(r.config)) for r in a.list_tuned()) == sorted(
            (r.bucket, json.dumps(r.config)) for r in b.list_tuned())


def test_export_refuses_to_write_over_the_database_it_exports(populated, tmp_path):
    """`tilegen db export $TILEGEN_DB` would leave the database a JSON file every later command refuses; so would
    writing over the studies file beside it."""
    studies = populated.with_name(populated.stem + ".optuna.sqlite")
    studies.write_bytes(b"studies")
    before = populated.read_bytes()
    for target in (populated, studies, tmp_path / ".." / tmp_path.name / populated.name):
        assert_one_line_error(invoke("db", "--db", populated, "export", target), "is the database's own file")
    assert populated.read_bytes() == before and studies.read_bytes() == b"studies"


def test_a_server_url_whose_port_is_no_number_is_refused_in_one_line():
    for url in ("postgresql+psycopg://tg@dbhost:54x2/tilegen", "postgresql+psycopg://tg@::1:5432/tilegen"):
        assert_one_line_error(invoke("db", "--db", url, "list"), f"--db: {url!r} is not a database URL")


def test_a_sqlite_file_uri_is_refused_before_anything_is_created(tmp_path, monkeypatch):
    # SQLite opened the file the URI names while the studies file and the folders took the text as a relative path.
    monkeypatch.chdir(tmp_path)
    TuningDB(tmp_path / "x.sqlite").close()
    before = sorted(tmp_path.iterdir())
    uri = f"file:{tmp_path / 'x.sqlite'}"
    for command in (("db", "--db", uri, "list"), ("tune", "--db", uri, "--seqlens", "16", "--trials", "1")):
        assert_one_line_error(invoke(*command), "give a SQLite database as a file path, not a file: URI")
    assert sorted(tmp_path.iterdir()) == before  # no "file:" folder beside it


def test_a_database_path_the_system_cannot_look_up_ends_in_one_line(tmp_path, monkeypatch):
    # A name past the file system's limit fails its lookup as a folder this user may not enter does.
    unreachable = tmp_path / ("x" * 300 + ".sqlite")
    message = f"cannot reach {unreachable}: File name too long"
    for command in (("db", "--db", unreachable, "list"), ("emit", "--tuned", "--db", unreachable, "--head-dim", "64"),
                    ("tune", "--db", unreachable, "--seqlens", "16", "--trials", "1")):
        assert_one_line_error(invoke(*command), f"--db: {message}")
    monkeypatch.setenv("TILEGEN_DB", str(unreachable))
    assert_one_line_error(invoke("db", "list"), f"TILEGEN_DB: {message}")


def test_import_replace_takes_a_slower_retune(populated, tmp_path):
    retune, exported = tmp_path / "retune.sqlite", tmp_path / "retune.json"
    with TuningDB(retune) as db:
        _best(db, SPEC, 64, 1.5, Config(64, 16, 4, 1))
    assert invoke("db", "--db", retune, "export", exported).exit_code == 0
    for flags, kept in (((), 1.0), (("--replace",), 1.5)):
        result = invoke("db", "--db", populated, "import", *flags, exported)
        assert result.exit_code == 0, result.output
        with TuningDB(populated) as db:
            assert db.best(spec=SPEC, device=CPU_INTERPRETER, **CURRENT)[64].time_ms == kept


def _without_provenance(data: dict) -> dict:
    return {**data, **{name: [{k: v for k, v in row.items() if k != "provenance"} for row in data[name]]
                       for name in ("tuned", "trials")}}


def test_prune_drops_rows_of_another_triton(populated):
    result = invoke("db", "--db", populated, "prune", "--yes")
    assert result.exit_code == 0, result.output
    assert "0.0-old" in result.stdout  # the row it deletes, shown first
    assert "prune would delete 1 tuned configs and 0 trials" in result.stderr and "pruned 1 rows" in result.stderr
    with TuningDB(populated) as db:
        assert {r.triton_version for r in db.list_tuned()} == {triton.__version__}


def test_prune_asks_first_and_deletes_nothing_without_an_answer(populated):
    result = invoke("db", "prune", "--db", populated)  # --db after the subcommand works too
    assert result.exit_code == 2 and "0.0-old" in result.stdout
    assert result.stderr.splitlines() == [
        f"prune would delete 1 tuned configs and 0 trials from {populated}",
        "error: prune: not deleting without confirmation; run it in a terminal, or pass --yes",
    ]
    with TuningDB(populated) as db:
        assert "0.0-old" in {r.triton_version for r in db.list_tuned()}


@pytest.mark.parametrize("option, value", [("--triton", "3.6"), ("--tilegen", "0.1")])
def test_prune_refuses_a_version_no_row_has(populated, option, value):
    # Versions match exactly: "3.6" for "3.6.0" would delete every row.
    result = invoke("db", "prune", "--db", populated, option, value, "--yes")
    assert_one_line_error(result, f"{option}: no row of {populated} has version {value!r}")
    with TuningDB(populated) as db:
        assert len(db.list_tuned()) == 4


def test_prune_says_when_nothing_matched(populated):
    invoke("db", "prune", "--db", populated, "--yes")
    result = invoke("db", "prune", "--db", populated, "--yes")
    assert result.exit_code == 0 and "nothing matched" in result.stderr


@pytest.mark.parametrize("command", [["list"], ["show", SPEC.hash[:6]], ["export", "{tmp}/x.json"],
                                     ["prune", "--yes"], ["verify", SPEC.hash[:6]]])
def test_every_db_command_takes_db_after_its_name(populated, command):
    args = [a.format(tmp=populated.parent) for a in command]
    result = invoke("db", *args, "--db", populated)
    assert result.exit_code == 0, result.output


def test_list_and_show_include_the_shipped_database_marked_as_such(tmp_path):
    missing = tmp_path / "nothing-here.sqlite"
    result = invoke("db", "list", "--db", missing)
    assert result.exit_code == 0, result.output
    assert "no database at" in result.stderr and "shipped with tilegen (read-only" in result.stdout
    assert "47dbe900c9030f94" in result.stdout
    result = invoke("db", "show", "47dbe900", "--db", missing)  # the README's example, for a new user
    assert result.exit_code == 0, result.output
    assert "from shipped with tilegen" in result.stdout and "attention_fwd_bf16_d128_g1_causal" in result.stdout
    assert not missing.exists()  # reading never creates the user's database


@pytest.mark.parametrize("running", [triton.__version__, "3.7.1", "3.9.0"])
def test_the_shipped_rows_list_whole_under_any_triton(tmp_path, monkeypatch, running):
    """The shipped rows are Triton 3.6's: under another Triton they are another Triton's rows, listed
    as they are, not refused by what this Triton's kernels can run (the Gluon tiles need 3.6)."""
    monkeypatch.setattr(triton, "__version__", running)
    result = invoke("db", "list", "--db", tmp_path / "nothing-here.sqlite", "--wide")
    assert result.exit_code == 0, result.output
    assert "skipped" not in result.stderr, result.stderr
    assert "47dbe900c9030f94" in result.stdout  # a Gluon-tiled preset's rows (hashes are never cut)


def test_a_row_of_another_triton_is_still_bounded(tmp_path):
    """A row of a Triton this process does not run cannot be judged by its kernels, but a knob no
    launch could take is refused all the same."""
    path = tmp_path / "t.sqlite"
    spec = AttentionSpec(head_dim=32, dtype="fp32")
    with TuningDB(path) as db:
        db.record_best(spec=spec, device=CPU_INTERPRETER, template_hash=template_hash(ATTENTION_FWD),
                       triton_version="3.0.0", bucket=64, config=Config(32, 32, 4, 1).to_dict(), time_ms=1.0,
                       max_error=1e-5, trials=1)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE tg_tuned_configs SET config_json = ?", ('{"block_m": 32, "block_n": 32, "num_warps": '
                                                                      f'{2**80}, "num_stages": 1}}',))
    result = invoke("db", "list", "--db", path)
    assert result.exit_code == 0, result.output
    assert "skipped tuned row" in result.stderr and "num_warps" in result.stderr and str(2**80) in result.stderr


def _newer_schema(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE tg_alembic_version SET version_num = '9999_future'")


def _specs_sharing_a_prefix() -> tuple[AttentionSpec, AttentionSpec]:
    # 17 specs over 16 hex digits: two share a first digit.
    seen: dict[str, AttentionSpec] = {}
    for head_dim in range(16, 257, 8):
        spec = AttentionSpec(head_dim=head_dim)
        if spec.hash[0] in seen:
            return seen[spec.hash[0]], spec
        seen[spec.hash[0]] = spec
    raise AssertionError("unreachable")


def _ambiguous(path: Path) -> str:
    with TuningDB(path) as db:
        for spec in _specs_sharing_a_prefix():
            _best(db, spec, 64, 1.0, Config(16, 16, 4, 1))
    return _specs_sharing_a_prefix()[0].hash[0]


# Each case: how to break the setup, the command, and what the one-line error says.
ERROR_CASES = {
    "missing-db": (lambda db, tmp: None, ["--db", "{tmp}/missing.sqlite", "export", "{tmp}/x.json"],
                   "no tilegen database at"),
    "db-is-a-folder": (lambda db, tmp: None, ["--db", "{tmp}", "list"], "is a folder; give the database file"),
    "corrupt-db": (lambda db, tmp: db.write_bytes(os.urandom(4096)), ["list"], "not a tilegen database / corrupt"),
    "newer-schema": (lambda db, tmp: _newer_schema(db), ["list"], "newer tilegen schema (revision 9999_future)"),
    "unknown-hash": (lambda db, tmp: None, ["show", "ffffffff"], "no variant with spec hash 'ffffffff'"),
    "ambiguous-prefix": (lambda db, tmp: _ambiguous(db), ["show", "{prefix}"], "give more of the hash"),
    "import-not-json": (
        lambda db, tmp: (tmp / "bad.json").write_text("{oops"), ["import", "{tmp}/bad.json"], "bad.json is not JSON"
    ),
    "import-malformed": (
        lambda db, tmp: (tmp / "bad.json").write_text('{"format": "tilegen-tuning-db", "format_version": 1}'),
        ["import", "{tmp}/bad.json"], "malformed tilegen export: gpus: expected a list",
    ),
    "import-missing-file": (lambda db, tmp: None, ["import", "{tmp}/nope.json"], "No such file or directory"),
}


def _prepare(case: str, populated: Path) -> tuple[list[str], str]:
    breaks, args, message = ERROR_CASES[case]
    prefix = breaks(populated, populated.parent)
    return [a.format(tmp=populated.parent, prefix=prefix) for a in args], message


@pytest.mark.parametrize("case", ERROR_CASES)
def test_db_errors_end_in_one_line_and_exit_2(populated, case):
    args, message = _prepare(case, populated)
    args = args if args[0] == "--db" else ["--db", str(populated), *args]
    assert_one_line_error(invoke("db", *args), message)


def _tilegen(*args: str, db: Path) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": checkout_pythonpath(), "TILEGEN_DB": str(db)}
    return subprocess.Popen(
        [sys.executable, "-m", "tilegen", *args], env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )


def test_the_real_command_lists_and_fails_without_a_traceback(populated, tmp_path):
    # One happy and a few broken invocations of `python -m tilegen`, run side by side (each pays torch's import).
    broken = {}
    for case in ("newer-schema", "import-malformed"):
        copy = tmp_path / case / "tuning.sqlite"
        copy.parent.mkdir()
        copy.write_bytes(populated.read_bytes())
        breaks, args, message = ERROR_CASES[case]
        breaks(copy, copy.parent)
        broken[case] = (_tilegen("db", *[a.format(tmp=copy.parent) for a in args], db=copy), message)
    listing = _tilegen("db", "list", db=populated)
    stdout, stderr = listing.communicate(timeout=120)
    assert listing.returncode == 0, stderr
    assert SPEC.hash in stdout and "BM32-BN16-w4-s1" in stdout
    for case, (process, message) in broken.items():
        _, stderr = process.communicate(timeout=120)
        assert process.returncode != 0, case
        assert "Traceback" not in stderr and message in stderr, (case, stderr)


def test_emit_tuned_needs_an_existing_database(tmp_path):
    result = invoke("emit", "--tuned", "--db", tmp_path / "missing.sqlite", "--head-dim", "64")
    assert_one_line_error(result, "no tilegen database at")


STANDALONE_SPEC = AttentionSpec(head_dim=32, q_per_kv=2, mask="window", softcap=True, dtype="fp32", return_lse=True)
TUNED_CONFIG = Config(16, 16, 4, 1)


@pytest.fixture
def emitted(tmp_path) -> Path:
    db = tmp_path / "tuning.sqlite"
    with TuningDB(db) as database:
        _best(database, STANDALONE_SPEC, 64, 1.0, TUNED_CONFIG, device=device_info())
    module = tmp_path / "standalone_attention.py"
    result = invoke("emit", "--tuned", "--db", db, "--spec", STANDALONE_SPEC.to_json(), "-o", module)
    assert result.exit_code == 0, result.output
    return module


def test_emit_tuned_bakes_the_table_and_imports_no_tilegen(emitted):
    text = emitted.read_text()
    assert f"TUNED = {{\n    64: {TUNED_CONFIG.to_dict()!r}," in text
    assert "DEFAULTS = [" in text and "def attention(q, k, v, *, scale=None, softcap=None" in text
    assert not re.search(r"^\s*(import|from)\s+tilegen\b", text, re.MULTILINE)


def test_emit_tuned_picks_buckets_as_dispatch_does(emitted):
    module_spec = importlib.util.spec_from_file_location("standalone_attention", emitted)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    rows = {b: (Config(16 * i, 16, 4, 1), "db") for i, b in enumerate((64, 256, 4096), start=1)}
    module.TUNED = {b: cfg.to_dict() for b, (cfg, _) in rows.items()}
    table = dispatch.Table(STANDALONE_SPEC, device_info(), rows)
    for n in (0, 1, 16, 17, 64, 65, 128, 129, 512, 1000, 2048, 5000, 10**6):
        assert Config(**module.config_for(n)) == table.choose(n).config, n
    module.TUNED = {}
    table = dispatch.Table(STANDALONE_SPEC, device_info(), {})
    for n in (1, 100, 2048, 2049, 10**6):
        assert Config(**module.config_for(n)) == table.choose(n).config, n
    module.DEFAULTS = [(128, Config(16, 16, 4, 1).to_dict()), (None, Config(64, 64, 4, 1).to_dict())]
    assert module.config_for(100) == Config(16, 16, 4, 1).to_dict()
    assert module.config_for(129) == Config(64, 64, 4, 1).to_dict()


def test_emit_tuned_module_runs_without_tilegen_and_matches_the_reference(emitted, tmp_path):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 32, generator=gen) for h, n in ((4, 40), (2, 50), (2, 50)))
    torch.save((q, k, v), tmp_path / "inputs.pt")
    script = textwrap.dedent(
        """
        import sys, torch
        import standalone_attention as m
        q, k, v = torch.load("inputs.pt")
        out, lse = m.attention(q, k, v, softcap=20.0, window_left=7, window_right=3)
        torch.save((out, lse), "outputs.pt")
        assert not any(name.split(".")[0] == "tilegen" for name in sys.modules), "tilegen was imported"
        """
    )
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    environment["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out, lse = torch.load(tmp_path / "outputs.pt")
    ref_out, ref_lse = attention_reference(q, k, v, softcap=20.0, window=(7, 3))
    assert (out.double() - ref_out).abs().max() < 1e-4
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse.double() - ref_lse)[finite].abs().max() < 1e-5


def test_an_emitted_module_refuses_inputs_its_kernel_would_misread(emitted):
    # The kernel reads k, v and the window as the call passes them: a shape, device or value tilegen.attention
    # refuses by name would read past the tensors, or give an answer for a call that means nothing.
    module_spec = importlib.util.spec_from_file_location("standalone_attention", emitted)
    m = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(m)
    q, k, v = torch.randn(2, 4, 17, 32), torch.randn(2, 2, 17, 32), torch.randn(2, 2, 17, 32)
    cases = {
        "k: head dim": ((q, k[..., :16], v), {}),
        "k, v: batch": ((q, k[:1], v[:1]), {}),
        "v: heads and seq": ((q, k, v[:, :, :9]), {}),
        "v: heads and seq ": ((q, k, v[:, :1]), {}),
        "k: expected 4 dims": ((q, k[0], v), {}),
        "k: on meta": ((q, k.to("meta"), v), {}),
        "window_left: expected an int >= 0": ((q, k, v), {"window_left": -3}),
        "window_right: expected an int >= 0": ((q, k, v), {"window_right": 2.5}),
        "scale: expected a finite number": ((q, k, v), {"scale": float("nan")}),
        "softcap: expected a finite positive number": ((q, k, v), {"softcap": 0.0}),
    }
    for needle, (args, kwargs) in cases.items():
        with pytest.raises((ValueError, TypeError)) as error:
            m.attention(*args, **{"softcap": 20.0, **kwargs})
        assert str(error.value).startswith(needle.strip()), (needle, error.value)


@pytest.mark.parametrize("tuned", [True, False], ids=["tuned", "plain"])
def test_an_emitted_bf16_module_is_right_under_the_interpreter_without_tilegen(tmp_path, tuned):
    # bf16 is what the interpreter gets wrong unmended (dots on raw bits, truncating casts); tilegen mends it for
    # the modules it loads, and every module it writes out mends it on import.
    spec = AttentionSpec(head_dim=32, mask="causal", dtype="bf16")
    db = tmp_path / "empty.sqlite"
    TuningDB(db).close()
    module = tmp_path / "bf16_attention.py"
    result = invoke("emit", *(["--tuned", "--db", db] if tuned else []), "--spec", spec.to_json(), "-o", module)
    assert result.exit_code == 0, result.output
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=gen).bfloat16() for _ in range(3))
    torch.save((q, k, v), tmp_path / "inputs.pt")
    script = textwrap.dedent(
        """
        import sys, torch
        import bf16_attention as m
        q, k, v = torch.load("inputs.pt")
        if hasattr(m, "attention"):
            out = m.attention(q, k, v)
        else:  # the kernel's own launcher, as tilegen calls it
            out, lse = torch.full_like(q, float("nan")), torch.empty(1, 2, 40)
            big = 2**31 - 1
            m.launch(q, k, v, out, lse, scale=32 ** -0.5, softcap=0.0, window_left=big, window_right=0, block_m=16,
                     block_n=16, num_warps=4, num_stages=1)
        torch.save(out, "outputs.pt")
        assert not any(name.split(".")[0] == "tilegen" for name in sys.modules), "tilegen was imported"
        """
    )
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    environment["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = torch.load(tmp_path / "outputs.pt")
    ref, _ = attention_reference(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


def test_verify_reruns_this_machines_rows_and_drops_the_ones_that_fail(tmp_path):
    db = tmp_path / "tuning.sqlite"
    spec = AttentionSpec(head_dim=32, mask="causal", dtype="fp32")
    with TuningDB(db) as database:
        _best(database, spec, 64, 5.0, Config(32, 16, 4, 1), device=device_info())
        _best(database, spec, 128, 5.0, Config(32, 32, 4, 1), device=device_info())
        _best(database, spec, 64, 5.0, Config(64, 64, 4, 2), device=H100_DEVICE)  # another GPU: not run here
    with sqlite3.connect(db) as conn:  # an edit behind the writers' checks
        conn.execute("UPDATE tg_tuned_configs SET config_json = ? WHERE bucket = 128",
                     ('{"block_m": 48, "block_n": 32, "num_stages": 1, "num_warps": 4}',))
    result = invoke("db", "verify", "--db", db)
    assert result.exit_code == 2, result.output
    assert "1 row(s) belong to another GPU" in result.stdout
    table = result.stdout[result.stdout.index("on " + device_info().key):]
    assert re.search(r"\b64\b.*BM32-BN16-w4-s1.*\bok\b", table)
    assert re.search(r"\b128\b.*infeasible: block_m=48", table)
    assert result.stderr.startswith("error: 1 row(s) failed on this machine; delete them with")
    result = invoke("db", "verify", "--db", db, "--drop-failed")
    assert result.exit_code == 0, result.output
    with TuningDB(db) as database:
        assert sorted((r.gpu_key, r.bucket) for r in database.list_tuned()) == sorted(
            [(device_info().key, 64), (H100_DEVICE.key, 64)])


def test_verify_reports_a_decode_row_of_a_context_only_bucket_as_failed(tmp_path):
    from tilegen.families.attention_decode import DecodeConfig, DecodeSpec
    from tilegen.families.registry import get

    db = tmp_path / "tuning.sqlite"
    spec = DecodeSpec(head_dim=16, q_per_kv=2, dtype="fp32", page_size=8)
    family = get(spec.family)
    bucket = family.buckets.of((32, 4))
    with TuningDB(db) as database:
        database.record_best(spec=spec, device=device_info(), template_hash=template_hash(family),
                             triton_version=triton.__version__, bucket=bucket,
                             config=DecodeConfig(16, 4, 1, 1).to_dict(), time_ms=1.0, max_error=1e-6, trials=1)
    with sqlite3.connect(db) as conn:  # a row keyed before the batch was part of the bucket
        conn.execute("UPDATE tg_tuned_configs SET bucket = 32")
    result = invoke("db", "verify", "--db", db)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert re.search(r"\b32\b.*infeasible: bucket: 32 is not a", " ".join(result.stdout.split()))


def test_an_infinite_error_is_exported_as_standard_json_and_read_back(populated, tmp_path):
    """A trial that measured an infinite error (a NaN output) is exported as the string "Infinity": JSON has no number
    for it, and jq or a browser refuse Python's bare Infinity. Import reads both forms back as infinity."""
    with TuningDB(populated) as db:
        db.record_trial(spec=SPEC, device=CPU_INTERPRETER, **CURRENT, bucket=64, study_name="s", trial_number=3,
                        config=Config(64, 16, 4, 1).to_dict(), status="wrong", time_ms=2.0, max_error=math.inf,
                        reason="NaN in the output")
    exported = invoke("db", "--db", populated, "export", "-")
    assert exported.exit_code == 0, exported.output

    def refuse(constant):
        raise AssertionError(f"not standard JSON: {constant}")

    data = json.loads(exported.stdout, parse_constant=refuse)
    assert [t["max_error"] for t in data["trials"] if t["trial_number"] == 3] == ["Infinity"]
    bare = tmp_path / "bare.json"  # an export of an earlier tilegen, with Python's bare Infinity
    bare.write_text(exported.stdout.replace('"Infinity"', "Infinity"))
    for source, copy in ((exported.stdout, tmp_path / "a.sqlite"), (bare.read_text(), tmp_path / "b.sqlite")):
        result = runner.invoke(app, ["db", "--db", str(copy), "import", "-"], input=source)
        assert result.exit_code == 0, result.output
        with TuningDB(copy) as db:
            assert [t.max_error for t in db.trials_for(SPEC.hash) if t.trial_number == 3] == [math.inf]
