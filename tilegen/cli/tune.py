"""``tilegen tune``: tune a spec's configs per sequence-length bucket into the tuning database.

A family whose bucket holds a batch too (decode: longest context x sequences) is tuned at
every ``--sizes`` value crossed with every ``--batches`` value. One command may tune several
variants (``--preset a,b``, or a JSON list in ``--spec``): they share its start-up, and with
``--gpus`` its GPUs."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.console import Console

from tilegen import env
from tilegen.cli.app import app, fail, check_db_path, user_db
from tilegen.cli.spec_args import MOD_HELP, takes_specs, with_mods
from tilegen.device import device_info, host_gpu_models
from tilegen.families import BUILTIN, families, family_of
from tilegen.ir import Spec
from tilegen.key import TuningKey
from tilegen.layers import LAYER_FAMILY
from tilegen.tuning.interrupt import cancel as cancel_interrupt, interrupt

_GPU_TRIALS = 30
_INTERPRETER_TRIALS = 6
#: A GPU bucket's K and V may take this share of the GPU's memory (inputs, outputs and the reference take the rest).
_KV_MEMORY_SHARE = 0.5


def _defaults_help(method: str) -> str:
    """tilegen's families' defaults (``Buckets.tune_sizes`` or ``tune_batches``) for a help text, the
    most common first, then each other default with the families that take it."""
    groups: dict[str, list[str]] = {}
    for family in (*BUILTIN, LAYER_FAMILY):
        defaults = getattr(family.buckets, method)
        gpu, interpreter = defaults(on_gpu=True), defaults(on_gpu=False)
        if gpu or interpreter:
            text = f"{','.join(map(str, gpu))} on a GPU, {','.join(map(str, interpreter))} under the interpreter"
            groups.setdefault(text, []).append(family.name)
    ordered = sorted(groups.items(), key=lambda item: -len(item[1]))
    if len(ordered) == 1:
        return f"{', '.join(ordered[0][1])}: {ordered[0][0]}"
    return "; ".join([ordered[0][0], *(f"{', '.join(names)}: {text}" for text, names in ordered[1:])])


@app.command()
@takes_specs
def tune(
    specs: list[Spec],
    seqlens: Optional[str] = typer.Option(
        None, "--seqlens", "--sizes", help="Comma-separated sizes (sequence lengths for attention, the longest "
        "context for decode), each tuned at its family's bucket "
        f"(default: its family's bucket rule's: {_defaults_help('tune_sizes')}).",
    ),
    batches: Optional[str] = typer.Option(
        None, "--batches", help="Comma-separated batch sizes (sequences per call), for a family whose bucket "
        "holds the batch too (attention_decode); every one is tuned with every --sizes value, at its bucket "
        "(the next power of two). Buckets whose K and V would take over half of the GPU's memory are skipped "
        f"(default: its family's bucket rule's: {_defaults_help('tune_batches')}).",
    ),
    trials: Optional[int] = typer.Option(
        None, help=f"Configs to measure per bucket (default: {_GPU_TRIALS} on a GPU, "
        f"{_INTERPRETER_TRIALS} under the interpreter; every feasible one with --sampler grid).",
    ),
    timeout: Optional[float] = typer.Option(None, help="Seconds per bucket (default: no limit)."),
    sampler: str = typer.Option("tpe", help="tpe (learns from earlier trials) or grid (every feasible config)."),
    db: Optional[str] = typer.Option(
        None, help="Tuning database: a SQLite file, or a server URL such as postgresql+psycopg://user@host/tilegen "
        "(default: $TILEGEN_DB or the user data folder).",
    ),
    seed: int = typer.Option(0, help="Seed of the sampler and of the random inputs."),
    gpus: Optional[str] = typer.Option(
        None, help="GPUs to tune on, one tune process each, sharing every study: indices such as 0,1, or all "
        "(default: one process on the current GPU).",
    ),
    workers: Optional[int] = typer.Option(
        None, help="Without a GPU: interpreter processes sharing every study, as --gpus runs one per GPU.",
    ),
    heartbeat: int = typer.Option(
        20, help="Seconds between a running trial's heartbeats; a trial silent for three (its process died) "
        "is failed and measured again.",
    ),
    compile_ahead: Optional[int] = typer.Option(
        None, help="On a GPU, processes per tune process that compile a bucket's configs into Triton's cache "
        "while the worker measures; 0 turns them off (default: $TILEGEN_COMPILE_AHEAD, else half the CPUs "
        "shared by the tune processes, at most 8).",
    ),
    confirm: Optional[int] = typer.Option(
        None, help="Rivals each bucket's winner is timed again with, alternately on one GPU, before its row is "
        "stored: one measurement moves by a few percent between moments and between GPUs; 0 stores the best "
        "first measurement (default: 1 on a GPU, 0 under the interpreter).",
    ),
    score_mod: Optional[str] = typer.Option(None, help=MOD_HELP.format(kind="score mod")),
    mask_mod: Optional[str] = typer.Option(None, help=MOD_HELP.format(kind="mask mod")),
) -> None:
    """Measure configs of a spec (or several) per size bucket; store the fastest correct one for dispatch."""
    specs = with_mods(specs, score_mod, mask_mod)
    if score_mod is not None or mask_mod is not None:
        from tilegen.mods.sources import export

        # Each trial builds the mods again, in the processes this one starts: they inherit the paths.
        export({kind: path for kind, path in (("score_mod", score_mod), ("mask_mod", mask_mod)) if path})
    lengths = _parse_seqlens(seqlens)
    batch_sizes = _parse_batches(batches, [family_of(spec) for spec in specs])
    if trials is not None and trials < 1:
        fail(f"--trials: expected a positive integer, got {trials}")
    if timeout is not None and not (0 < timeout < math.inf):
        fail(f"--timeout: expected a positive number of seconds, got {timeout:g}")
    if not 0 <= seed < 2**32:
        fail(f"--seed: expected an integer from 0 to {2**32 - 1}, got {seed}")
    # Past threading.TIMEOUT_MAX Optuna's heartbeat thread dies on an OverflowError and the tune goes on without one.
    if not 1 <= heartbeat <= threading.TIMEOUT_MAX:
        fail(f"--heartbeat: expected a positive whole number of seconds up to {int(threading.TIMEOUT_MAX)}, "
             f"got {heartbeat}")
    if compile_ahead is not None and compile_ahead < 0:
        fail(f"--compile-ahead: expected a number of processes, 0 or more, got {compile_ahead}")
    if confirm is not None and confirm < 0:
        fail(f"--confirm: expected a number of rivals, 0 or more, got {confirm}")
    db = check_db_option(db)
    slots = _parse_slots(gpus, workers)

    # Counted through NVML where it answers, which leaves CUDA's driver uninitialized: the tune's
    # processes are forked before this one touches CUDA (torch.cuda.is_available() would initialize it).
    if not torch.cuda.device_count():
        # Kernels run only in the worker process, which inherits this and so imports Triton in
        # interpreter mode; this process needs it only for device_info().
        os.environ["TRITON_INTERPRET"] = "1"
    with _interrupts() as received:
        try:
            _tune(specs, lengths, batch_sizes, trials=trials, timeout=timeout, sampler=sampler, db=db, seed=seed,
                  slots=slots, heartbeat=heartbeat, compile_ahead=compile_ahead, confirm=confirm)
        except KeyboardInterrupt:
            # Every finished trial is in the database and the one in flight is queued again in its
            # study, so the same command measures it on resuming: a traceback would say nothing more.
            signum = received[-1] if received else signal.SIGINT
            typer.echo(f"error: interrupted by {signal.Signals(signum).name}; every finished trial is stored, "
                       "and running the same command again goes on from them (measuring none twice, and "
                       "--trials more configs a bucket)", err=True)
            raise typer.Exit(128 + signum) from None


@contextlib.contextmanager
def _interrupts():
    """While tuning, SIGTERM (a kill, a stopping service) unwinds like Ctrl-C: the trial in flight is
    queued again and the tune ends in one line, with the shell's status 128 + the signal's number.
    Yields the signals received, newest last."""
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        interrupt(frame)

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        # A second signal met in the database code while the first unwound the tune is deferred: the tune has
        # ended in its one line all the same.
        cancel_interrupt()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def check_db_option(db: str | None) -> str | Path | None:
    """``--db`` as a file path or a checked server URL; a bad one ends in one line before anything runs."""
    from tilegen.db.errors import DatabaseError
    from tilegen.db.location import is_url, server_url

    if db is None:
        # The user database the tune writes: a folder there is named as the variable that put it there, as db and
        # emit name it, not left to SQLite's "unable to open database file".
        check_db_path("TILEGEN_DB" if os.environ.get("TILEGEN_DB") else "the user database", user_db())
        return None
    if is_url(db):
        try:
            server_url(db)
        except DatabaseError as e:
            fail(f"--db: {e}")
        return db
    path = Path(db)
    check_db_path("--db", path)
    return path


def _parse_slots(gpus: str | None, workers: int | None) -> list[int | None] | None:
    """The tune processes to run, one per slot (a GPU index, or ``None`` for an interpreter worker);
    ``None`` for today's single process."""
    if gpus is not None and workers is not None:
        fail("--workers: give --gpus (one process per GPU) or --workers (interpreter processes), not both")
    if workers is not None:
        if workers < 1:
            fail(f"--workers: expected a positive number of processes, got {workers}")
        if torch.cuda.device_count():
            fail("--workers: this machine has a GPU; give --gpus (one tune process per GPU) instead")
        return [None] * workers
    if gpus is None:
        return None
    count = torch.cuda.device_count()
    text = gpus.strip()
    if text == "all":
        if not count:
            fail("--gpus: this machine has no CUDA GPU; without one, run interpreter processes with --workers N")
        return list(range(count))
    try:
        indices = [int(part) for part in text.split(",")]
    except ValueError:
        fail(f"--gpus: expected GPU indices such as 0,1 or all; got {gpus!r}")
    if min(indices) < 0:
        fail(f"--gpus: GPU indices start at 0; got {min(indices)}")
    repeated = sorted({i for i in indices if indices.count(i) > 1})
    if repeated:
        fail(f"--gpus: GPU {repeated[0]} is given twice; give each GPU once (one tune process per GPU)")
    if max(indices) >= count:
        have = f"has {count} (0..{count - 1})" if count else "has no CUDA GPU; without one, use --workers N"
        fail(f"--gpus: there is no GPU {max(indices)}; this machine {have}")
    return indices


def _check_one_model(slots: list[int | None]) -> None:
    """GPUs of one command must be of one model: rows are keyed by it. A host whose GPUs NVML
    names alike passes as it is; otherwise the chosen GPUs' names are read through CUDA, which
    starts this process's CUDA runtime (once the tune processes are forked)."""
    gpus = [slot for slot in slots if slot is not None]
    if not gpus or len(host_gpu_models() or ()) == 1:
        return
    names = {torch.cuda.get_device_name(i) for i in gpus}
    if len(names) > 1:
        fail(f"--gpus: the GPUs are of different models ({', '.join(sorted(names))}); their rows are keyed apart, "
             f"so tune each model with its own command")


def _tune(specs, lengths, batch_sizes, *, slots, **options) -> None:
    if slots is None:
        from tilegen.tuning.compile_ahead import CompileAhead
        from tilegen.tuning.worker import Worker

        with Worker() as worker, CompileAhead(compile_processes(options.pop("compile_ahead")),
                                              after=worker.cuda_up) as ahead:
            _tune_in(specs, lengths, batch_sizes, pool=None, worker=worker, compile_ahead=ahead, **options)
        return
    from tilegen.tuning.pool import Pool

    _import_tune_modules(options["db"])
    # The tune processes start first (forked where they can be): their workers' CUDA start-up and
    # their own setup overlap this process's checks and its opening of the database and the
    # studies; they wait for the plan.
    with Pool(slots, compile_ahead=options["compile_ahead"]) as pool:
        _check_one_model(slots)
        _tune_in(specs, lengths, batch_sizes, pool=pool, **options)


def _import_tune_modules(db) -> None:
    """Import here what each tune process imports, so that its forked copies find it done. A
    one-process tune imports the same before it forks its worker; meanwhile the background
    warm-up (``tilegen.triton_internals.warmup``), which a fork waits for, ends."""
    import optuna  # noqa: F401

    import tilegen.tuning.tuner  # noqa: F401
    from tilegen.db.location import is_url, server_url

    target = str(db if db is not None else user_db(target=True))
    if is_url(target):
        # The server's driver (psycopg for PostgreSQL), which each process's engine would load.
        with contextlib.suppress(Exception):  # a bad URL is reported where the database opens
            server_url(target).get_dialect().import_dbapi()


def compile_processes(option: int | None) -> int:
    """Compile-ahead processes of a one-process tune: ``--compile-ahead``, else the default; none
    under the interpreter, which compiles nothing."""
    from tilegen.tuning.compile_ahead import default_processes

    if env.interpreting():
        return 0
    return default_processes() if option is None else option


def _tune_in(specs, lengths, batch_sizes, *, trials, timeout, sampler, db, seed, pool, heartbeat,
             compile_ahead, confirm, worker=None) -> None:
    # Optuna, SQLAlchemy and the tuner load here, so other commands do not pay for them.
    import optuna

    from tilegen.db import DatabaseError, TuningDB
    from tilegen.db.location import is_url
    from tilegen.tuning import (
        SAMPLERS,
        ProgressReporter,
        Reporter,
        Tuner,
        WorkerError,
        summary_table,
    )
    from tilegen.tuning.pool import Plan, PoolError, Setup
    from tilegen.tuning.report import bucket_text

    if sampler not in SAMPLERS:
        fail(f"--sampler: expected one of {', '.join(SAMPLERS)}, got {sampler!r}")
    from tilegen.mods.sources import sources_for

    for spec in specs:
        try:
            sources_for(spec)  # a spec with mods (from --spec) needs --score-mod/--mask-mod to name their functions
            family_of(spec).lower(spec)  # a spec the template cannot take fails here, not once per trial
        except NotImplementedError as e:
            fail(str(e) if len(specs) == 1 else f"{spec.name}: {e}")
    try:
        database = TuningDB(db)
        database.check_writable()  # a read-only file fails here, before anything is measured
    except DatabaseError as e:
        fail(f"--db: {e}" if is_url(db if db is not None else user_db(target=True)) else str(e))
    if worker is not None:
        # The checks passed: the measuring worker and the compile processes start now, forked
        # while this process has not touched CUDA (device_info() does), so they import nothing
        # again and their start-up overlaps this process's opening of the studies.
        worker.start(fork=True)
        compile_ahead.start(fork=True)
    if pool is not None:
        # The checks passed: the tune processes open the database and the studies meanwhile.
        pool.prepare(Setup(db=str(db) if db is not None else str(user_db(target=True)), sampler=sampler, seed=seed,
                           timeout=timeout, trial_timeout=120.0, heartbeat=heartbeat, confirm=confirm))
    device = device_info()
    if device.is_interpreter:
        typer.echo(
            f"tilegen: no GPU; tuning under the Triton interpreter with wall-clock timing, "
            f"filed under device {device.key} (never used on a GPU)", err=True,
        )
    jobs = [(spec, bucket) for spec in specs
            for bucket in _buckets(spec, family_of(spec), device, lengths, batch_sizes)]
    if trials is None and sampler == "tpe":
        trials = _INTERPRETER_TRIALS if device.is_interpreter else _GPU_TRIALS
    # The progress bars and the table say what Optuna's lines would; an error stops the tune anyway.
    optuna.logging.set_verbosity(optuna.logging.CRITICAL)

    try:
        if pool is None:
            with ProgressReporter(Console(stderr=True)) as progress, Tuner(
                database, device, sampler=sampler, trials=trials, timeout=timeout, seed=seed, reporter=progress,
                heartbeat=heartbeat, worker=worker, compile_ahead=compile_ahead, confirm=confirm,
            ) as tuner:
                results = [tuner.tune(spec, bucket) for spec, bucket in jobs]
        else:
            # This process plans and reports; the workers measure. Its Tuner never starts a worker.
            with ProgressReporter(Console(stderr=True)) as progress, Tuner(
                database, device, sampler=sampler, trials=trials, seed=seed, heartbeat=heartbeat, reporter=Reporter(),
                compile_ahead=0, open_studies=False,
            ) as tuner:
                planned, keys = [], {}
                for spec, bucket in jobs:
                    measured, _ = tuner.measured(spec, bucket)
                    goal = tuner.goal(spec, bucket)
                    keys[spec.hash, bucket] = TuningKey.current(spec, device, bucket)
                    progress.start(keys[spec.hash, bucket], goal - measured, None)
                    planned.append((spec, bucket, goal))
                pool.run(Plan(jobs=tuple(planned)), keys, progress, echo=lambda line: typer.echo(line, err=True))
                results = tuner.collect(jobs)
    except (DatabaseError, WorkerError, PoolError) as e:
        fail(str(e))
    finally:
        database.close()
    for spec in specs:
        Console().print(summary_table([r for r in results if r.key.spec == spec]))
    for spec in specs:
        unsolved = [bucket_text(r.key) for r in results if r.key.spec == spec and r.best is None]
        if unsolved:
            fail(f"no config was correct for bucket(s) {', '.join(map(str, unsolved))}"
                 f"{f' of {spec.name}' if len(specs) > 1 else ''}; "
                 f"the trials' reasons: tilegen db show --db {database.location} {spec.hash}")
    typer.echo(f"stored in {database.location}", err=True)


def _buckets(spec, family, device, lengths: list[int], batch_sizes: list[int]) -> list[int]:
    """The buckets to tune, in order: each size's, or each (size, batch) pair's for a family with a batch."""
    rule = family.buckets
    lengths = lengths or rule.tune_sizes(on_gpu=not device.is_interpreter)
    if rule.batch_unit is None:
        return _storable(family, sorted({rule.of(n) for n in lengths}), "--sizes")
    batch_sizes = batch_sizes or rule.tune_batches(on_gpu=not device.is_interpreter)
    buckets = _storable(family, sorted({rule.of((n, b)) for n in lengths for b in batch_sizes}), "--sizes, --batches")
    if device.is_interpreter:
        return buckets  # the interpreter's problems are capped small whatever the bucket
    budget = device.memory_bytes * _KV_MEMORY_SHARE
    fitting = []
    for bucket in buckets:
        need = family.problem(spec, bucket, on_gpu=True).bytes_moved()
        if need <= budget:
            fitting.append(bucket)
        else:
            typer.echo(f"tilegen: skipping {rule.label(bucket)}: its K and V take {need / 1e9:.1f} GB, over "
                       f"{_KV_MEMORY_SHARE:.0%} of this GPU's {device.memory_bytes / 1e9:.0f} GB", err=True)
    if not fitting:
        fail(f"--batches: every --sizes x --batches bucket needs more than {_KV_MEMORY_SHARE:.0%} of this GPU's "
             f"{device.memory_bytes / 1e9:.0f} GB for its K and V; give smaller sizes or batches")
    return fitting


#: Sizes past this overflow the kernels' int32 index arithmetic, and no tune could allocate them.
_MAX_SIZE = 2**31 - 1


def _storable(family, buckets: list[int], options: str) -> list[int]:
    """``buckets``, refused before any trial when one lies past the database's 32-bit buckets (a size past 2**30
    rounds up to 2**31 under a power-of-two rule), where the first trial's row would be refused after measuring."""
    past = [bucket for bucket in buckets if bucket > _MAX_SIZE]
    if past:
        fail(f"{options}: {family.name} files these sizes in bucket {past[0]}, past the database's largest "
             f"({_MAX_SIZE}); give smaller sizes")
    return buckets


def _parse_seqlens(text: str | None) -> list[int]:
    # Both of the option's names: the documented one, --sizes, and the alias the user may have typed.
    return _parse_sizes("--sizes/--seqlens", text, "1024,4096", "sizes")


def _parse_batches(text: str | None, tuned: list) -> list[int]:
    """``--batches`` for the families of a command that bucket a batch too; an error when none does."""
    if text is not None and all(family.buckets.batch_unit is None for family in tuned):
        family = tuned[0]
        takers = [f.name for f in families() if f.buckets.batch_unit is not None]
        fail(f"--batches: {family.name} buckets one size ({family.buckets.unit}), not a batch; "
             f"--batches is for {', '.join(takers)}")
    return _parse_sizes("--batches", text, "1,8,64", "batches")


def _parse_sizes(option: str, text: str | None, example: str, what: str) -> list[int]:
    if text is None:
        return []
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        fail(f"{option}: expected comma-separated positive integers such as {example}; got {text!r}")
    if max(sizes) > _MAX_SIZE:
        fail(f"{option}: {max(sizes)} is too large; {what} go up to {_MAX_SIZE}")
    return sizes
