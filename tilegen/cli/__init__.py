"""The ``tilegen`` command: emit, tune, db, bench.

Each subcommand lives in its own module and registers itself on ``app``. Errors a
user can fix (bad flags, a bad spec, a bad database) end in a one-line message and
a non-zero exit, never a traceback.
"""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Generated, autotuned attention kernels.")


@app.callback()
def _root() -> None:
    """Generated, autotuned attention kernels."""

from tilegen.cli import emit  # noqa: E402,F401  (registers its command)
from tilegen.cli import tune  # noqa: E402,F401  (registers its command)
from tilegen.cli import db  # noqa: E402,F401  (registers its commands)


def main() -> None:
    app()
