"""``tilegen db``: look into, move and prune the tuning database."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table

from tilegen import env
from tilegen.cli import app
from tilegen.db import DatabaseError, TrialRow, TunedRow, TuningDB
from tilegen.families import ConfigError, get
from tilegen.ir import SpecError

db_app = typer.Typer(no_args_is_help=True, add_completion=False)
app.add_typer(db_app, name="db")


@db_app.callback()
def _db(
    ctx: typer.Context,
    db: Optional[Path] = typer.Option(
        None, "--db", help="The database file (default: $TILEGEN_DB, else tuning.sqlite in the user data folder).",
        show_default=False,
    ),
) -> None:
    """The tuning database: tuned configs and the trials behind them.

    The Optuna studies of `tilegen tune` sit beside the database, in <db stem>.optuna.sqlite.

    Open them with: optuna-dashboard sqlite:///<studies file>
    """
    ctx.obj = db if db is not None else env.db_path()


@db_app.command("list")
def list_(ctx: typer.Context) -> None:
    """Every tuned config: one row per variant, GPU, Triton version and sequence-length bucket."""
    with _open(ctx) as db:
        rows = db.list_tuned()
    if not rows:
        typer.echo(f"no tuned configs in {ctx.obj}", err=True)
        return
    _console().print(_tuned_table(rows, title=str(ctx.obj)))


@db_app.command()
def show(ctx: typer.Context, spec_hash: str = typer.Argument(..., metavar="SPEC_HASH_OR_PREFIX")) -> None:
    """One variant: its spec, its tuned configs and every trial, fastest first within a study."""
    with _open(ctx) as db:
        variants = db.variants(spec_hash) if spec_hash else []
        hashes = sorted({v.spec_hash for v in variants})
        if not hashes:
            _fail(f"no variant with spec hash {spec_hash!r} in {ctx.obj}; `tilegen db list` shows them")
        if len(hashes) > 1:
            _fail(f"{spec_hash!r} matches {len(hashes)} specs ({', '.join(hashes)}); give more of the hash")
        tuned = [row for row in db.list_tuned() if row.spec_hash == hashes[0]]
        trials = db.trials_for(hashes[0])
    console = _console()
    for variant in variants:
        console.print(f"[bold]{variant.name}[/bold]  spec {variant.spec_hash}  template {variant.template_hash}")
        console.print_json(variant.spec_json)
    console.print(_tuned_table(tuned, title="tuned") if tuned else "no tuned configs")
    console.print(_trials_table(trials) if trials else "no trials")


@db_app.command("export")
def export(ctx: typer.Context, file: Path = typer.Argument(..., metavar="FILE.json")) -> None:
    """Write the whole database as JSON (`tilegen db import` reads it back, on any machine)."""
    with _open(ctx) as db:
        data = db.export_json()
    with _errors():
        file.write_text(json.dumps(data, indent=1) + "\n")
    typer.echo(f"exported {len(data['tuned'])} tuned configs and {len(data['trials'])} trials to {file}", err=True)


@db_app.command("import")
def import_(ctx: typer.Context, file: Path = typer.Argument(..., metavar="FILE.json")) -> None:
    """Merge an export in: per bucket the faster config wins; trials already here are kept."""
    with _errors():
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not JSON: {e}") from None
    with _open(ctx, write=True, create=True) as db, _errors():
        count = db.import_json(data)
    typer.echo(f"imported {count} rows from {file} into {ctx.obj}", err=True)


@db_app.command()
def prune(
    ctx: typer.Context,
    triton: Optional[str] = typer.Option(None, help="Triton version to keep (default: the installed one)."),
    tilegen: Optional[str] = typer.Option(
        None, help="Keep only the tuned configs of this tilegen version (default: every version)."
    ),
    all_families: bool = typer.Option(
        False, "--all", help="Also prune rows of kernel families this tilegen does not know (kept by default: "
        "a newer tilegen may have written them).",
    ),
) -> None:
    """Delete tuned configs and trials that dispatch can no longer use (other Triton, changed template)."""
    with _open(ctx, write=True) as db:
        count = db.prune(keep_triton=triton, keep_tilegen=tilegen, all_families=all_families)
    typer.echo(f"pruned {count} rows from {ctx.obj}", err=True)


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """A database, file or JSON problem the user can fix ends in one line and exit code 1."""
    try:
        yield
    except (DatabaseError, OSError, ValueError) as e:
        _fail(str(e))


@contextlib.contextmanager
def _open(ctx: typer.Context, *, write: bool = False, create: bool = False) -> Iterator[TuningDB]:
    path: Path = ctx.obj
    with _errors():
        if not create and not path.exists():
            raise DatabaseError(f"no tilegen database at {path} (give --db, or set TILEGEN_DB)")
        # Reading a file this user cannot write (the shipped one, say) opens it read-only;
        # anything else opens writable, which also upgrades an older schema.
        writable = os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)
        db = TuningDB(path, readonly=not (write or create or writable))
    with _errors(), db:
        yield db


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _console() -> Console:
    console = Console()
    if not console.is_terminal:
        console.width = 200  # piped or captured: no terminal width to fit, so do not cut hashes short
    return console


def _config_text(row: TunedRow | TrialRow) -> str:
    """The family's short label for a config; its JSON when the family or the knobs are unknown here."""
    try:
        return str(get(row.family).config_type.from_dict(row.config))
    except (ConfigError, SpecError):
        return json.dumps(row.config, sort_keys=True)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _tuned_table(rows: list[TunedRow], *, title: str) -> Table:
    table = Table(title=title)
    for name in ("variant", "spec hash", "GPU", "Triton", "bucket", "config", "time ms", "TFLOP/s", "max err", "date"):
        table.add_column(name, justify="right" if name in ("bucket", "time ms", "TFLOP/s", "max err") else "left")
    for row in rows:
        table.add_row(
            row.variant_name, row.spec_hash, row.gpu_key, row.triton_version, str(row.bucket),
            _config_text(row), _number(row.time_ms, ".4f"), _number(row.tflops, ".1f"),
            _number(row.max_error, ".2e"), row.created_at.strftime("%Y-%m-%d %H:%M"),
        )
    return table


def _trials_table(rows: list[TrialRow]) -> Table:
    table = Table(title="trials")
    for name in ("study", "#", "GPU", "bucket", "config", "status", "time ms", "max err", "reason"):
        table.add_column(name, justify="right" if name in ("#", "bucket", "time ms", "max err") else "left")
    # Within a study, fastest first and failures last: the top rows say why the winner won.
    for row in sorted(rows, key=lambda r: (r.study_name, r.time_ms is None, r.time_ms or 0.0, r.trial_number)):
        table.add_row(
            row.study_name, str(row.trial_number), row.gpu_key, str(row.bucket), _config_text(row),
            row.status, _number(row.time_ms, ".4f"), _number(row.max_error, ".2e"), row.reason or "",
        )
    return table
