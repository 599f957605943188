"""Tuning one spec at one length bucket: Optuna proposes, the worker measures, the database keeps.

One Optuna study per tuning key, stored next to the tuning database and opened with
``load_if_exists``, so a killed tune resumes where it stopped. The database files trials
by study name and Optuna's trial number, and never overwrites one: when the studies file
no longer holds the study that numbered the database's trials (it was deleted, or the
trials were imported), the tune runs a new study named ``<key>-run<k>`` instead of
numbering from 0 again. Every trial is written
to the database the moment it finishes (killing a tune loses at most the trial in
flight), and the database, not the study, says which configs a key has measured: a
config measured before is answered from there instead of measured again. After the
study the best correct config goes to the tuned-config table, which is what
``tilegen.attention`` dispatches from.

Several tune processes may share a study: the workers of ``tilegen tune --gpus``, or
processes on several hosts against one database server (Optuna's parallel optimization).
A run aims at a count of measured configs per key (its goal: what the key held plus the
budget), which all processes started with the same goal reach together. Under the
database's studies lock, each trial reads what the others have measured and are
measuring, and a config another process has in flight is never measured a second time.
Each running trial beats a heartbeat; a trial whose process died (kill -9, a lost host)
goes stale, any process of the study marks it failed and queues it again, and a process
does not leave a bucket while trials it still counts on run elsewhere. So no trial stays
RUNNING, none is lost, and none is measured twice.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import errno
import inspect
import logging
import math
import os
import random
import sqlite3
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import optuna
from optuna.trial import TrialState
from sqlalchemy.exc import SQLAlchemyError

from tilegen import dispatch
from tilegen.db import DatabaseError, TrialRow, measured_study
from tilegen.device import DeviceInfo
from tilegen.families import Config, Family, Problem, family_of
from tilegen.ir import Spec
from tilegen.key import TuningKey
from tilegen.tuning.compile_ahead import CompileAhead, default_processes
from tilegen.tuning.measure import Compare
from tilegen.tuning.worker import Worker

__all__ = ["SAMPLERS", "TrialResult", "BucketResult", "Reporter", "Tuner"]

SAMPLERS = ("tpe", "grid")
#: Best configs of this many other buckets seed a study, nearest length first.
_NEIGHBOURS = 3
#: Seconds between a running trial's heartbeats, by default.
HEARTBEAT_S = 20
#: A trial whose heartbeat is this many intervals old belongs to a dead process: it is failed and queued again.
_GRACE_BEATS = 3
#: A config whose trials keep dying (its process is killed each time) is queued again at most this often.
_RETRIES = 3
#: How often a process that waits for trials running elsewhere looks again, in seconds.
_POLL_S = 0.5
#: The user attribute each trial carries: which host and process measured it.
WORKER_ATTR = "tilegen_worker"
#: The user attribute that names the database a study's trials belong to (Tuner._claim).
_OWNER_ATTR = "tilegen_database"
#: A bucket's winner is timed again, alternately on one GPU, with up to this many rivals measured
#: within CONFIRM_SPREAD of it: one measurement moves by a few percent from one moment (or one
#: GPU of a model) to the next. On two H200s, unconfirmed tunes picked in 1 of 7 buckets a config
#: 2-5% slower than another run's when the two were timed back to back, and confirmation found
#: first measurements up to 12% fast (BENCHMARKS.md). With a 5% spread, a first measurement 10%
#: fast (1.108 ms, 1.22 when timed again) left its rival (1.18) unconfirmed, and the bucket to a
#: config 3.4% slower. One rival within 12%: the lucky first measurements seen (6.5-10% fast) fall
#: inside it, and with two rivals, confirming every bucket took 8.5 s of a 100 s tune.
CONFIRM_RIVALS = 1
CONFIRM_SPREAD = 0.12
CONFIRM_ROUNDS = 3

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialResult:
    """What one config did: status is ok, wrong, compile_error, fault, timeout or infeasible."""

    config: Config
    status: str
    time_ms: float | None = None
    max_error: float | None = None
    reason: str | None = None

    @classmethod
    def from_row(cls, row: TrialRow, config_type: type[Config]) -> TrialResult:
        return cls(config_type.from_dict(row.config), row.status, row.time_ms, row.max_error, row.reason)


@dataclass(frozen=True)
class BucketResult:
    key: TuningKey
    best: TrialResult | None  # the fastest correct config the study has measured, None if none is correct
    tflops: float | None
    gbps: float | None
    statuses: collections.Counter  # status -> configs the study has measured with it (all runs)
    recorded: bool  # False when the database already held a faster config for this key


class Reporter:
    """Progress hooks; this base shows nothing."""

    def start(self, key: TuningKey, budget: int, best: TrialResult | None) -> None:
        """A bucket starts: ``budget`` configs will be measured; ``best`` is from earlier runs."""

    def trial(self, key: TuningKey, result: TrialResult, best: TrialResult | None) -> None:
        """A config was measured, or found infeasible without measuring; ``best`` includes it."""


class Tuner:
    """Tunes buckets one after another with one worker process; use as a context manager.

    Args:
        db: an open ``tilegen.db.TuningDB``; the studies live beside it (in it, on a server).
        device: the device the rows are filed under (``device_info()``).
        sampler: ``"tpe"`` or ``"grid"`` (every feasible config once).
        trials: configs to measure per bucket in this run; ``None`` measures every untried one.
        timeout: seconds per bucket, ``None`` for no limit.
        trial_timeout: seconds one measurement may take (compilation included) before the
            worker is declared hung and replaced.
        warm_start: measure the heuristic default and the neighbouring buckets' best first;
            off, the sampler starts alone (to measure the sampler itself).
        worker: what measures a config: ``measure(task, timeout) -> dict`` and ``close()``;
            a spawned ``tilegen.tuning.worker.Worker`` by default (a replay answers from
            recorded timings instead).
        heartbeat: seconds between a running trial's heartbeats; a trial silent for three
            is failed and measured again by a live process.
        worker_index: this process's place among processes sharing the studies (0 alone);
            it varies the sampler's seed, so parallel workers propose different configs.
        worker_count: how many processes share the studies (``tilegen tune --gpus``): each
            compiles ahead from its own share of a bucket's configs.
        compile_ahead: processes that compile a bucket's configs into Triton's cache while the
            worker measures (``tilegen.tuning.compile_ahead``); ``None`` is its default on a GPU
            (``TILEGEN_COMPILE_AHEAD``, else a share of the host's CPUs), 0 under the interpreter.
            A ``CompileAhead`` (started early, forked) is used as it is, and closed with the tuner.
        confirm: rivals the winner of each bucket this run measured is timed again with,
            alternately on this process's GPU, before its row is stored (``CONFIRM_RIVALS``);
            0 stores the best first measurement. ``None``: the default on a GPU, 0 under the
            interpreter (its wall-clock times rank nothing) and for a worker of another kind.
            Processes sharing the studies confirm the buckets in turn.
        open_studies: open Optuna's storage now (under the studies lock), so a tune's first bucket
            does not wait for it; off for a tuner that only plans and reads results (the parent of
            ``tilegen tune --gpus``), which then holds no lock its tune processes wait on.
    """

    def __init__(
        self, db, device: DeviceInfo, *, sampler: str = "tpe", trials: int | None = None,
        timeout: float | None = None, seed: int = 0, trial_timeout: float = 120.0,
        reporter: Reporter | None = None, warm_start: bool = True, worker=None,
        heartbeat: int = HEARTBEAT_S, worker_index: int = 0, worker_count: int = 1,
        compile_ahead: int | CompileAhead | None = None, confirm: int | None = None, open_studies: bool = True,
    ):
        if not (isinstance(heartbeat, int) and heartbeat > 0):
            raise ValueError(f"heartbeat: expected a positive whole number of seconds, got {heartbeat!r}")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler: expected one of {', '.join(SAMPLERS)}, got {sampler!r}")
        self.db = db
        self.device = device
        self.sampler = sampler
        self.trials = trials
        self.timeout = timeout
        self.seed = seed
        self.trial_timeout = trial_timeout
        self.reporter = reporter or Reporter()
        self.warm_start = warm_start
        self.heartbeat = heartbeat
        self.worker_index = worker_index
        self.worker_count = max(1, worker_count)
        self._label = f"{socket.gethostname()}:{os.getpid()}"
        self._first_trial = True
        self._studies = None
        self._worker = worker or Worker()
        if confirm is None:
            confirm = CONFIRM_RIVALS if isinstance(self._worker, Worker) and not device.is_interpreter else 0
        if isinstance(confirm, bool) or not isinstance(confirm, int) or confirm < 0:
            raise ValueError(f"confirm: expected a whole number of rivals >= 0, got {confirm!r}")
        self.confirm = confirm
        if compile_ahead is not None and not isinstance(compile_ahead, int):
            self._ahead = compile_ahead
        else:
            if device.is_interpreter:
                compile_ahead = 0  # the interpreter compiles nothing
            elif compile_ahead is None:
                # A worker of another kind (a replay of recorded timings) compiles nothing either.
                compile_ahead = default_processes() if isinstance(self._worker, Worker) else 0
            self._ahead = CompileAhead(compile_ahead, after=getattr(self._worker, "cuda_up", None))
        if not device.is_interpreter:
            # Its processes compile for it without starting CUDA; they warm up while the studies open.
            self._ahead.target(device.capability)
        if open_studies:
            self._open_studies()

    def _open_studies(self) -> tuple[optuna.storages.RDBStorage, object]:
        if self._studies is None:
            with self._studies_errors(), self.db.studies_lock():
                try:
                    self._studies = _storage(self.db, self.heartbeat)
                except DatabaseError:
                    raise
                except RuntimeError as e:
                    # Optuna's refusal of a studies schema another Optuna release set up (a newer one, on a disk
                    # machines share), which says which release to install or how to upgrade the file.
                    raise self._studies_error(e) from e
            log.debug("studies storage open")
        return self._studies

    @property
    def _storage(self) -> optuna.storages.RDBStorage:
        return self._open_studies()[0]

    @property
    def _retry(self):
        return self._open_studies()[1]

    def __enter__(self) -> Tuner:
        return self

    def __exit__(self, *exc) -> None:
        self._ahead.close()
        self._worker.close()

    def tune(self, spec: Spec, bucket: int, *, goal: int | None = None) -> BucketResult:
        """Measure configs of ``spec`` at ``bucket`` and store the fastest correct one for dispatch.

        ``goal`` is how many configs the key should have measured when the tune ends, counting
        every process's (``goal()`` gives this run's); processes given one goal share it.
        """
        return self.tune_many(spec, [bucket], goals=None if goal is None else {bucket: goal})[0]

    def tune_many(self, spec: Spec, buckets: list[int], *, goals: dict[int, int] | None = None) -> list[BucketResult]:
        """``tune`` for each bucket, except that waiting for trials other processes still run comes
        last: a process that has nothing left to start in one bucket starts the next one's."""
        return self.tune_jobs([(spec, bucket, None if goals is None else goals.get(bucket)) for bucket in buckets])

    def tune_jobs(self, jobs: list[tuple[Spec, int, int | None]]) -> list[BucketResult]:
        """``tune_many`` over (spec, bucket, goal) jobs of any variants, in order; ``goal`` as
        ``tune`` takes it (``None``: this run's own)."""
        if any(goal is None or goal for _, _, goal in jobs):
            # The measuring child starts now, so its start-up overlaps opening the studies.
            start = getattr(self._worker, "start", None)  # a replay has nothing to start
            if start is not None:
                start()
            self._ahead.start()  # and the compile processes, which the first bucket's configs need
        runs = []
        for spec, bucket, goal in jobs:
            run = self._open(spec, bucket, goal)
            if run.study is not None:
                self._ahead.bucket(run.family, run.problem, run.ahead)
            try:
                self._search(run)
            finally:
                self._ahead.end_bucket()
            if run.study is not None:
                # Read again: another process may have confirmed this bucket meanwhile, and a
                # row from this process's older view would undo its winner.
                run.done = self._measured(run.key, run.family)
            self._record(run)
            runs.append(run)
            # A bucket of this process's share that every process has finished, this one
            # included, is confirmed now, while the others go on measuring, rather than at the
            # end, where a confirmation keeps one GPU busy while the others wait for it.
            for index, earlier in enumerate(runs):
                if self._confirms(index, earlier) and self._complete(earlier):
                    self._confirm(earlier)
        for run in runs:
            if self._finish(run):
                self._record(run)
        for index, run in enumerate(runs):
            # Every bucket is measured to its goal by now, by every process; each confirms its share.
            if self._confirms(index, run):
                self._confirm(run)
        return [self._result(run) for run in runs]

    def _confirms(self, index: int, run: _Run) -> bool:
        """Whether this process confirms the ``index``-th bucket of its jobs and has not yet (without
        confirmation, never: nor does it read the bucket's trials again to find out)."""
        return (bool(self.confirm) and run.study is not None and not run.confirmed
                and index % self.worker_count == self.worker_index % self.worker_count)

    def _complete(self, run: _Run) -> bool:
        """Whether the bucket holds every result it will get (a trial still running elsewhere, or
        one to measure again, leaves it to the end of the tune)."""
        run.done = self._measured(run.key, run.family)
        return run.measured() >= run.goal or not run.untried()

    def goal(self, spec: Spec, bucket: int) -> int:
        """The measured-config count this run aims at for a key: what it holds plus the budget."""
        measured, feasible = self.measured(spec, bucket)
        budget = feasible - measured
        return measured + (budget if self.trials is None else min(self.trials, budget))

    def measured(self, spec: Spec, bucket: int) -> tuple[int, int]:
        """How many of the key's feasible configs have been measured (by any process), and how many there are."""
        family = family_of(spec)
        key = TuningKey.current(spec, self.device, bucket)
        feasible = {c.to_json() for c in family.candidates(spec, self.device)}
        return len(feasible & set(self._measured(key, family))), len(feasible)

    def collect(self, jobs: list[tuple[Spec, int]]) -> list[BucketResult]:
        """Each (spec, bucket)'s result as the database holds it, best recorded for dispatch;
        measures nothing (the parent of ``tilegen tune --gpus`` reports what its workers did)."""
        return self.tune_jobs([(spec, bucket, 0) for spec, bucket in jobs])

    def _open(self, spec: Spec, bucket: int, goal: int | None) -> _Run:
        family = family_of(spec)
        key = TuningKey.current(spec, self.device, bucket)
        problem = family.problem(spec, bucket, on_gpu=not self.device.is_interpreter)
        feasible_configs = family.candidates(spec, self.device)
        if self.sampler == "tpe":
            space = _Knobs(family.config_type, family.search_space(spec, self.device))
        else:
            space = _Choices(feasible_configs)
        run = _Run(key, family, problem, space, feasible_configs, self._measured(key, family))
        run.goal = self.goal(spec, bucket) if goal is None else goal
        budget = max(0, run.goal - run.measured())
        self.reporter.start(key, budget, _best(run.done))
        if budget:
            log.debug("bucket %d: %d configs to measure", bucket, budget)
            with self._studies_errors():
                run.study = self._study(key, space)
                self._reap(run)  # a killed earlier run's trial is measured again first
                warm = self._warm_start(key, family, run.untried()) if space.takes_queue and self.warm_start else []
                for config in warm[:budget]:
                    run.study.enqueue_trial(space.params(config), skip_if_exists=True)
            if self._ahead.processes:
                pending = [c for c in space.order(self.seed, warm or [family.default_config(spec, self.device, bucket)],
                                                  run.untried())
                           if c.to_json() in run.feasible and c.to_json() not in run.done]
                run.ahead = space.share(pending, self.worker_index % self.worker_count, self.worker_count)
        return run

    def _rates(self, run: _Run) -> TrialResult | None:
        """The bucket's best trial in ``run.done`` (as this process last read it), its TFLOP/s and GB/s set on
        ``run``."""
        best = _best(run.done)
        run.tflops = run.problem.flops() / (best.time_ms * 1e9) if best else None
        run.gbps = run.problem.bytes_moved() / (best.time_ms * 1e6) if best else None
        return best

    def _record(self, run: _Run, replace: bool = False) -> None:
        best = self._rates(run)
        if best is not None:
            run.recorded |= self.db.record_best(
                **run.key.fields(), config=best.config.to_dict(), time_ms=best.time_ms, max_error=best.max_error,
                trials=sum(r.status != "infeasible" for r in run.done.values()), tflops=run.tflops, gbps=run.gbps,
                replace=replace,
            )
        dispatch.reset()  # this process's next call reads the new row

    def _confirm(self, run: _Run) -> None:
        """Time the bucket's best config again with its closest rivals, alternately, and store the
        winner of that comparison with its time; the rivals' trials take their new times too, so
        the database's trials name the same winner to anyone who reads them later."""
        run.confirmed = True
        ok = sorted((r for r in run.done.values() if r.status == "ok"), key=lambda r: r.time_ms)
        finalists = [r for r in ok[:1 + self.confirm] if r.time_ms <= ok[0].time_ms * (1 + CONFIRM_SPREAD)]
        if len(finalists) < 2:
            return
        configs = tuple(r.config for r in finalists)
        log.debug("bucket %d: confirming %d configs", run.key.bucket, len(configs))
        task = Compare(run.family, run.problem, configs, self.seed, CONFIRM_ROUNDS)
        answer = self._worker.measure(task, self.trial_timeout * len(configs))
        if answer.get("status") != "ok":
            log.warning("bucket %d: confirming %s failed (%s); keeping the first measurements", run.key.bucket,
                        ", ".join(map(str, configs)), answer.get("reason"))
            return
        # The rows the finalists' results came from (run.done is built from the same mapping).
        rows = self._rows(run.key, run.family)
        for first, again in zip(finalists, answer["times_ms"]):
            row = rows.get(first.config.to_json())
            if row is None or row.status != "ok":
                continue
            self.db.record_trial(
                **run.key.fields(), study_name=row.study_name, trial_number=row.trial_number, config=row.config,
                status="ok", time_ms=again, max_error=row.max_error,
                reason=f"confirmed: median of {CONFIRM_ROUNDS} rounds alternating with "
                       f"{len(finalists) - 1} rival(s); first measured {first.time_ms:.4g} ms",
            )
        log.debug("bucket %d: confirmed %s", run.key.bucket,
                  ", ".join(f"{c} {first.time_ms:.4g} -> {t:.4g} ms" for c, first, t in
                            zip(configs, finalists, answer["times_ms"])))
        run.done = self._measured(run.key, run.family)
        self._record(run, replace=True)

    def _result(self, run: _Run) -> BucketResult:
        # From the trials as last read: another process may have found the best since this one recorded a row.
        best = self._rates(run)
        statuses = collections.Counter(r.status for r in run.done.values())
        return BucketResult(run.key, best, run.tflops, run.gbps, statuses, run.recorded)

    def _study(self, key: TuningKey, space) -> optuna.Study:
        # Choosing the run and creating its study is one step for every process (see studies_lock).
        with self.db.studies_lock(key.study_name):
            study = optuna.create_study(
                storage=self._storage, study_name=self._study_name(key), direction="minimize",
                sampler=space.sampler(self.seed, self.worker_index), load_if_exists=True,
            )
            self._claim(study)
            return study

    def _claim(self, study: optuna.Study) -> None:
        """Mark the study as this database's, or refuse one another database's tunes wrote: two files of one
        stem (``s.sqlite``, ``s.db``) share the studies file ``s.optuna.sqlite``, and one's trials would count
        as the other's, whose tune then skips configs it never measured."""
        if self.db.is_server:
            return  # the studies live in the database itself
        mine = Path(self.db.path).name
        owner = study.user_attrs.get(_OWNER_ATTR)
        if owner is None or (owner != mine and Path(owner).stem != Path(mine).stem):
            # Unmarked (a study from before the mark), or a database renamed with its studies file: this one's.
            with self._studies_errors():
                study.set_user_attr(_OWNER_ATTR, mine)
        elif owner != mine:
            where = self.db.studies_url().removeprefix("sqlite:///")
            raise DatabaseError(f"Optuna studies file {where}: its study {study.study_name} holds the tunes of the "
                                f"database {owner}, not {mine}; databases of one name but for the suffix share a "
                                "studies file: give this database another name")

    def _study_name(self, key: TuningKey) -> str:
        """The study this run adds to: the key's latest one when Optuna still numbers past every trial
        the database holds under it, else a new run, so no trial number is handed out twice."""
        runs = {name: number for name, number in self.db.trial_numbers(key.study_name).items()
                if _run_index(key.study_name, name) is not None}
        if not runs:
            return key.study_name
        latest = max(runs, key=lambda name: _run_index(key.study_name, name))
        try:
            study_id = self._storage.get_study_id_from_name(latest)
        except KeyError:
            numbered = 0
        else:
            numbered = len(self._storage.get_all_trials(study_id, deepcopy=False))
        if numbered > runs[latest]:
            return latest
        return f"{key.study_name}-run{_run_index(key.study_name, latest) + 1}"

    @contextlib.contextmanager
    def _studies_errors(self):
        """Report studies the database cannot hold as the database layer reports its own tables."""
        try:
            yield
        except SQLAlchemyError as e:
            raise self._studies_error(e) from e

    def _studies_error(self, error: BaseException) -> DatabaseError:
        text = " ".join(str(getattr(error, "orig", None) or error).split())
        where = self.db.location if self.db.is_server else self.db.studies_url().removeprefix("sqlite:///")
        return DatabaseError(f"Optuna studies {'in' if self.db.is_server else 'file'} {where}: {text}")

    def _warm_start(self, key: TuningKey, family: Family, untried: list[Config]) -> list[Config]:
        """Untried configs worth measuring first: the heuristic default, then neighbouring buckets' best."""
        rows = dict(self.db.best(**key.variant_fields()))
        seeds = [family.default_config(key.spec, self.device, key.bucket)]
        for _ in range(min(_NEIGHBOURS, len(rows))):  # nearest first, by the family's own rule
            bucket = family.buckets.nearest(key.bucket, rows)
            with contextlib.suppress(ValueError):  # a row from an older config schema
                seeds.append(family.config_type.from_dict(rows[bucket].config))
            del rows[bucket]
        return list(dict.fromkeys(c for c in seeds if c in untried))

    def _search(self, run: _Run) -> None:
        """Run the study until the goal is met, counting the configs other processes are measuring."""
        if run.study is None:
            return
        study, space = run.study, run.space
        rng = random.Random(self.seed if self.worker_index == 0 else f"{self.seed}/{self.worker_index}")

        def objective(trial: optuna.Trial) -> float:
            run.current = trial  # before the label: a write that fails may be the label's
            trial.set_user_attr(WORKER_ATTR, self._label)
            # One process at a time decides what its trial measures, so two never take one config.
            with self.db.studies_lock(run.key.study_name):
                config = space.suggest(trial)
                # Running trials first, then the database: a trial records its result before it
                # leaves RUNNING, so one finishing between the two reads is seen by the second.
                flying = self._in_flight(run, trial)
                run.done = self._measured(run.key, run.family)
                earlier = run.done.get(config.to_json())
                taken = config.to_json() in flying
                spent = run.spent(flying)
                if space.takes_queue and (earlier is not None or taken) and not spent:
                    # The sampler proposed nothing measurable: queue an untried config next, so
                    # every trial of the budget measures something new.
                    left = [c for c in run.untried() if c.to_json() not in flying]
                    if left:
                        study.enqueue_trial(space.params(rng.choice(left)), skip_if_exists=True)
            if earlier is None and (taken or spent):
                if spent or all(c.to_json() in flying for c in run.untried()):
                    study.stop()  # the rest is running elsewhere: proposing more would only spin
                raise optuna.TrialPruned("measured by another process" if taken else "the budget is spent")
            if earlier is None:
                result = run.done[config.to_json()] = self._run_trial(
                    run.key, run.family, run.problem, study.study_name, trial, config)
                self.reporter.trial(run.key, result, _best(run.done))
                if space.takes_queue and result.status == "infeasible":
                    left = [c for c in run.untried() if c.to_json() not in flying]
                    if left:
                        study.enqueue_trial(space.params(rng.choice(left)), skip_if_exists=True)
            else:
                result = earlier
            if result.status == "infeasible":
                raise optuna.TrialPruned(result.reason)
            run.current = None  # finished: an interrupt from here on has nothing of it to queue again
            return result.time_ms if result.status == "ok" else math.inf  # a failed config can never win

        def stop_at_goal(study: optuna.Study, _trial) -> None:
            if run.measured() >= run.goal:
                study.stop()

        budget = max(0, run.goal - run.measured())
        # With TPE each trial that measures nothing queues one that does, so 2 * budget trials
        # suffice; the grid stops itself when exhausted. The bound only guards against another
        # process taking the queued trials.
        run.objective, run.callbacks = objective, [stop_at_goal]
        self._optimize(run, 2 * budget + len(run.untried()), self.timeout)

    def _optimize(self, run: _Run, n_trials: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        left = n_trials
        while left > 0:
            before = len(run.study.get_trials(deepcopy=False))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    run.study.optimize(run.objective, n_trials=left, callbacks=run.callbacks,
                                       timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                return
            except optuna.exceptions.UpdateFinishedTrialError:
                # This process missed its heartbeats (a stalled host) and another one failed its
                # trial as stale; the result is in the database all the same, so carry on.
                left -= max(1, len(run.study.get_trials(deepcopy=False)) - before)
            except KeyboardInterrupt:
                self._requeue_interrupted(run)
                raise
            except Exception as e:
                # A full disk or a lost server, met by Optuna's bookkeeping or ours: one line, and no
                # trial of this process left RUNNING (unlabelled, no later tune could reap it).
                failure = self._storage_failure(e)
                if failure is None:
                    raise
                self._abandon(run)
                raise failure from e

    def _requeue_interrupted(self, run: _Run) -> None:
        """Ctrl-C (or SIGTERM, which ``tilegen tune`` turns into the same, or the parent of a pool
        asking its tune processes to stop: ``tilegen.tuning.pool``) stopped a trial: Optuna failed
        it, and a failed trial is never proposed again (the grid counts its point as visited). Its result never reached the database, so queue its config again, as for a
        trial whose process died: the resumed tune measures it first."""
        trial, run.current = run.current, None
        if trial is None:
            return
        storage = run.study._storage
        frozen = storage.get_trial(trial._trial_id)
        if frozen.state == TrialState.FAIL and frozen.params:
            _requeue_interrupted(run.study, frozen)
            log.debug("trial %d: interrupted; its config is queued again", trial.number)

    def _storage_failure(self, error: BaseException) -> DatabaseError | None:
        """The database problem behind ``error`` (wrapped by Optuna, SQLAlchemy or both) as one line;
        ``None`` when there is none."""
        seen = 0
        while error is not None and seen < 16:
            if isinstance(error, DatabaseError):
                return error
            if isinstance(error, OSError) and error.errno == errno.ENOSPC:
                return DatabaseError(f"no space left on the device{f' for {error.filename}' if error.filename else ''}"
                                     f" (writing {self.db.location} or its studies)")
            if isinstance(error, (SQLAlchemyError, sqlite3.Error)):
                return self._studies_error(error)
            error, seen = error.__cause__ or error.__context__, seen + 1
        return None

    def _abandon(self, run: _Run) -> None:
        """Fail this process's RUNNING trials of the study (the one being created included), as far as
        the storage still takes writes; a labelled one it does not take, a later tune reaps."""
        with contextlib.suppress(Exception):
            storage = run.study._storage
            current = None if run.current is None else run.current._trial_id
            for trial in run.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if trial._trial_id == current or trial.user_attrs.get(WORKER_ATTR) == self._label:
                    with contextlib.suppress(Exception):
                        storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)

    def _finish(self, run: _Run) -> bool:
        """Wait until the trials counted towards the goal have finished, measuring again those whose
        process died; ``True`` when anything was measured here meanwhile."""
        if run.study is None:
            return False
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        measured_here = False
        while deadline is None or time.monotonic() < deadline:
            if self._complete(run):
                break
            with self._studies_errors():
                self._reap(run)
                waiting = len(run.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
                flying = self._in_flight(run, None)
            if waiting:
                self._optimize(run, waiting, None)
                measured_here = True
            elif flying:
                time.sleep(_POLL_S)
            else:
                break  # the sampler is done or the time is up; nobody measures the rest
        run.done = self._measured(run.key, run.family)
        return measured_here

    def _in_flight(self, run: _Run, trial: optuna.Trial | None) -> set[str]:
        """Configs (canonical JSON) that other live processes' trials of the study are measuring now.

        A RUNNING trial without a worker label comes from a tilegen that ran no heartbeats (its
        process is long gone, and nothing will ever finish it), or was just taken from the queue by
        a process that labels it before it decides, under the studies lock, what it measures: that
        process then sees this one's config in flight, so neither holds a config from the other.
        """
        running = run.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        others = (t for t in running if (trial is None or t.number != trial.number) and _alive(t))
        configs = (run.space.config_of(t.params) for t in others)
        return {c.to_json() for c in configs if c is not None}

    def _reap(self, run: _Run) -> None:
        """Fail the study's trials whose process is dead, and queue their configs again.

        Optuna's heartbeat finds a dead process on any host once its grace period passes; a
        process of this host is known dead at once, so a killed tune resumes, and a replaced
        worker carries on, without waiting for that.
        """
        storage = run.study._storage
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(run.study)
        for trial in run.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if WORKER_ATTR not in trial.user_attrs or _alive(trial):
                continue
            try:
                failed = storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                failed = False  # another process failed it first, and queued it
            if failed:
                self._retry(run.study, storage.get_trial(trial._trial_id))

    def _run_trial(
        self, key: TuningKey, family: Family, problem: Problem, study_name: str, trial: optuna.Trial, config: Config
    ) -> TrialResult:
        reason = family.feasible(key.spec, config, self.device)
        if reason is not None:  # rejected before anything compiles
            result = TrialResult(config, "infeasible", reason=reason)
        else:
            task = (family, problem, config, self.seed * 1_000_003 + trial.number)
            if self._first_trial:
                # Later trials find their configs compiled ahead; the first one's compile started
                # with its bucket, while the worker may still be warming up.
                self._first_trial = False
                if self._ahead.wait(config):
                    log.debug("trial %d: compiled ahead", trial.number)
            log.debug("trial %d: measuring %s", trial.number, config)
            result = TrialResult(config, **self._worker.measure(task, self.trial_timeout))
            log.debug("trial %d: %s", trial.number, result.status)
        self.db.record_trial(
            **key.fields(), study_name=study_name, trial_number=trial.number, config=config.to_dict(),
            status=result.status, time_ms=result.time_ms, max_error=result.max_error, reason=result.reason,
        )
        return result

    def _measured(self, key: TuningKey, family: Family) -> dict[str, TrialResult]:
        """Configs the key's studies (every run) have measured, by canonical JSON, from the database: it
        holds every finished trial, even one whose process was killed before Optuna heard of it."""
        rows = self._rows(key, family)
        return {config: TrialResult.from_row(row, family.config_type) for config, row in rows.items()}

    def _rows(self, key: TuningKey, family: Family) -> dict[str, TrialRow]:
        """The key's trial rows (every run) by canonical config JSON; of a config stored twice, the last, a trial
        measured here after one imported (its time may be a confirmation's, newer than the export's)."""
        rows = sorted((r for r in self.db.trials_in_studies(key.study_name)
                       if _run_index(key.study_name, measured_study(r.study_name)) is not None),
                      key=lambda r: r.study_name == measured_study(r.study_name))
        return {family.config_type.from_dict(row.config).to_json(): row for row in rows}


@dataclass(eq=False)
class _Run:
    """One bucket's tune in this process: its study, the goal, and what the key has measured."""

    key: TuningKey
    family: Family
    problem: Problem
    space: object
    configs: list[Config]  # the feasible ones
    done: dict[str, TrialResult]  # every measured config of the key, by canonical JSON
    goal: int = 0
    study: optuna.Study | None = None
    recorded: bool = False
    tflops: float | None = None
    gbps: float | None = None
    objective: object = None
    callbacks: list = field(default_factory=list)
    ahead: list[Config] = field(default_factory=list)  # configs to compile ahead, in order
    confirmed: bool = False
    current: optuna.Trial | None = None  # the trial this process's objective runs, until it returns

    def __post_init__(self):
        self.feasible = {c.to_json() for c in self.configs}

    def measured(self) -> int:
        return len(self.feasible & self.done.keys())

    def untried(self) -> list[Config]:
        return [c for c in self.configs if c.to_json() not in self.done]

    def spent(self, flying: set[str]) -> bool:
        """Whether the configs measured and those in flight elsewhere reach the goal. A trial records
        its result before it leaves RUNNING, so a config can be in both: counting it twice would stop
        the study one config short, and the grid point this trial pruned would never be measured."""
        return len(self.feasible & (self.done.keys() | flying)) >= self.goal


def _retry_callback() -> tuple[str, Callable]:
    """``(argument, callback)``: Optuna's callback that queues a dead process's trial again, at most ``_RETRIES``
    times, without the worker's label, and the ``RDBStorage`` argument that takes it (Optuna 4.9 renamed both)."""
    renamed = "heartbeat_stale_trial_callback" in inspect.signature(optuna.storages.RDBStorage).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback" if renamed else "RetryFailedTrialCallback")
        return ("heartbeat_stale_trial_callback" if renamed else "failed_trial_callback",
                _unlabelled(retry(max_retry=_RETRIES)))


def _storage(db, heartbeat: int) -> tuple[optuna.storages.RDBStorage, object]:
    """Optuna's storage for the database's studies, with heartbeats: a trial of a dead process is
    failed and queued again (same config, same grid point) instead of staying RUNNING."""
    engine = db.studies_engine()
    name, retry = _retry_callback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(
            db.studies_url(), engine_kwargs=engine, heartbeat_interval=heartbeat,
            grace_period=_GRACE_BEATS * heartbeat, **{name: retry},
        )
    beat = storage.record_heartbeat

    def record_heartbeat(trial_id: int) -> None:
        # A beat the storage cannot take (a lost server, a full disk) is missed, not a traceback from
        # Optuna's heartbeat thread: the tune's next write meets the same failure and says it in one line.
        with contextlib.suppress(SQLAlchemyError, optuna.exceptions.StorageInternalError):
            beat(trial_id)

    storage.record_heartbeat = record_heartbeat
    if not db.is_server:
        # Optuna takes a queued trial by reading that it is WAITING and then writing RUNNING, and
        # counts on the read's FOR UPDATE to make the two one step. SQLite's dialect drops FOR
        # UPDATE and its driver begins the transaction only at the write, so two processes could
        # both take one trial and the second's result meet "Cannot tell a COMPLETE trial". The
        # studies' file lock makes the take one step; a server's FOR UPDATE already does.
        set_state = storage.set_trial_state_values

        def set_trial_state_values(trial_id, state, values=None):
            if state != optuna.trial.TrialState.RUNNING:
                return set_state(trial_id, state, values)
            with db.studies_lock():
                return set_state(trial_id, state, values)

        storage.set_trial_state_values = set_trial_state_values
    return storage, retry


def _unlabelled(retry):
    """``retry``, queuing its copy of a failed trial without the worker label. Optuna copies a failed
    trial's user attributes, and the label would name the dead process from the moment a process
    takes the copy until it labels it as its own: any other process reading the trial meanwhile
    would reap it while it is measured, or measure its config beside it."""

    def requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        trial = copy.copy(trial)
        trial.user_attrs = _unlabelled_attrs(trial)
        retry(study, trial)

    return requeue


def _unlabelled_attrs(trial: optuna.trial.FrozenTrial) -> dict:
    """A trial's user attributes but the worker label, for a queued copy of it."""
    return {name: value for name, value in trial.user_attrs.items() if name != WORKER_ATTR}


class _Knobs:
    """TPE's space: one ordinal per knob (the index into its sorted values), so the sampler
    learns which region of each knob wins and that neighbouring values behave alike."""

    takes_queue = True  # warm starts and untried configs can be enqueued

    def __init__(self, config_type: type[Config], space: dict[str, list[int]]):
        self.config_type = config_type
        self.space = {name: sorted(values) for name, values in space.items()}

    def sampler(self, seed: int, worker_index: int = 0) -> optuna.samplers.BaseSampler:
        # Three random trials before modelling, because with ~30 configs a longer random start is
        # most of the budget. Replaying an H200 grid (d128 causal at 1k, 4k and 16k, 20 seeds, no
        # warm start), ordinal knobs sampled independently came within 3% of the best in a median
        # of 7, 8 and 6.5 trials; sampled jointly (Optuna 5's default) 7, 11 and 8; one categorical
        # per knob, jointly, 7.5, 12.5 and 9; with Optuna's default 10 random trials, 9.5, 10 and 6.5.
        # constant_liar: a trial another process is running counts as a poor result, so parallel
        # workers spread out; alone, no other trial runs while one samples, so nothing changes.
        return optuna.samplers.TPESampler(seed=seed + worker_index, n_startup_trials=3, multivariate=False,
                                          constant_liar=True)

    @staticmethod
    def order(seed: int, first: list[Config], untried: list[Config]) -> list[Config]:
        """The configs in the order the sampler likely asks for them: the warm start (the default
        leads it), then the rest."""
        return list(dict.fromkeys([*first, *untried]))

    @staticmethod
    def share(pending: list[Config], index: int, count: int) -> list[Config]:
        # Processes sharing a TPE study draw its configs in no set order, and share Triton's disk
        # cache: each starts compiling at its own share of the list, so together they cover it
        # sooner than all in one order.
        cut = len(pending) * index // count
        return pending[cut:] + pending[:cut]

    # Parameter names of their own: a study made when the knobs were categorical by value keeps
    # those names, and Optuna refuses a second distribution under a name it already knows.
    def suggest(self, trial: optuna.Trial) -> Config:
        return self.config_type(**{name: values[trial.suggest_int(f"{name}_index", 0, len(values) - 1)]
                                   for name, values in self.space.items()})

    def params(self, config: Config) -> dict[str, int]:
        return {f"{name}_index": values.index(getattr(config, name)) for name, values in self.space.items()}

    def config_of(self, params: dict) -> Config | None:
        """The config a trial's parameters name; ``None`` before it has them all."""
        try:
            return self.config_type(**{name: values[params[f"{name}_index"]] for name, values in self.space.items()})
        except (KeyError, IndexError, ValueError, TypeError):
            return None


class _Choices:
    """The grid's space: one categorical over the feasible configs (by canonical JSON, their
    identity), so infeasible ones are never proposed."""

    # GridSampler assigns every point itself (and Optuna 5.0's GridSampler.after_trial, which
    # _Grid leaves out, raised KeyError('grid_id') on an enqueued trial); an exhaustive search
    # needs no warm start anyway.
    takes_queue = False
    # Not "config", which studies of earlier tilegen releases hold with labels as values.
    _PARAM = "config_json"

    def __init__(self, configs: list[Config]):
        self.by_json = {c.to_json(): c for c in configs}

    def sampler(self, seed: int, worker_index: int = 0) -> optuna.samplers.BaseSampler:
        # One seed for every worker: it orders the grid, and grid point k must be one config for all.
        return _Grid({self._PARAM: list(self.by_json)}, seed=seed)

    def order(self, seed: int, first: list[Config], untried: list[Config]) -> list[Config]:
        """The configs in the order the sampler hands them out. Since Optuna 3.4, GridSampler gives
        trial k grid point k of its grid shuffled once by the seed (a numpy ``RandomState``, whose
        stream numpy keeps fixed), whichever process runs the trial; the warm start does not apply."""
        grid = [(j,) for j in self.by_json]  # the sampler's grid points: one-parameter tuples
        numpy.random.RandomState(seed or 0).shuffle(grid)
        left = {c.to_json() for c in untried}
        return [self.by_json[j] for (j,) in grid if j in left]

    @staticmethod
    def share(pending: list[Config], index: int, count: int) -> list[Config]:
        # The processes take trials in turn, so the grid's order comes due about `count` at a time:
        # each pool compiles every count-th config first, and the pools together follow the order.
        return pending[index::count] + [c for i, c in enumerate(pending) if i % count != index]

    def suggest(self, trial: optuna.Trial) -> Config:
        return self.by_json[trial.suggest_categorical(self._PARAM, list(self.by_json))]

    def params(self, config: Config) -> dict[str, str]:
        return {self._PARAM: config.to_json()}

    def config_of(self, params: dict) -> Config | None:
        return self.by_json.get(params.get(self._PARAM))


class _Grid(optuna.samplers.GridSampler):
    """Optuna's grid sampler, less its check after every trial for an exhausted grid. The check
    reads every trial of the study each time, so its cost grows with the grid (with it a trial's
    bookkeeping took 32 ms against 30 on SQLite, for 60-config grids: ``tilegen.bench.bookkeeping``
    on the 2-CPU CI machine), and the tuner stops each study at its goal itself."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


def _alive(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether the process a trial's worker label names may still run it (another host's always may)."""
    label = trial.user_attrs.get(WORKER_ATTR)
    if label is None:
        return False
    host, _, pid = label.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _requeue_interrupted(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
    """Queue again the config of ``frozen``, a trial an interrupt stopped, as Optuna's retry callback queues a dead
    process's trial (params, grid point and other system attributes copied; the worker label dropped, as
    ``_unlabelled`` drops it), but without counting it: the callback's retry history, which gives a config up after
    ``_RETRIES`` runs, is for runs whose process died (a fourth Ctrl-C of one trial dropped its config)."""
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.WAITING, params=frozen.params, distributions=frozen.distributions,
        user_attrs=_unlabelled_attrs(frozen),
        system_attrs={"failed_trial": frozen.number, **frozen.system_attrs}))


def _run_index(base: str, name: str) -> int | None:
    """1 for the key's first study ``base``, k for ``base-run<k>``, None for another key's (and for one an import
    filed, ``tilegen.db.IMPORTED`` after a run's name: no tune writes to it)."""
    if name == base:
        return 1
    suffix = name[len(base):] if name.startswith(base) else ""
    if suffix.startswith("-run") and suffix[4:].isdigit():
        return int(suffix[4:])
    return None


def _best(done: dict[str, TrialResult]) -> TrialResult | None:
    ok = [r for r in done.values() if r.status == "ok"]
    return min(ok, key=lambda r: r.time_ms) if ok else None
