"""``tilegen bench NAME [ARGS]``: run one of tilegen's benchmarks, its peers measured in the same run.

Each benchmark is the module ``tilegen.bench.NAME`` (``python -m tilegen.bench.NAME`` runs the
same); its own flags follow the name, and ``-h`` after the name lists them.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from pathlib import Path

import typer
from typer.core import TyperCommand

import tilegen.bench
from tilegen.cli.app import app, fail


def benchmarks() -> dict[str, str]:
    """Each benchmark's name and what it measures: its module docstring's opening, up to the first
    colon or full stop, read from the file's head (every ``tilegen`` command builds this help, so
    nothing is imported or parsed)."""
    folder = Path(tilegen.bench.__file__).parent
    found = {}
    for info in pkgutil.iter_modules([str(folder)]):
        if info.name.startswith("_"):
            continue
        with open(folder / f"{info.name}.py") as f:
            head = f.read(1000)
        opening = head.partition('"""')[2].partition("\n\n")[0].replace("\n", " ")
        found[info.name] = re.split(r"[:.](\s|$)", opening, maxsplit=1)[0]
    return found


def _help() -> str:
    rows = "\n".join(f"  {name:16} {line}" for name, line in sorted(benchmarks().items()))
    return ("Run a benchmark: tilegen and its peers (SDPA, FlexAttention, ...) on the same inputs, in one run. "
            "Its flags follow NAME; `tilegen bench NAME -h` lists them.\n\n\b\n" + rows)


class _BenchCommand(TyperCommand):
    """``tilegen bench``, whose ``--help`` after NAME belongs to the benchmark: click would otherwise take it as
    its own eager help option and show this command's help in place of the benchmark's flags."""

    def parse_args(self, ctx, args):
        if args and not args[0].startswith("-"):
            args = [args[0], *("-h" if arg == "--help" else arg for arg in args[1:])]
        return super().parse_args(ctx, args)


@app.command(help=_help(), cls=_BenchCommand,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    name: str = typer.Argument("attention", help="The benchmark (default attention: prefill against the peers)."),
) -> None:
    known = benchmarks()
    if name not in known:
        fail(f"NAME: no benchmark {name!r}; choose one of {', '.join(sorted(known))}")
    module = importlib.import_module(f"tilegen.bench.{name}")
    # argparse names the program after sys.argv[0]: its usage lines then show the command as typed.
    argv0, sys.argv[0] = sys.argv[0], f"tilegen bench {name}"
    try:
        code = module.main(list(ctx.args))
    except SystemExit as e:
        if isinstance(e.code, str):  # a benchmark's own refusal (no GPU, say): the command's one-line error
            fail(e.code)
        raise
    finally:
        sys.argv[0] = argv0
    raise typer.Exit(code or 0)
