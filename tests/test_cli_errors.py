"""Every command, given bad paths, numbers or files, ends in one line ``error: ...`` and exit status 2.

Each case runs ``tilegen.cli.main`` (what the ``tilegen`` script runs) in this process and
checks stderr: exactly one line, starting ``error:``, naming the argument, no traceback.
"""

from __future__ import annotations

import json
import os

import pytest

from tilegen.cli import main
from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB
from tilegen.device import CPU_INTERPRETER
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import AttentionSpec, Config

SPEC = AttentionSpec(head_dim=64, mask="causal", dtype="bf16")

# Each case: the arguments ({tmp}, {db}, {corrupt}, {bad_row} are filled in) and what the line names.
CASES = {
    "emit-output-in-missing-folder": (["emit", "-o", "{tmp}/missing/dir/x.py"], "-o: the folder"),
    "emit-output-is-a-folder": (["emit", "-o", "{tmp}"], "-o: {tmp} is a folder"),
    "emit-head-dim-not-a-number": (["emit", "--head-dim", "abc"], "'--head-dim'"),
    "emit-head-dim-unsupported": (["emit", "--head-dim", "65"], "--head-dim"),
    "emit-spec-missing-file": (["emit", "--spec", "{tmp}/nope.json"], "--spec"),
    "emit-spec-not-json": (["emit", "--spec", "{{oops"], "--spec"),
    "emit-spec-empty": (["emit", "--spec", ""], "--spec: empty; expected a spec's JSON object or the path"),
    "emit-unknown-preset": (["emit", "--preset", "nope"], "unknown preset 'nope'"),
    "emit-preset-empty": (["emit", "--preset", ""], "--preset: unknown preset ''"),
    "tune-preset-empty": (["tune", "--preset", "", "--trials", "1", "--db", "{tmp}/t.sqlite"],
                          "--preset: unknown preset ''"),
    "emit-db-without-tuned": (["emit", "--db", "{db}"], "--db: read only with --tuned"),
    "emit-tuned-db-missing": (["emit", "--tuned", "--db", "{tmp}/missing.sqlite"], "no tilegen database at"),
    "emit-tuned-db-is-a-folder": (["emit", "--tuned", "--db", "{tmp}"], "--db: {tmp} is a folder"),
    "emit-tuned-db-corrupt": (["emit", "--tuned", "--db", "{corrupt}"], "not a tilegen database / corrupt"),
    "emit-unknown-option": (["emit", "--bogus"], "No such option: --bogus"),
    "emit-flag-without-head-dim": (["emit", "--mask", "causal"], "--mask: taken only with --head-dim"),
    "emit-flag-beside-a-preset": (["emit", "--preset", "merge-d128", "--no-lse"], "--lse: taken only with --head-dim"),
    "emit-spec-inline-list": (["emit", "--spec", "[]"], "--spec: spec: expected a JSON object"),
    "tune-heartbeat-past-the-thread-wait": (["tune", "--heartbeat", "9223372037", "--db", "{tmp}/t.sqlite"],
                                            "--heartbeat: expected a positive whole number of seconds up to"),
    "tune-huge-size": (["tune", "--seqlens", "99999999999999999999"], "--seqlens: 99999999999999999999 is too large"),
    "tune-size-past-the-largest-bucket": (["tune", "--sizes", "1073741825", "--trials", "1", "--db", "{tmp}/t.sqlite"],
                                          "--sizes: attention_fwd files these sizes in bucket 2147483648"),
    "tune-size-not-a-number": (["tune", "--seqlens", "abc"], "--seqlens"),
    "tune-size-zero": (["tune", "--sizes", "0"], "--sizes/--seqlens: expected comma-separated positive integers"),
    "tune-trials-zero": (["tune", "--trials", "0"], "--trials: expected a positive integer"),
    "tune-trials-not-a-number": (["tune", "--trials", "abc"], "'--trials'"),
    "tune-timeout-negative": (["tune", "--timeout", "-1"], "--timeout: expected a positive number"),
    "tune-timeout-nan": (["tune", "--timeout", "nan"], "--timeout: expected a positive number"),
    "tune-seed-negative": (["tune", "--seed", "-1"], "--seed: expected an integer from 0"),
    "tune-seed-huge": (["tune", "--seed", "99999999999999999999"], "--seed"),
    "tune-unknown-sampler": (["tune", "--sampler", "random"], "--sampler"),
    "tune-flag-beside-presets": (["tune", "--preset", "default,mha-d128", "--softcap"],
                                 "--softcap: taken only with --head-dim"),
    "tune-db-is-a-folder": (["tune", "--db", "{tmp}"], "--db: {tmp} is a folder"),
    "tune-db-corrupt": (["tune", "--db", "{corrupt}"], "not a tilegen database / corrupt"),
    "tune-spec-missing-file": (["tune", "--spec", "{tmp}/nope.json"], "--spec"),
    "db-list-db-is-a-folder": (["db", "list", "--db", "{tmp}"], "--db: {tmp} is a folder"),
    "db-list-db-corrupt": (["db", "list", "--db", "{corrupt}"], "not a tilegen database / corrupt"),
    "db-show-unknown-hash": (["db", "show", "ffffffff", "--db", "{db}"], "no variant with spec hash 'ffffffff'"),
    "db-show-empty-hash": (["db", "show", "", "--db", "{db}"], "SPEC_HASH_OR_PREFIX"),
    "db-export-db-missing": (["db", "export", "{tmp}/x.json", "--db", "{tmp}/missing.sqlite"], "no tilegen database"),
    "db-export-to-missing-folder": (["db", "export", "{tmp}/missing/x.json", "--db", "{db}"], "FILE.json: cannot write"),
    "db-import-missing-file": (["db", "import", "{tmp}/nope.json", "--db", "{db}"], "FILE.json: cannot read"),
    "db-import-a-folder": (["db", "import", "{tmp}", "--db", "{db}"], "FILE.json: cannot read"),
    "db-import-not-json": (["db", "import", "{corrupt}", "--db", "{db}"], "is not JSON"),
    "db-import-bad-row": (["db", "import", "{bad_row}", "--db", "{db}"], "refused tilegen export: tuned[0]"),
    "db-prune-near-version": (["db", "prune", "--triton", "3.6", "--db", "{db}"], "--triton: no row of"),
    "db-prune-unconfirmed": (["db", "prune", "--db", "{db}"], "pass --yes"),
    "db-prune-db-missing": (["db", "prune", "--db", "{tmp}/missing.sqlite"], "no tilegen database"),
    "db-verify-timeout-zero": (["db", "verify", "--timeout", "0", "--db", "{db}"], "--timeout"),
    "db-verify-timeout-nan": (["db", "verify", "--timeout", "nan", "--db", "{db}"], "--timeout"),
    "db-verify-timeout-past-the-wait": (["db", "verify", "--timeout", "1e10", "--db", "{db}"], "--timeout"),
    "db-verify-seed-negative": (["db", "verify", "--seed", "-3", "--db", "{db}"], "--seed"),
    "db-verify-drop-shipped": (["db", "verify", "--shipped", "--drop-failed"], "--drop-failed"),
    "db-verify-unknown-prefix": (["db", "verify", "ffff", "--db", "{db}"], "no variant with spec hash 'ffff' in {db}"),
    "db-unknown-command": (["db", "frobnicate"], "No such command"),
    "emit-spec-huge-integer": (["emit", "--spec", "{tmp}/huge.json"], "--spec: Exceeds the limit"),
    "emit-spec-nested-deep": (["emit", "--spec", "{tmp}/deep.json"], "--spec: nested too deeply"),
    "emit-spec-not-utf8": (["emit", "--spec", "{tmp}/latin1.json"], "--spec: 'utf-8' codec"),
    "tune-spec-huge-integer": (["tune", "--spec", "{tmp}/huge.json"], "--spec: Exceeds the limit"),
    "tune-spec-nested-deep": (["tune", "--spec", "{tmp}/deep.json"], "--spec: nested too deeply"),
    "tune-spec-not-utf8": (["tune", "--spec", "{tmp}/latin1.json"], "--spec: 'utf-8' codec"),
}


@pytest.fixture
def paths(tmp_path):
    db = tmp_path / "tuning.sqlite"
    with TuningDB(db) as database:
        database.record_best(
            spec=SPEC, device=CPU_INTERPRETER, template_hash=template_hash(ATTENTION_FWD),
            triton_version="0.0-old", bucket=64, config=Config(32, 32, 4, 1).to_dict(), time_ms=1.0,
            max_error=0.0, trials=1,
        )
        export = database.export_json()
    export["tuned"][0]["config"]["block_m"] = 48
    (tmp_path / "bad_row.json").write_text(json.dumps(export))
    (tmp_path / "corrupt.sqlite").write_bytes(os.urandom(4096))
    (tmp_path / "huge.json").write_text('{"family": "attention_fwd", "head_dim": ' + "9" * 5001 + "}")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "latin1.json").write_bytes('{"family": "attention_fwd", "dtype": "bf16\xff"}'.encode("latin-1"))
    return {"tmp": str(tmp_path), "db": str(db), "corrupt": str(tmp_path / "corrupt.sqlite"),
            "bad_row": str(tmp_path / "bad_row.json")}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_ends_in_one_error_line_and_exit_status_2(case, paths, capsys):
    args, needle = CASES[case]
    with pytest.raises(SystemExit) as exit:
        main([a.format(**paths) for a in args])
    captured = capsys.readouterr()
    assert exit.value.code == 2, captured.err
    last = captured.err.splitlines()[-1] if captured.err else ""
    assert last.startswith("error: ") and needle.format(**paths) in last, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert all(not line.startswith("error") for line in captured.err.splitlines()[:-1])


@pytest.mark.parametrize("args", [["db", "list"], ["tune", "--trials", "1", "--sizes", "16"]], ids=["db", "tune"])
def test_a_folder_in_tilegen_db_is_named_as_the_variable(args, tmp_path, monkeypatch, capsys):
    """The user passed no --db: the error names where the folder came from (tune's before anything is measured)."""
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path))
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: TILEGEN_DB: {tmp_path} is a folder")


@pytest.mark.parametrize("args", [["db", "list"], ["db", "export", "-"], ["tune", "--trials", "1", "--sizes", "16"],
                                  ["emit", "--tuned"]], ids=["db-list", "db-export", "tune", "emit"])
def test_a_tilegen_db_in_the_home_of_no_such_user_is_named_as_the_variable(args, monkeypatch, capsys):
    """``~name/...`` of a user unknown here names no path: one line naming the variable, not a traceback."""
    monkeypatch.setenv("TILEGEN_DB", "~no-such-user-here/tuning.sqlite")
    with pytest.raises(SystemExit) as exit:
        main(args)
    captured = capsys.readouterr()
    assert exit.value.code == 2, captured.err
    assert captured.err.splitlines()[-1] == ("error: TILEGEN_DB: ~no-such-user-here/tuning.sqlite: no user's home "
                                            "folder to expand its '~' into"), captured.err


@pytest.mark.parametrize("which", ["corrupt", "tmp"], ids=["corrupt-file", "folder"])
def test_emit_tuned_reads_tilegen_db_as_it_reads_db(which, paths, monkeypatch, capsys):
    """The module is baked from the user's rows: a TILEGEN_DB that cannot be read ends the command, as --db does,
    rather than a warning over a module without them."""
    monkeypatch.setenv("TILEGEN_DB", paths[which])
    with pytest.raises(SystemExit) as exit:
        main(["emit", "--tuned", "--head-dim", "64"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.splitlines()) == 1, err
    assert ("not a tilegen database / corrupt" if which == "corrupt" else "TILEGEN_DB: ") in err


def test_an_empty_database_file_is_one_with_no_rows(tmp_path, monkeypatch, capsys):
    """A new, empty file (tune and db create their tables in it): dispatch reads no rows from it without a warning,
    and emit --tuned bakes the shipped rows."""
    import warnings

    from tilegen import dispatch
    from tilegen.device import device_info
    from tilegen.families.attention_fwd import AttentionSpec

    empty = tmp_path / "empty.sqlite"
    empty.touch()
    monkeypatch.setenv("TILEGEN_DB", str(empty))
    dispatch.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = dispatch.table_for(AttentionSpec(head_dim=64, dtype="fp32"), device_info()).choose(64)
    assert choice.source == "default"
    main(["emit", "--tuned", "--head-dim", "64", "--db", str(empty)])
    assert "def attention(" in capsys.readouterr().out
    assert empty.stat().st_size == 0  # nothing written into it
