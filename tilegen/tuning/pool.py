"""Several tune processes on one host, sharing the studies: one per GPU, or interpreter workers.

``tilegen tune --gpus 0,1`` runs ``run_pool`` with one slot per GPU: each slot is a process
with ``CUDA_VISIBLE_DEVICES`` set to its GPU, running a ``Tuner`` over every bucket of the
command against the same database. They share each bucket's study (Optuna's parallel
optimization; see ``tilegen.tuning.tuner``), so a bucket's trials are spread over the GPUs,
and a process with nothing left to start in one bucket starts the next. Each keeps its own
measuring worker, so a CUDA fault or a hung kernel costs one trial, as with one GPU. A tune
process that dies (killed, out of memory) is started again on its GPU, up to ``restarts``
times; its trial in flight is failed and measured again.

Under the interpreter a slot is ``None``: a CPU process, so tests and the benchmark's smoke
run exercise the same machinery without a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from tilegen.ir import Spec
from tilegen.key import TuningKey
from tilegen.tuning.tuner import Reporter

__all__ = ["Plan", "PoolError", "run_pool"]

#: How often one slot's process may die before the tune gives up on that slot.
RESTARTS = 3


class PoolError(RuntimeError):
    """The tune cannot go on: a worker reported an error, or one slot's process kept dying."""


@dataclass(frozen=True)
class Plan:
    """What every worker of one command tunes; ``goals`` are computed once, by the parent, so a
    replaced worker aims at the command's goal rather than one counted from its own start."""

    db: str  # a file path or a server URL, password included (it travels over a pipe, not argv)
    spec: Spec
    buckets: tuple[int, ...]
    goals: dict[int, int]
    sampler: str
    seed: int
    timeout: float | None
    trial_timeout: float
    heartbeat: int


def slot_name(slot: int | None, index: int) -> str:
    return f"GPU {slot}" if slot is not None else f"interpreter worker {index}"


def run_pool(
    plan: Plan, slots: list[int | None], keys: dict[int, TuningKey], reporter: Reporter,
    *, echo: Callable[[str], None], restarts: int = RESTARTS,
) -> None:
    """Run one worker per slot until every one has tuned every bucket of ``plan``.

    ``keys`` are the parent's tuning keys by bucket: the workers' progress is reported under
    them. Raises ``PoolError`` with one line when a worker reports an error or a slot's
    process died more than ``restarts`` times.
    """
    ctx = multiprocessing.get_context("spawn")  # a forked child would share the parent's CUDA state
    events = ctx.Queue()
    procs: dict[int, multiprocessing.Process] = {}
    deaths = dict.fromkeys(range(len(slots)), 0)
    errors: list[str] = []

    def start(index: int) -> None:
        proc = ctx.Process(target=_work, args=(plan, slots[index], index, events),
                           name=f"tilegen-tune-{index}", daemon=False)
        proc.start()
        procs[index] = proc

    def drain(wait: float) -> None:
        try:
            while True:
                event = events.get(timeout=wait)
                wait = 0
                if event[0] == "trial":
                    _, bucket, result, best = event
                    reporter.trial(keys[bucket], result, best)
                elif event[0] == "error":
                    errors.append(event[1])
        except queue.Empty:
            pass

    try:
        for index in range(len(slots)):
            start(index)
        while procs:
            drain(0.2)
            for index, proc in list(procs.items()):
                if proc.exitcode is None:
                    continue
                proc.join()
                del procs[index]
                drain(0)  # its last words, if any, before deciding
                if proc.exitcode == 0 or errors:
                    continue
                deaths[index] += 1
                what = f"the tune process on {slot_name(slots[index], index)} died ({_describe(proc.exitcode)})"
                if deaths[index] > restarts:
                    errors.append(f"{what} {deaths[index]} times; its log above says why (or run on the other GPUs)")
                    continue
                echo(f"tilegen: {what}; starting another on it")
                start(index)
            if errors:
                break
    finally:
        for proc in procs.values():
            proc.kill()
            proc.join()
        events.close()
    if errors:
        raise PoolError(errors[0])


def _describe(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class _Forward(Reporter):
    def __init__(self, events):
        self.events = events

    def trial(self, key, result, best) -> None:
        self.events.put(("trial", key.bucket, result, best))


def _work(plan: Plan, slot: int | None, index: int, events) -> None:
    """One worker: its GPU made the only visible one, then every bucket of the plan."""
    if slot is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[slot] if visible else str(slot)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    import optuna

    from tilegen.db import DatabaseError, TuningDB
    from tilegen.device import device_info
    from tilegen.tuning.tuner import Tuner
    from tilegen.tuning.worker import WorkerError

    optuna.logging.set_verbosity(optuna.logging.CRITICAL)
    try:
        with TuningDB(plan.db) as db, Tuner(
            db, device_info(), sampler=plan.sampler, seed=plan.seed, timeout=plan.timeout,
            trial_timeout=plan.trial_timeout, heartbeat=plan.heartbeat, reporter=_Forward(events),
            worker_index=index,
        ) as tuner:
            tuner.tune_many(plan.spec, list(plan.buckets), goals=plan.goals)
    except (DatabaseError, WorkerError) as e:
        events.put(("error", f"{slot_name(slot, index)}: {e}"))
        events.close()
        events.join_thread()
        sys.exit(3)
    events.close()
    events.join_thread()
