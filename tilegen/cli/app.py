"""The ``tilegen`` Typer app and how a command fails: a module of its own, so the commands
(``tilegen.cli.emit``, ``tune``, ``db``, ``bench``) register on it without importing the package
that imports them."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

# Typer 0.2x ships its own copy of click's exceptions; earlier releases use click's.
try:
    from typer._click import exceptions as _exceptions
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as _exceptions
_ClickException = _exceptions.ClickException
_UsageError = _exceptions.UsageError
_NoArgsIsHelp = getattr(_exceptions, "NoArgsIsHelpError", ())  # click before 8.2 prints the help itself
_Exit = typer.Exit
_Abort = typer.Abort

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Generated, autotuned attention kernels.")

#: Exit status of every error a user can fix, as click gives for a usage error.
USAGE_ERROR = 2


def fail(message: str) -> NoReturn:
    """End the command with ``error: <message>`` on one line and exit status 2. Control characters (text
    from a database or a file may carry terminal escapes) are shown as ``?``."""
    line = "".join(c if c.isprintable() else "?" for c in " ".join(message.split()))
    typer.echo(f"error: {line}", err=True)
    raise typer.Exit(USAGE_ERROR)


def user_db(*, target: bool = False) -> Path | str:
    """``env.db_path()``, or ``env.db_target()`` (a server's URL too) with ``target``; a TILEGEN_DB that names no
    path (``~name/...`` of no user known here) ends the command in one line naming the variable."""
    from tilegen import env

    try:
        return env.db_target() if target else env.db_path()
    except FileNotFoundError as e:
        fail(f"TILEGEN_DB: {e}")


def check_db_path(source: str, path: Path) -> None:
    """End the command, naming ``source`` (an option, or TILEGEN_DB), when ``path``, where a database file is
    wanted, is a folder or a SQLite ``file:`` URI (SQLite would open the file it names, while the studies file
    and the folders took the text as a relative path)."""
    from tilegen.db.errors import DatabaseError
    from tilegen.db.location import refuse_file_uri

    try:
        refuse_file_uri(path)
    except DatabaseError as e:
        fail(f"{source}: {e}")
    from tilegen.db.sqlite import lookup_error

    try:
        folder = path.is_dir()
    except OSError as e:  # is_dir answers False only when nothing is there
        if lookup_error(e):
            fail(f"{source}: cannot reach {path}: {e.strerror or e}")
        folder = False
    if folder:
        fail(f"{source}: {path} is a folder; give the database file, e.g. {path / 'tuning.sqlite'}")


@app.callback()
def _root() -> None:
    """Generated, autotuned attention kernels."""
