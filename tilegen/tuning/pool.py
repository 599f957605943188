"""Several tune processes on one host, sharing the studies: one per GPU, or interpreter workers.

``tilegen tune --gpus 0,1`` runs a ``Pool`` with one slot per GPU: each slot is a process
with ``CUDA_VISIBLE_DEVICES`` set to its GPU, running a ``Tuner`` over every bucket of the
command against the same database. They share each bucket's study (Optuna's parallel
optimization; see ``tilegen.tuning.tuner``), so a bucket's trials are spread over the GPUs,
and a process with nothing left to start in one bucket starts the next. Each keeps its own
measuring worker, so a CUDA fault or a hung kernel costs one trial, as with one GPU. A tune
process that dies (killed, out of memory) is started again on its GPU, up to ``restarts``
times; its trial in flight is failed and measured again.

Start-up is what a process of its own costs. The tune processes start before the parent
opens the database, so their own start overlaps that work. Where the parent has not
initialized CUDA's driver and runs one thread, they are forked, with torch and Triton
imported, rather than spawned to import them again (a replacement is always spawned). Each
forks its first measuring worker and its compile processes before it touches CUDA, so they
import nothing again either. Once the parent's checks pass it sends the ``Setup``, and each
opens its database and the studies' storage while the parent works out the ``Plan``. A tune
process that is done says so and leaves at once, rather than tearing its modules down while
the command waits.

A tune that stops early (Ctrl-C, SIGTERM, or an error of another process) leaves no trial
RUNNING: the parent asks each tune process still measuring to stop (``STOP_SIGNAL``), which it
does as a one-process tune does on Ctrl-C, failing its trial in flight and queuing its config
again, and kills only those that have not left within ``STOP_S`` seconds.

Under the interpreter a slot is ``None``: a CPU process, so tests and the benchmark's smoke
run exercise the same machinery without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tilegen.ir import Spec
from tilegen.key import TuningKey
from tilegen.tuning.interrupt import interrupt

if TYPE_CHECKING:  # the tune processes import this module first thing: the tuner, with Optuna, comes later
    from tilegen.tuning.tuner import Reporter

__all__ = ["Plan", "Pool", "PoolError", "Setup"]

log = logging.getLogger(__name__)

#: How often one slot's process may die before the tune gives up on that slot.
RESTARTS = 3
#: The signal by which the parent asks a tune process to stop: its trial in flight is queued again.
#: Not SIGINT or SIGTERM, which a terminal's Ctrl-C and a kill of the job send the whole process
#: group: the tune processes ignore those, so that the parent decides, and asks once.
STOP_SIGNAL = signal.SIGUSR1
#: How long the parent waits, in all, for its tune processes to stop when asked, before it kills
#: them. Queuing a trial again takes a few writes to the studies; a process killed before it has
#: done so leaves its trial RUNNING, to be reaped and queued again by the next tune of the bucket.
STOP_S = 3.0
#: A tune process's exit status once it stopped when asked.
STOPPED = 128 + STOP_SIGNAL


class PoolError(RuntimeError):
    """The tune cannot go on: a worker reported an error, or one slot's process kept dying."""


@dataclass(frozen=True)
class Setup:
    """How every tune process of one command tunes: sent once the parent's checks pass, so each
    opens its database and the studies' storage while the parent works out the plan."""

    db: str  # a file path or a server URL, password included (it travels over a pipe, not argv)
    sampler: str
    seed: int
    timeout: float | None
    trial_timeout: float
    heartbeat: int
    confirm: int | None = None  # the Tuner's: None is its default


@dataclass(frozen=True)
class Plan:
    """What every tune process of one command tunes: (spec, bucket, goal) jobs, in order, of one
    variant or several. The goals are computed once, by the parent, so a replaced process aims
    at the command's goal rather than one counted from its own start."""

    jobs: tuple[tuple[Spec, int, int], ...]


def slot_name(slot: int | None, index: int) -> str:
    return f"GPU {slot}" if slot is not None else f"interpreter worker {index}"


class Pool:
    """One tune process per slot, started before the plan exists and given it when it does.

    The processes start when the pool does: their measuring workers' CUDA start-up and their
    own imports of Optuna overlap the parent's checks and its opening of the database.
    ``prepare`` hands each the setup; ``run`` hands each the plan and reports until every one
    is done; ``close`` stops any still running (a tune that failed before ``run`` stops
    processes that never got a plan).
    """

    def __init__(self, slots: list[int | None], *, compile_ahead: int | None = None):
        self.slots = slots
        # Compile processes per tune process on a GPU; None: the host's default share.
        self.compile_ahead = compile_ahead
        self.ctx = multiprocessing.get_context("spawn")  # a replacement: the parent has CUDA's state by then
        self.events = self.ctx.Queue()
        self.procs: dict[int, multiprocessing.Process] = {}
        self.done: set[int] = set()
        self._plans: dict[int, object] = {}  # index -> the parent's end of that process's plan pipe
        self._setup: Setup | None = None
        self._plan: Plan | None = None
        self._failed = False

    def __enter__(self) -> Pool:
        from tilegen.tuning.process import forkable

        fork = forkable()
        for index in range(len(self.slots)):
            self._start(index, fork=fork)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, index: int, fork: bool = False) -> None:
        receiver, sender = self.ctx.Pipe(duplex=False)
        # A forked child holds copies of the parent's ends of the plan pipes, its own included,
        # and closes them: else it would never read EOF should the parent go first.
        inherited = [*self._plans.values(), sender] if fork else []
        ctx = multiprocessing.get_context("fork") if fork else self.ctx
        proc = ctx.Process(
            target=_work, args=(self.slots[index], index, self.events, receiver, log.getEffectiveLevel(),
                                len(self.slots), self.compile_ahead, inherited),
            name=f"tilegen-tune-{index}", daemon=False)
        proc.start()
        receiver.close()
        log.debug("tune process %d %s on %s", proc.pid, "forked" if fork else "spawned",
                  slot_name(self.slots[index], index))
        self.procs[index] = proc
        replaced = self._plans.pop(index, None)
        if replaced is not None:
            replaced.close()  # the pipe of the process this one replaces
        self._plans[index] = sender
        for message in (self._setup, self._plan):
            if message is not None:
                self._send(index, message)

    def _send(self, index: int, message: Setup | Plan) -> None:
        try:
            self._plans[index].send(message)
        except OSError:
            pass  # it died before reading it: run() sees the death and starts another

    def prepare(self, setup: Setup) -> None:
        """Hand every process the setup, once the parent's checks have passed: they open the
        database and the studies' storage while the parent works out the plan."""
        self._setup = setup
        for index in list(self.procs):
            self._send(index, setup)

    def run(self, plan: Plan, keys: dict[tuple[str, int], TuningKey], reporter: Reporter, *,
            echo: Callable[[str], None], restarts: int = RESTARTS) -> None:
        """Run until every process has tuned every bucket of ``plan`` (after ``prepare``).

        ``keys`` are the parent's tuning keys by (spec hash, bucket): the processes' progress is
        reported under them. Raises ``PoolError`` with one line when a process reports an error or a slot's
        process died more than ``restarts`` times.
        """
        if self._setup is None:
            raise RuntimeError("Pool.run: prepare(setup) comes first")
        self._plan = plan
        for index in list(self.procs):
            self._send(index, plan)
        slots, procs, done = self.slots, self.procs, self.done
        deaths = dict.fromkeys(range(len(slots)), 0)
        errors: list[str] = []

        def drain(wait: float) -> None:
            try:
                while True:
                    event = self.events.get(timeout=wait)
                    wait = 0
                    if event[0] == "trial":
                        _, job, result, best = event
                        reporter.trial(keys[job], result, best)
                    elif event[0] == "done":
                        done.add(event[1])
                    elif event[0] == "error":
                        errors.append(event[1])
            except queue.Empty:
                pass

        while len(done) < len(slots):
            drain(0.2)
            for index, proc in list(procs.items()):
                if index in done or proc.exitcode is None:
                    continue
                proc.join()
                del procs[index]
                drain(0)  # its last words, if any, before deciding
                if proc.exitcode == 0 or index in done:
                    done.add(index)
                    continue
                if errors:
                    continue  # it said why, and the tune stops
                deaths[index] += 1
                what = f"the tune process on {slot_name(slots[index], index)} died ({_describe(proc.exitcode)})"
                if deaths[index] > restarts:
                    errors.append(f"{what} {deaths[index]} times; its log above says why (or run on the other GPUs)")
                    continue
                echo(f"tilegen: {what}; starting another on it")
                self._start(index)
            if errors:
                break
        if errors:
            self._failed = True
            raise PoolError(errors[0])

    def close(self) -> None:
        """Stop every process that is not done, in a bounded time: an interrupted tune, or one that
        failed, leaves no trial RUNNING.

        Each is asked to stop (``STOP_SIGNAL``) and stops as a one-process tune does on Ctrl-C:
        its trial in flight is failed, its config queued again in the study, and it leaves. The
        parent itself could fail and queue the trials again once it has killed the processes
        (they carry their worker labels), but it holds no studies' storage (opening one takes
        the studies lock, and the stop would wait on whatever holds it), and it does not know
        which study each process is in: the process does, and does it as the one-process tune
        does. One that has not left after ``STOP_S`` seconds (stuck in a write, a lost server)
        is killed, and the next tune of its bucket reaps its trial.
        """
        # A process that is done has every trial written and only shuts down; the caller need
        # not wait for that (this process joins it when it exits).
        stopping = [proc for index, proc in self.procs.items() if index not in self.done or self._failed]
        # Without a plan a process has started no trial: it is killed at once.
        asked = [proc for proc in stopping if proc.exitcode is None] if self._plan is not None else []
        try:
            for proc in asked:
                with contextlib.suppress(OSError):  # it left meanwhile
                    os.kill(proc.pid, STOP_SIGNAL)
            deadline = time.monotonic() + STOP_S
            for proc in asked:
                proc.join(max(0.0, deadline - time.monotonic()))
        finally:
            # Reached also when a second Ctrl-C cuts the wait short: nothing is left running.
            for proc in stopping:
                if proc.exitcode is None:
                    log.debug("tune process %d did not stop within %g s; killing it", proc.pid, STOP_S)
                    proc.kill()
                proc.join()
        self.procs.clear()
        for sender in self._plans.values():
            sender.close()
        self._plans.clear()
        self.events.close()


def _describe(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class _Forward:
    """The tune process's reporter: each trial goes to the parent, which shows it."""

    def __init__(self, events):
        self.events = events

    def start(self, key, budget, best) -> None:
        pass  # the parent showed every bucket's budget before the workers started

    def trial(self, key, result, best) -> None:
        self.events.put(("trial", (key.spec.hash, key.bucket), result, best))


def _work(slot: int | None, index: int, events, plans, level: int = logging.WARNING, share: int = 1,
          compile_ahead: int | None = None, inherited: list = ()) -> None:
    """One tune process: its GPU made the only visible one, then every bucket of the plan it is sent."""
    for end in inherited:
        end.close()
    # Ctrl-C and a kill of the job reach the whole process group; they are the parent's to handle.
    # It asks this process to stop (STOP_SIGNAL: see _tune), which unwinds it as Ctrl-C unwinds a
    # one-process tune: its trial in flight is failed and queued again, and it leaves.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from tilegen.tuning.process import exit_now

    stopped = False
    try:
        code = _tune(slot, index, events, plans, level, share, compile_ahead)
    except KeyboardInterrupt:
        stopped, code = True, STOPPED
    except Exception:
        if not _asked_to_stop:
            raise
        # Asked to stop, it met an error on the way out (queuing its trial again on a lost server):
        # the parent ends the tune in one line, and the next tune reaps a trial left RUNNING.
        log.debug("stopping", exc_info=True)
        stopped, code = True, STOPPED
    try:
        signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # asked when it is done: it is leaving anyway
        stopped = stopped or _asked_to_stop  # an error on the way out was said, and is not waited on
        if stopped:
            events.cancel_join_thread()  # the parent reads no more; a full pipe must not keep this process
        events.close()
        if not stopped:
            events.join_thread()
    except KeyboardInterrupt:
        code = STOPPED
    # Everything is written and closed; an orderly interpreter exit would spend about a second
    # tearing down torch, Triton and Optuna, which the command's own exit waits for.
    exit_now(code)


_asked_to_stop = False


def _stop(signum, frame) -> None:
    """The parent asks this tune process to stop: once, as Ctrl-C would (the tuner queues its trial
    in flight again on ``KeyboardInterrupt``)."""
    global _asked_to_stop
    _asked_to_stop = True
    signal.signal(signum, signal.SIG_IGN)
    interrupt(frame)


def _tune(slot: int | None, index: int, events, plans, level: int, share: int, compile_ahead: int | None) -> int:
    """The tune process's work, up to its exit status; ``KeyboardInterrupt`` when asked to stop."""
    from tilegen.tuning.compile_ahead import CompileAhead, default_processes
    from tilegen.tuning.process import log_to_stderr
    from tilegen.tuning.worker import Worker, WorkerError

    log_to_stderr(level)
    if slot is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[slot] if visible else str(slot)
    opened = contextlib.ExitStack()
    with opened:  # the worker, the compile processes, the database and the tuner, however this ends
        # The measuring child first, while nothing here has touched CUDA: a fork, so it imports
        # nothing again, and its CUDA start-up overlaps this process's own (Optuna, the database,
        # the studies) instead of following it. Then the compile processes, forked alike.
        worker = opened.enter_context(Worker())
        worker.start(fork=True)
        # The host's CPUs are shared by every tune process of the pool, and by their compiles.
        ahead = opened.enter_context(CompileAhead(
            0 if slot is None else default_processes(share) if compile_ahead is None else compile_ahead,
            after=worker.cuda_up))
        ahead.start(fork=True)
        # Asked to stop from here on, this process unwinds; before, the signal's default ends it
        # (no trial has started). Not during the forks: an exception raised in their hooks (logging's
        # locks) is printed and dropped, and the forked children would inherit the handler.
        signal.signal(STOP_SIGNAL, _stop)
        import optuna  # the parent imported it before forking this process, where it could

        from tilegen.db import DatabaseError, TuningDB
        from tilegen.device import device_info
        from tilegen.tuning.tuner import Tuner

        optuna.logging.set_verbosity(optuna.logging.CRITICAL)
        failure = None
        try:
            # The CUDA runtime starts while the parent still checks its options (it takes a while
            # on a host of several GPUs); the forks above had to come first.
            device = device_info()
            log.debug("CUDA up")
            setup = plans.recv()
            log.debug("setup received")
            # The database and the studies' storage open while the parent plans. An error here is
            # the tune's only once a plan comes: a parent that stops first has met its own.
            try:
                db = opened.enter_context(TuningDB(setup.db))
                tuner = opened.enter_context(Tuner(
                    db, device, sampler=setup.sampler, seed=setup.seed, timeout=setup.timeout,
                    trial_timeout=setup.trial_timeout, heartbeat=setup.heartbeat, confirm=setup.confirm,
                    reporter=_Forward(events),
                    worker=worker, worker_index=index, worker_count=share, compile_ahead=ahead))
            except (DatabaseError, WorkerError) as e:
                failure = e
            plan = plans.recv()
            log.debug("plan received")
        except (EOFError, OSError):
            # The parent stopped before it had a plan (a bad option, an unreachable database): no
            # trial was started, so there is nothing to report or write.
            return 0
        try:
            if failure is not None:
                raise failure
            log.debug("tuner open")
            tuner.tune_jobs(list(plan.jobs))
            # Said before the worker, the database and this process shut down, which takes a
            # while and concerns no trial.
            events.put(("done", index))
        except (DatabaseError, WorkerError) as e:
            opened.close()
            events.put(("error", f"{slot_name(slot, index)}: {e}"))
            return 3
    return 0
