"""The ``tilegen`` command: emit, tune, db, bench.

Each subcommand lives in its own module and registers itself on ``app``. Every error a
user can fix (a bad flag, number, path, spec or database) ends in one line,
``error: ...`` naming the argument and what to do, and exit status 2; never a traceback.
"""

from __future__ import annotations

import atexit
import sys
from typing import NoReturn

import typer

from tilegen.cli import bench, db, emit, tune  # noqa: F401  (each registers its commands on app)
from tilegen.cli.app import (
    USAGE_ERROR,
    _Abort,
    _ClickException,
    _Exit,
    _NoArgsIsHelp,
    _UsageError,
    app,
)


def main(argv: list[str] | None = None) -> None:
    """Run the command line; usage errors (an unknown option, a value of the wrong type) print as one line too."""
    try:
        # Not standalone: click returns a command's exit status instead of exiting, and raises
        # usage errors here instead of printing them as a box.
        code = app(args=argv, standalone_mode=False)
    except _NoArgsIsHelp as e:
        e.show()  # a bare `tilegen` or `tilegen db`: the help, as asked for
        sys.exit(e.exit_code)
    except _UsageError as e:
        command = e.ctx.command_path if e.ctx is not None else "tilegen"
        typer.echo(f"error: {' '.join(e.format_message().split())} (see: {command} --help)", err=True)
        sys.exit(USAGE_ERROR)
    except _ClickException as e:
        typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
        sys.exit(USAGE_ERROR)
    except _Abort:
        typer.echo("error: aborted", err=True)
        sys.exit(USAGE_ERROR)
    except _Exit as e:
        sys.exit(e.exit_code)
    if isinstance(code, int) and code:
        sys.exit(code)


def run() -> NoReturn:
    """The program (``tilegen``, ``python -m tilegen``): ``main``, then an exit that skips the
    interpreter's teardown. The exit handlers still run (logging's flush, multiprocessing's
    cleanup of its children and semaphores); what is skipped is unloading modules, which after
    a tune (torch, Triton, Optuna) took 0.8 s on the 2-CPU machine while the shell waited, and
    0.01 s the handlers. A crash still ends with its traceback."""
    from tilegen.tuning.process import exit_now

    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message") prints it and exits 1
            print(e.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    exit_now(code)
