"""``tilegen tune``: tune a spec's configs per sequence-length bucket into the tuning database."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.console import Console

from tilegen.cli import app, fail
from tilegen.cli.spec_args import takes_spec
from tilegen.device import device_info
from tilegen.families import family_of
from tilegen.ir import Spec

_GPU_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
_INTERPRETER_SEQLENS = (16, 32)  # the interpreter is slow: tiny lengths finish in seconds
_GPU_TRIALS = 30
_INTERPRETER_TRIALS = 6


@app.command()
@takes_spec
def tune(
    spec: Spec,
    seqlens: Optional[str] = typer.Option(
        None, "--seqlens", "--sizes", help="Comma-separated sizes (sequence lengths for attention), each tuned at "
        "its family's bucket "
        f"(default: {','.join(map(str, _GPU_SEQLENS))} on a GPU, "
        f"{','.join(map(str, _INTERPRETER_SEQLENS))} under the interpreter).",
    ),
    trials: Optional[int] = typer.Option(
        None, help=f"Configs to measure per bucket (default: {_GPU_TRIALS} on a GPU, "
        f"{_INTERPRETER_TRIALS} under the interpreter; every feasible one with --sampler grid).",
    ),
    timeout: Optional[float] = typer.Option(None, help="Seconds per bucket (default: no limit)."),
    sampler: str = typer.Option("tpe", help="tpe (learns from earlier trials) or grid (every feasible config)."),
    db: Optional[Path] = typer.Option(None, help="Tuning database (default: $TILEGEN_DB or the user data folder)."),
    seed: int = typer.Option(0, help="Seed of the sampler and of the random inputs."),
) -> None:
    """Measure configs of a spec per size bucket and store the fastest correct one for dispatch."""
    lengths = _parse_seqlens(seqlens)
    if trials is not None and trials < 1:
        fail(f"--trials: expected a positive integer, got {trials}")
    if timeout is not None and not (0 < timeout < math.inf):
        fail(f"--timeout: expected a positive number of seconds, got {timeout:g}")
    if not 0 <= seed < 2**32:
        fail(f"--seed: expected an integer from 0 to {2**32 - 1}, got {seed}")
    if db is not None and db.is_dir():
        fail(f"--db: {db} is a folder; give the database file, e.g. {db / 'tuning.sqlite'}")

    if not torch.cuda.is_available():
        # Kernels run only in the worker process, which inherits this and so imports Triton in
        # interpreter mode; this process needs it only for device_info().
        os.environ["TRITON_INTERPRET"] = "1"
    _tune(spec, lengths, trials=trials, timeout=timeout, sampler=sampler, db=db, seed=seed)


def _tune(spec, lengths, *, trials, timeout, sampler, db, seed) -> None:
    # Optuna, SQLAlchemy and the tuner load here, so other commands do not pay for them.
    import optuna

    from tilegen.db import DatabaseError, TuningDB
    from tilegen.tuning import (
        SAMPLERS,
        ProgressReporter,
        Tuner,
        WorkerError,
        summary_table,
    )

    if sampler not in SAMPLERS:
        fail(f"--sampler: expected one of {', '.join(SAMPLERS)}, got {sampler!r}")
    family = family_of(spec)
    try:
        family.lower(spec)  # a spec the template cannot take fails here, not once per trial
    except NotImplementedError as e:
        fail(str(e))
    try:
        database = TuningDB(db)
        database.check_writable()  # a read-only file fails here, before anything is measured
    except DatabaseError as e:
        fail(str(e))
    device = device_info()
    if device.is_interpreter:
        typer.echo(
            f"tilegen: no GPU; tuning under the Triton interpreter with wall-clock timing, "
            f"filed under device {device.key} (never used on a GPU)", err=True,
        )
    lengths = lengths or (_INTERPRETER_SEQLENS if device.is_interpreter else _GPU_SEQLENS)
    buckets = sorted({family.buckets.of(n) for n in lengths})
    if trials is None and sampler == "tpe":
        trials = _INTERPRETER_TRIALS if device.is_interpreter else _GPU_TRIALS
    # The progress bars and the table say what Optuna's lines would; an error stops the tune anyway.
    optuna.logging.set_verbosity(optuna.logging.CRITICAL)

    try:
        with ProgressReporter(Console(stderr=True)) as progress, Tuner(
            database, device, sampler=sampler, trials=trials, timeout=timeout, seed=seed, reporter=progress,
        ) as tuner:
            results = [tuner.tune(spec, bucket) for bucket in buckets]
    except (DatabaseError, WorkerError) as e:
        fail(str(e))
    Console().print(summary_table(results))
    unsolved = [r.key.bucket for r in results if r.best is None]
    if unsolved:
        fail(f"no config was correct for bucket(s) {', '.join(map(str, unsolved))}; "
             f"the trials' reasons: tilegen db show --db {database.path} {spec.hash}")
    typer.echo(f"stored in {database.path}", err=True)


#: Sizes past this overflow the kernels' int32 index arithmetic, and no tune could allocate them.
_MAX_SIZE = 2**31 - 1


def _parse_seqlens(text: str | None) -> list[int]:
    if text is None:
        return []
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        fail(f"--seqlens: expected comma-separated positive integers such as 1024,4096; got {text!r}")
    if max(lengths) > _MAX_SIZE:
        fail(f"--seqlens: {max(lengths)} is too large; sizes go up to {_MAX_SIZE}")
    return lengths
