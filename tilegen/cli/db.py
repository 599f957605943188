"""``tilegen db``: look into, move, check and prune the tuning database.

``list`` and ``show`` read the user's database and the one shipped with tilegen (marked
as such), as dispatch does. Every command takes ``--db`` itself, and the group takes it
too (``tilegen db --db X list`` and ``tilegen db list --db X`` are the same); it names a
SQLite file or a database server's URL. ``pull`` copies one GPU's rows from a server into
a local file, which is what dispatch reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import triton
import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tilegen import env
from tilegen.version import __version__
from tilegen.cli.app import app, fail, check_db_path, user_db
from tilegen.db import DatabaseError, TrialRow, TunedRow, TuningDB, studies_path
from tilegen.db.exchange import check
from tilegen.db.location import is_url
from tilegen.db.validate import safe_text
from tilegen.families import ConfigError, get
from tilegen.ir import SpecError

db_app = typer.Typer(no_args_is_help=True, add_completion=False)
app.add_typer(db_app, name="db")

_DB_HELP = ("The database: a SQLite file or a server URL such as postgresql+psycopg://user@host/tilegen "
            "(default: $TILEGEN_DB, else tuning.sqlite in the user data folder).")
_DbOption = typer.Option(None, "--db", help=_DB_HELP, show_default=False)
#: The console width from which tables show every column unasked.
_WIDE_FROM = 160
_WideOption = typer.Option(
    False, "--wide", help="Every column (Triton, TFLOP/s, max error, date, provenance) however narrow the terminal; "
    f"by default a terminal under {_WIDE_FROM} columns gets the columns that fit 80, the spec hash `tilegen db show` "
    "takes always whole.",
)


class _Server(str):
    """A server URL given as ``--db``: formats with its password hidden, and always "exists"
    (whether it answers is found by opening it)."""

    def __new__(cls, url: str, option: str = "--db"):
        from tilegen.db.location import server_url, shown

        try:
            parsed = server_url(url)
        except DatabaseError as e:
            fail(f"{option}: {e}")
        self = super().__new__(cls, shown(parsed))
        self.url = url
        return self

    def exists(self) -> bool:
        return True


@db_app.callback()
def _db(ctx: typer.Context, db: Optional[str] = _DbOption) -> None:
    """The tuning database: tuned configs and the trials behind them.

    The Optuna studies of `tilegen tune` sit beside the database, in <db stem>.optuna.sqlite.

    Open them with: optuna-dashboard sqlite:///<studies file>
    """
    ctx.obj = db


def _path(ctx: typer.Context, db: str | None) -> Path | _Server:
    """The command's --db, else the group's, else $TILEGEN_DB or the user data folder."""
    chosen = db if db is not None else ctx.obj if ctx.obj is not None else user_db(target=True)
    if is_url(chosen):
        return _Server(chosen)
    chosen = Path(chosen)
    check_db_path("--db" if db is not None or ctx.obj is not None else "TILEGEN_DB", chosen)
    return chosen


def _shipped(path: Path | _Server) -> Path | None:
    """The shipped database, unless it is missing or is the file already given."""
    shipped = env.shipped_db_path()
    if isinstance(path, _Server):
        return shipped if shipped.is_file() else None
    if not shipped.is_file() or (path.exists() and path.resolve() == shipped.resolve()):
        return None
    return shipped


@db_app.command("list")
def list_(ctx: typer.Context, db: Optional[str] = _DbOption, wide: bool = _WideOption) -> None:
    """Every tuned config: one row per variant, GPU, Triton version and size bucket; the shipped ones after.

    A row of another Triton that dispatch serves, for want of a row of the installed one for its
    bucket, is marked `other Triton (served)`.
    """
    from tilegen.cli.verify import listing as _listing
    from tilegen.cli.verify import served as _served

    path = _path(ctx, db)
    console = _console()
    listings = []  # (title, listing) in the order dispatch prefers them: yours, then the shipped one
    yours = False
    if path.exists():
        with _open(path) as database:
            listing = _listing(database)
        if listing[0]:
            listings.append((str(path), listing))
            yours = True
        else:
            typer.echo(f"no tuned configs in {path}", err=True)
    else:
        typer.echo(f"no database at {path} yet (`tilegen tune` creates it)", err=True)
    shipped = _shipped(path)
    if shipped is not None:
        with _open(shipped) as database:
            title = f"shipped with tilegen (read-only, consulted after yours): {shipped}"
            listings.append((title, _listing(database)))
    served = _served([listing for _, listing in listings])
    stale = unknown = serving = 0
    for f, (title, (rows, _, _)) in enumerate(listings):
        reasons = [f"{reason} ({_SERVED})" if (f, i) in served else reason
                   for i, reason in enumerate(TuningDB.why_stale(rows))]
        console.print(_tuned_table(rows, title=title, unused=reasons, wide=wide))
        if yours and f == 0:
            serving = sum((f, i) in served for i in range(len(rows)))
            stale = sum(r is not None for r in reasons) - serving
            unknown = reasons.count("unknown family")
    if stale:
        typer.echo(f"{stale} of the tuned configs in {path} are ones dispatch here can never use (the 'unused' "
                   f"column says why: their kernel's template has changed since, or they were tuned with another "
                   f"Triton than the installed {triton.__version__} and are not served, as it has a row of its own "
                   f"or a nearer version's for their bucket, or cannot run their config); `tilegen db prune` "
                   f"deletes them"
                   + (f" (with --all, the {unknown} of families this tilegen does not know)" if unknown else ""),
                   err=True)
    if served:
        typer.echo(f"rows marked 'other Triton ({_SERVED})' were tuned with another Triton and are what dispatch "
                   f"runs on their GPU under the installed {triton.__version__}, which has no row of its own for "
                   f"their bucket; `tilegen db verify --retime` on that GPU checks and times them there and stores "
                   f"them under {triton.__version__}"
                   + (f" (`tilegen db prune` would delete the {serving} of {path})" if serving else ""),
                   err=True)


#: The mark of a row of another Triton that dispatch serves (``tilegen.db.lookup.served_rows``).
_SERVED = "served"


@db_app.command()
def show(
    ctx: typer.Context, spec_hash: str = typer.Argument(..., metavar="SPEC_HASH_OR_PREFIX"),
    db: Optional[str] = _DbOption, wide: bool = _WideOption,
) -> None:
    """One variant: its spec, its tuned configs and every trial, fastest first within a study.

    The user's database is searched first, then the shipped one.
    """
    path = _path(ctx, db)
    if not spec_hash.strip():
        fail("SPEC_HASH_OR_PREFIX: give a spec hash or its first digits; `tilegen db list` shows them")
    places = [(p, label) for p, label in ((path, str(path)), (_shipped(path), "shipped with tilegen"))
              if p is not None and p.exists()]
    if not places:
        fail(f"no tilegen database at {path} (give --db, or set TILEGEN_DB)")
    for where, label in places:
        with _open(where) as database:
            variants = database.variants(spec_hash)
            hashes = sorted({v.spec_hash for v in variants})
            if len(hashes) > 1:
                fail(f"{safe_text(repr(spec_hash))} matches {len(hashes)} specs ({', '.join(hashes)}); give more of the hash")
            if not hashes:
                continue
            tuned = [row for row in database.list_tuned() if row.spec_hash == hashes[0]]
            trials = database.trials_for(hashes[0])
        console = _console()
        console.print(f"[bold]from {_markup(label)}[/bold]" + (f": {_markup(where)}" if label != str(where) else ""))
        for variant in variants:
            console.print(f"[bold]{_markup(variant.name)}[/bold]  spec {_markup(variant.spec_hash)}  "
                          f"template {_markup(variant.template_hash)}")
            try:
                # Re-written from the parsed JSON, so no string in it reaches the terminal unescaped.
                console.print_json(json.dumps(json.loads(variant.spec_json), ensure_ascii=True))
            except (ValueError, RecursionError):  # a family this tilegen does not know wrote it
                console.print(_cell(variant.spec_json, 2000))
        console.print(_tuned_table(tuned, title="tuned", wide=wide) if tuned else "no tuned configs")
        console.print(_trials_table(trials, wide=wide) if trials else "no trials")
        return
    fail(f"no variant with spec hash {safe_text(repr(spec_hash))} in {' or '.join(str(p) for p, _ in places)}; "
         f"`tilegen db list` shows them")


@db_app.command("export")
def export(
    ctx: typer.Context, file: Path = typer.Argument(..., metavar="FILE.json"), db: Optional[str] = _DbOption,
) -> None:
    """Write the whole database as JSON (`tilegen db import` reads it back, on any machine); FILE.json `-` writes
    it to stdout."""
    path = _path(ctx, db)
    _need(path)
    to_stdout = str(file) == "-"
    if not to_stdout and not isinstance(path, _Server) and file.exists():
        # Written over, the database (or the studies beside it) would be JSON, and every later command refuse it.
        for kept in (path, studies_path(path)):
            if kept.exists() and file.resolve() == kept.resolve():
                fail(f"FILE.json: {file} is the database's own file ({kept}); export to another path")
    with _open(path) as database:
        data = database.export_json()
    if to_stdout:
        typer.echo(json.dumps(data, indent=1))
    else:
        with _errors(f"FILE.json: cannot write {file}"):
            file.write_text(json.dumps(data, indent=1) + "\n")
    typer.echo(f"exported {len(data['tuned'])} tuned configs and {len(data['trials'])} trials to "
               f"{'stdout' if to_stdout else file}", err=True)


@db_app.command("import")
def import_(
    ctx: typer.Context, file: Path = typer.Argument(..., metavar="FILE.json"), db: Optional[str] = _DbOption,
    skip_bad: bool = typer.Option(
        False, "--skip-bad", help="Leave out rows that fail the checks (a config the kernel cannot run, a time that "
        "is not positive, a bucket its family never gives) and import the rest; by default one such row refuses "
        "the whole file.",
    ),
    replace: bool = typer.Option(
        False, "--replace", help="The file's rows win whatever their times (of its own rows for one bucket, the "
        "fastest), and each study it holds trials of replaces the stored one: for a re-tune measured another way, "
        "whose times do not compare with those here.",
    ),
) -> None:
    """Merge an export in (FILE.json `-` reads stdin): per bucket the faster config wins; trials already here
    are kept (both unless --replace).

    Every row is checked first and marked as imported (`tilegen db verify` re-runs it here). Trials are filed
    under their study's name followed by "-imported", which no tune writes to: an import made while a tune of
    the same variant runs takes none of the trial numbers it hands out.
    """
    path = _path(ctx, db)
    with _errors(f"FILE.json: cannot read {file}"):
        # `-` reads stdin, as export writes stdout: `tilegen db export - --db a | tilegen db import - --db b`.
        raw = sys.stdin.buffer.read() if str(file) == "-" else file.read_bytes()
    try:
        data = json.loads(raw)
    except RecursionError:
        fail(f"FILE.json: {file} is nested too deeply to be a tilegen export")
    except ValueError as e:  # not JSON, not UTF-8, or an integer of thousands of digits
        fail(f"FILE.json: {file} is not JSON ({safe_text(e)}); give a file written by `tilegen db export`")
    # Checked before the database opens, which creates a missing one and upgrades an older one: a refused file
    # leaves neither behind.
    with _errors():
        check(data, skip_bad=skip_bad)
    with _open(path, write=True) as database, _errors():
        count = database.import_json(data, skip_bad=skip_bad, replace=replace)
        skipped = database.skipped
    for line in skipped:
        typer.echo(f"skipped {safe_text(line, 400)}", err=True)
    typer.echo(f"imported {count} rows from {'stdin' if str(file) == '-' else file} into {path}", err=True)


@db_app.command()
def prune(
    ctx: typer.Context,
    triton: Optional[str] = typer.Option(
        None, help="Triton version to keep, exactly as `tilegen db list` shows it (default: the installed one)."
    ),
    tilegen: Optional[str] = typer.Option(
        None, help="Keep only the tuned configs of this tilegen version, exactly (default: every version)."
    ),
    all_families: bool = typer.Option(
        False, "--all", help="Also prune rows of kernel families this tilegen does not know (kept by default: "
        "a newer tilegen may have written them).",
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking."),
    db: Optional[str] = _DbOption,
) -> None:
    """Delete tuned configs and trials that dispatch can no longer use (other Triton, changed template).

    Says what it will delete and asks first (or takes --yes).
    """
    path = _path(ctx, db)
    _need(path)
    with _open(path, write=True) as database:
        tritons, tilegens = database.versions()
        # Versions match exactly, so a near miss ("3.6" for "3.6.0") would keep nothing: refuse it.
        for option, value, present in (("--triton", triton, tritons), ("--tilegen", tilegen, tilegens)):
            if value is not None and value not in present:
                fail(f"{option}: no row of {path} has version {value!r}; versions there: "
                     f"{', '.join(sorted(present)) or 'none'} (versions match exactly)")
        arguments = dict(keep_triton=triton, keep_tilegen=tilegen, all_families=all_families)
        tuned, trials = database.prune(**arguments, dry_run=True)
        if not tuned and not trials:
            unknown, unknown_trials = ([], 0) if all_families else database.prune(
                **{**arguments, "all_families": True}, dry_run=True)
            typer.echo(f"nothing matched: {len(unknown)} tuned config(s) and {unknown_trials} trial(s) of {path} are "
                       "of kernel families this tilegen does not know, kept (--all deletes them); the other rows are "
                       "ones dispatch can use" if unknown or unknown_trials else
                       f"nothing matched: every row of {path} is one dispatch can use", err=True)
            return
        if tuned:
            _console().print(_tuned_table(tuned, title=f"tuned configs to delete from {path}"))
        typer.echo(f"prune would delete {len(tuned)} tuned configs and {trials} trials from {path}", err=True)
        if not yes:
            if not sys.stdin.isatty():
                fail("prune: not deleting without confirmation; run it in a terminal, or pass --yes")
            if not typer.confirm("Delete them?", default=False, err=True):
                typer.echo("nothing deleted", err=True)
                return
        count = database.prune(**arguments)
    typer.echo(f"pruned {count} rows from {path}", err=True)


@db_app.command()
def pull(
    ctx: typer.Context,
    source: str = typer.Option(
        ..., "--from", metavar="URL", help="The database server to copy from (postgresql+psycopg://user@host/db).",
    ),
    gpu: Optional[str] = typer.Option(
        None, help="GPU key of the rows to copy, as `tilegen db list` shows it (default: this machine's; any: all).",
    ),
    triton: Optional[str] = typer.Option(None, help="Triton version (default: the installed one; any: all)."),
    tilegen_version: Optional[str] = typer.Option(
        None, "--tilegen", help="tilegen version of the tuned rows (default: this one; any: all).",
    ),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Leave out rows that fail the import checks."),
    db: Optional[str] = _DbOption,
) -> None:
    """Copy tuned rows (and their trials) for one GPU, Triton and tilegen version from a server into a local
    SQLite file, the one dispatch reads (default: yours).

    Rows are checked as `tilegen db import` checks them and marked as pulled; per bucket the
    faster config wins. Inference never talks to the server: it reads the file.
    """
    import triton as triton_module

    from tilegen.device import device_info

    if not is_url(source):
        fail(f"--from: {source!r} is not a server URL; give one such as postgresql+psycopg://user@host/tilegen "
             f"(a JSON export goes in with tilegen db import)")
    server = _Server(source, "--from")
    target = _path(ctx, db)
    if isinstance(target, _Server):
        fail("--db: pull writes a local SQLite file, the one dispatch reads; give a file path (default: yours)")
    wanted = {
        "gpu_key": gpu if gpu is not None else device_info().key,
        "triton_version": triton if triton is not None else triton_module.__version__,
        "tilegen_version": tilegen_version if tilegen_version is not None else __version__,
    }
    filters = {name: None if value == "any" else value for name, value in wanted.items()}
    with _open(server, option="--from") as source_db:
        data = source_db.export_json(**filters)
        if not data["tuned"]:
            rows = source_db.list_tuned()
            there = "; ".join(f"{what} there: {', '.join(sorted({getattr(r, field) for r in rows})) or 'none'}"
                              for what, field in (("GPUs", "gpu_key"), ("Tritons", "triton_version"),
                                                  ("tilegen versions", "tilegen_version")))
            fail(f"--from: no tuned row of {server} has GPU {wanted['gpu_key']}, Triton {wanted['triton_version']} "
                 f"and tilegen {wanted['tilegen_version']} ({there}); choose with --gpu, --triton and --tilegen")
    with _open(target, write=True) as database, _errors():
        count = database.import_json(data, skip_bad=skip_bad, provenance="pulled")
        skipped = database.skipped
    for line in skipped:
        typer.echo(f"skipped {safe_text(line, 400)}", err=True)
    typer.echo(f"pulled {len(data['tuned'])} tuned configs and {len(data['trials'])} trials from {server} into "
               f"{target} ({count} rows new or faster)", err=True)


@db_app.command()
def verify(
    ctx: typer.Context,
    spec_hash: str = typer.Argument("", metavar="SPEC_HASH_OR_PREFIX", help="Only this variant (default: all)."),
    shipped: bool = typer.Option(False, "--shipped", help="Verify the database shipped with tilegen instead."),
    seed: int = typer.Option(0, help="Seed of the random inputs."),
    timeout: float = typer.Option(300.0, help="Seconds one row may take (compilation included)."),
    drop_failed: bool = typer.Option(False, "--drop-failed", help="Delete the rows that fail."),
    retime: bool = typer.Option(
        False, "--retime", help="Instead: time on this GPU the rows of another Triton that dispatch serves here "
        "(`other Triton (served)` in `tilegen db list`), from your database and the shipped one, and store each "
        "that gives the right answer in yours under the installed Triton. Needs a CUDA GPU.",
    ),
    score_mod: Optional[str] = typer.Option(
        None, help="The score mod (pkg.module:attr, as `tilegen tune --score-mod` took it) of the rows of a spec "
        "with mods to run: a trial needs its function. Rows of specs with other mods, or mods not named, are not run.",
    ),
    mask_mod: Optional[str] = typer.Option(None, help="The mask mod, as --score-mod."),
    db: Optional[str] = _DbOption,
) -> None:
    """Re-run tuned rows on this machine against the family's reference: does each config compile, run and
    give the right answer here, and how fast is it?

    Only rows of this GPU, this Triton and the current template can run here (those are the rows
    dispatch reads as this Triton's); the rest are counted and left alone. With --retime, the rows of
    another Triton that dispatch serves on this GPU for want of the installed one's are checked and
    timed here and stored under the installed Triton, each as soon as it is timed.
    """
    from tilegen.cli.spec_args import mod_texts
    from tilegen.cli.verify import gpu_available, retime_rows, verify_rows
    from tilegen.mods.sources import export

    mods = mod_texts(score_mod, mask_mod)
    if mods:  # the trials run in the worker process, which builds the mods from their paths (as a tune's do)
        export({kind: path for kind, path in (("score_mod", score_mod), ("mask_mod", mask_mod)) if path})
    # The worker's wait takes at most threading.TIMEOUT_MAX seconds; past it, an OverflowError mid-verify.
    if not 0 < timeout <= threading.TIMEOUT_MAX:
        fail(f"--timeout: expected a positive number of seconds up to {threading.TIMEOUT_MAX:g}, got {timeout:g}")
    if not 0 <= seed < 2**32:
        fail(f"--seed: expected an integer from 0 to {2**32 - 1}, got {seed}")
    if shipped and drop_failed:
        fail("--drop-failed: the shipped database is read-only; drop rows from your own database")
    if retime:
        if shipped:
            fail("--retime: re-timed rows are stored in your database (--db), and the shipped rows are read with "
                 "it; leave out --shipped")
        if drop_failed:
            fail("--drop-failed: not with --retime, which stores the rows that pass and leaves the rest as they are")
        if not gpu_available():
            fail("--retime: needs a CUDA GPU (torch.cuda.is_available() is False): a row is timed on the GPU "
                 "that serves it, and the CPU interpreter's times say nothing of one; nothing was stored")
        path = _path(ctx, db)
        other = _shipped(path)
        with _open(path, write=True) as database, \
                (_open(other) if other is not None else contextlib.nullcontext()) as shipped_db:
            stored, failed = retime_rows(database, shipped_db, spec_hash, seed=seed, timeout=timeout,
                                         console=_console(), mods=mods)
        typer.echo(f"stored {stored} re-timed row(s) in {path} under Triton {triton.__version__}", err=True)
        if failed:
            fail(f"{failed} row(s) of another Triton failed on this machine and were not stored; dispatch serves "
                 f"them still, until a row of Triton {triton.__version__} replaces them (`tilegen tune` tunes "
                 f"their buckets here)")
        return
    path = env.shipped_db_path() if shipped else _path(ctx, db)
    _need(path)
    with _open(path, write=drop_failed) as database:
        if spec_hash and not database.variants(spec_hash):
            fail(f"no variant with spec hash {safe_text(repr(spec_hash))} in {path}; `tilegen db list` shows them")
        failed = verify_rows(database, spec_hash, seed=seed, timeout=timeout, console=_console(),
                             drop_failed=drop_failed, mods=mods)
    if failed and not drop_failed:
        fail(f"{failed} row(s) failed on this machine; delete them with: tilegen db verify --db {path} --drop-failed"
             + (f" {spec_hash}" if spec_hash else ""))


def _need(path: Path | _Server) -> None:
    if not path.exists():
        fail(f"no tilegen database at {path} (give --db, or set TILEGEN_DB)")


@contextlib.contextmanager
def _errors(prefix: str = "", *, option: str = "") -> Iterator[None]:
    """A database, file or JSON problem the user can fix ends in one line and exit code 2; ``option``
    names the argument that gave a server, whose messages do not name a file."""
    try:
        yield
    except OSError as e:
        fail(f"{prefix}: {e.strerror or e}" if prefix else str(e))
    except (DatabaseError, ValueError) as e:
        fail(f"{option}: {e}" if option else str(e))


@contextlib.contextmanager
def _open(path: Path | _Server, *, write: bool = False, option: str = "--db") -> Iterator[TuningDB]:
    if isinstance(path, _Server):
        # A server is opened writable, which upgrades an older schema there as on a file.
        with _errors(option=option):
            database = TuningDB(path.url)
        with _errors(option=option), database:
            yield database
            _report_refused(database)
        return
    with _errors():
        # Reading a file this user cannot write (the shipped one, say) opens it read-only;
        # anything else opens writable, which also upgrades an older schema.
        writable = path.exists() and os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)
        readonly = not write and (not writable or path.resolve() == env.shipped_db_path().resolve())
        database = TuningDB(path, readonly=readonly)
    with _errors(), database:
        yield database
        _report_refused(database)


def _report_refused(database: TuningDB) -> None:
    """One line per stored row the reads left out (``tilegen.db.validate`` refused it); every command
    says so as it closes the database."""
    for row in database.take_refused():
        typer.echo(f"skipped {safe_text(row, 400)}", err=True)


def _console() -> Console:
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 200  # piped or captured: no terminal width to fit, so do not cut hashes short
    return console


def _markup(value: object) -> str:
    """Text from a database or a file, for a console string that holds markup of ours: controls shown
    escaped, rich's markup escaped."""
    return escape(safe_text(value))


def _cell(value: object, limit: int = 200) -> Text:
    """A table cell from a database or a file: plain text (never markup), controls shown escaped."""
    return Text(safe_text(value, limit))


def _config_text(row: TunedRow | TrialRow) -> str:
    """The family's short label for a config; its JSON when the family or the knobs are unknown here."""
    try:
        return str(get(row.family).config_type.from_dict(row.config))
    except (ConfigError, SpecError):
        return json.dumps(row.config, sort_keys=True)


def _bucket_text(row: TunedRow | TrialRow) -> str:
    """The family's reading of a bucket (decode's packed one as "4096 ctx x 64 seqs"); the number when the
    family is unknown here."""
    try:
        return get(row.family).buckets.label(row.bucket)
    except SpecError:
        return str(row.bucket)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


#: Columns of the tables, each with what it shows of a row; the wide ones only with --wide. At 80
#: columns the narrow ones fit with the spec hash (16 digits, never cut) and a config whole.
_TUNED_COLUMNS = {
    "variant": (False, lambda row: row.variant_name), "spec hash": (False, lambda row: row.spec_hash),
    "GPU": (False, lambda row: row.gpu_key), "Triton": (True, lambda row: row.triton_version),
    "bucket": (False, _bucket_text), "config": (False, _config_text),
    "time ms": (False, lambda row: _number(row.time_ms, ".4f")), "TFLOP/s": (True, lambda row: _number(row.tflops, ".1f")),
    "max err": (True, lambda row: _number(row.max_error, ".2e")),
    "date": (True, lambda row: row.created_at.strftime("%Y-%m-%d %H:%M")), "from": (True, lambda row: row.provenance),
}
_TRIAL_COLUMNS = {
    "study": (True, lambda row: row.study_name), "#": (False, lambda row: str(row.trial_number)),
    "GPU": (True, lambda row: row.gpu_key), "bucket": (False, _bucket_text), "config": (False, _config_text),
    "status": (False, lambda row: row.status), "time ms": (False, lambda row: _number(row.time_ms, ".4f")),
    "max err": (True, lambda row: _number(row.max_error, ".2e")), "reason": (False, lambda row: row.reason or ""),
}
#: Widths below which a column's words would break letter by letter.
_MIN_WIDTH = {"spec hash": 16, "variant": 10, "GPU": 8, "bucket": 6, "config": 10, "status": 6, "reason": 12, "unused": 8}
_RIGHT = ("bucket", "time ms", "TFLOP/s", "max err", "#")


def _table(title: str, columns: dict[str, Any], rows: list[Any], wide: bool, extra: dict[str, list[str]]) -> Table:
    """``rows`` as a table of ``columns`` (all with ``wide``, else the narrow ones), then ``extra`` columns
    (name: a value per row). Cells are plain text; only the spec hash and numbers never wrap."""
    wide = wide or _console().width >= _WIDE_FROM
    shown = {name: show for name, (is_wide, show) in columns.items() if wide or not is_wide}
    # No vertical rules unless wide: at 80 columns every character goes to the cells.
    table = Table(title=_markup(title), box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1) if wide else (0, 0))
    for name in [*shown, *extra]:
        keep = name in ("spec hash", "#", "time ms", "TFLOP/s", "max err", "date")
        table.add_column(name, justify="right" if name in _RIGHT else "left", no_wrap=keep,
                         min_width=_MIN_WIDTH.get(name), overflow="fold")
    for i, row in enumerate(rows):
        table.add_row(*(_cell(show(row)) for show in shown.values()), *(_cell(values[i]) for values in extra.values()))
    return table


def _tuned_table(rows: list[TunedRow], *, title: str, unused: list[str | None] | None = None,
                 wide: bool = False) -> Table:
    """The rows as a table; with ``unused`` (``TuningDB.why_stale`` of the rows), a last column says
    why dispatch here can never use a row (empty for the rows it can)."""
    extra = {"unused": [reason or "" for reason in unused]} if unused is not None else {}
    return _table(title, _TUNED_COLUMNS, rows, wide, extra)


def _trials_table(rows: list[TrialRow], *, wide: bool = False) -> Table:
    # Within a study, fastest first and failures last: the top rows say why the winner won.
    ordered = sorted(rows, key=lambda r: (r.study_name, r.time_ms is None, r.time_ms or 0.0, r.trial_number))
    return _table("trials", _TRIAL_COLUMNS, ordered, wide, {})
