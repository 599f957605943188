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
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import math
import random
from dataclasses import dataclass
from pathlib import Path

import optuna
from sqlalchemy.exc import SQLAlchemyError

from tilegen import dispatch
from tilegen.db import DatabaseError, TrialRow, studies_url
from tilegen.device import DeviceInfo
from tilegen.families import Config, Family, Problem, family_of
from tilegen.ir import Spec
from tilegen.key import TuningKey
from tilegen.tuning.worker import Worker

__all__ = ["SAMPLERS", "TrialResult", "BucketResult", "Reporter", "Tuner"]

SAMPLERS = ("tpe", "grid")
#: Best configs of this many other buckets seed a study, nearest length first.
_NEIGHBOURS = 3
#: How long a write to the studies file waits while another tune process writes (SQLite's busy timeout).
_SQLITE_TIMEOUT_S = 60


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
        db: an open ``tilegen.db.TuningDB``; the studies live beside it.
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
    """

    def __init__(
        self, db, device: DeviceInfo, *, sampler: str = "tpe", trials: int | None = None,
        timeout: float | None = None, seed: int = 0, trial_timeout: float = 120.0,
        reporter: Reporter | None = None, warm_start: bool = True, worker=None,
    ):
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
        url = studies_url(db.path)
        self._studies_path = Path(url.removeprefix("sqlite:///"))
        with self._studies_errors(), self._studies_lock():
            self._storage = optuna.storages.RDBStorage(
                url, engine_kwargs={"connect_args": {"timeout": _SQLITE_TIMEOUT_S}}
            )
        self._worker = worker or Worker()

    def __enter__(self) -> Tuner:
        return self

    def __exit__(self, *exc) -> None:
        self._worker.close()

    def tune(self, spec: Spec, bucket: int) -> BucketResult:
        """Measure configs of ``spec`` at ``bucket`` and store the fastest correct one for dispatch."""
        family = family_of(spec)
        key = TuningKey.current(spec, self.device, bucket)
        problem = family.problem(spec, bucket, on_gpu=not self.device.is_interpreter)
        feasible_configs = family.candidates(spec, self.device)
        if self.sampler == "tpe":
            space = _Knobs(family.config_type, family.search_space(spec, self.device))
        else:
            space = _Choices(feasible_configs)
        done = self._measured(key, family)
        untried = [c for c in feasible_configs if c.to_json() not in done]
        budget = len(untried) if self.trials is None else min(self.trials, len(untried))
        self.reporter.start(key, budget, _best(done))
        if budget:
            with self._studies_errors():
                study = self._study(key, space)
                if space.takes_queue and self.warm_start:
                    for config in self._warm_start(key, family, untried)[:budget]:
                        study.enqueue_trial(space.params(config), skip_if_exists=True)
                self._optimize(study, space, key, family, problem, done, untried, budget)

        best = _best(done)
        tflops = problem.flops() / (best.time_ms * 1e9) if best else None
        gbps = problem.bytes_moved() / (best.time_ms * 1e6) if best else None
        recorded = best is not None and self.db.record_best(
            **key.fields(), config=best.config.to_dict(), time_ms=best.time_ms, max_error=best.max_error,
            trials=sum(r.status != "infeasible" for r in done.values()), tflops=tflops, gbps=gbps,
        )
        dispatch.reset()  # this process's next call reads the new row
        return BucketResult(key, best, tflops, gbps, collections.Counter(r.status for r in done.values()), recorded)

    def _study(self, key: TuningKey, space) -> optuna.Study:
        with self._studies_lock():
            return optuna.create_study(
                storage=self._storage, study_name=self._study_name(key), direction="minimize",
                sampler=space.sampler(self.seed), load_if_exists=True,
            )

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
    def _studies_lock(self):
        # Optuna creates its tables and studies with check-then-create; two tune processes
        # opening one fresh file race on that, so creation is serialized across processes.
        lock = self._studies_path.with_name(self._studies_path.name + ".lock")
        lock.parent.mkdir(parents=True, exist_ok=True)
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    @contextlib.contextmanager
    def _studies_errors(self):
        """Report a studies file SQLite cannot use as the database layer reports its own files."""
        try:
            yield
        except SQLAlchemyError as e:
            text = str(getattr(e, "orig", None) or e).splitlines()[0]
            raise DatabaseError(f"Optuna studies file {self._studies_path}: {text}") from e

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

    def _optimize(self, study, space, key, family, problem, done, untried, budget) -> None:
        rng = random.Random(self.seed)
        measured = 0

        def objective(trial: optuna.Trial) -> float:
            nonlocal measured
            config = space.suggest(trial)
            earlier = done.get(config.to_json())
            if earlier is None:
                result = done[config.to_json()] = self._run_trial(
                    key, family, problem, study.study_name, trial, config)
                measured += result.status != "infeasible"
                self.reporter.trial(key, result, _best(done))
            else:
                result = earlier
            if space.takes_queue and (earlier is not None or result.status == "infeasible"):
                # The sampler proposed nothing measurable: queue an untried config next, so
                # every trial of the budget measures something new.
                left = [c for c in untried if c.to_json() not in done]
                if left:
                    study.enqueue_trial(space.params(rng.choice(left)), skip_if_exists=True)
            if result.status == "infeasible":
                raise optuna.TrialPruned(result.reason)
            return result.time_ms if result.status == "ok" else math.inf  # a failed config can never win

        def stop_at_budget(study: optuna.Study, _trial) -> None:
            if measured >= budget:
                study.stop()

        # With TPE each trial that measures nothing queues one that does, so 2 * budget trials
        # suffice; the grid stops itself when exhausted. The bound only guards against another
        # process taking the queued trials.
        study.optimize(objective, n_trials=2 * budget + len(untried), timeout=self.timeout, callbacks=[stop_at_budget])

    def _run_trial(
        self, key: TuningKey, family: Family, problem: Problem, study_name: str, trial: optuna.Trial, config: Config
    ) -> TrialResult:
        reason = family.feasible(key.spec, config, self.device)
        if reason is not None:  # rejected before anything compiles
            result = TrialResult(config, "infeasible", reason=reason)
        else:
            task = (family, problem, config, self.seed * 1_000_003 + trial.number)
            result = TrialResult(config, **self._worker.measure(task, self.trial_timeout))
        self.db.record_trial(
            **key.fields(), study_name=study_name, trial_number=trial.number, config=config.to_dict(),
            status=result.status, time_ms=result.time_ms, max_error=result.max_error, reason=result.reason,
        )
        return result

    def _measured(self, key: TuningKey, family: Family) -> dict[str, TrialResult]:
        """Configs the key's studies (every run) have measured, by canonical JSON, from the database: it
        holds every finished trial, even one whose process was killed before Optuna heard of it."""
        rows = [r for r in self.db.trials_for(key.spec.hash) if _run_index(key.study_name, r.study_name) is not None]
        results = (TrialResult.from_row(row, family.config_type) for row in rows)
        return {result.config.to_json(): result for result in results}


class _Knobs:
    """TPE's space: one ordinal per knob (the index into its sorted values), so the sampler
    learns which region of each knob wins and that neighbouring values behave alike."""

    takes_queue = True  # warm starts and untried configs can be enqueued

    def __init__(self, config_type: type[Config], space: dict[str, list[int]]):
        self.config_type = config_type
        self.space = {name: sorted(values) for name, values in space.items()}

    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        # Three random trials before modelling, because with ~30 configs a longer random start is
        # most of the budget. Replaying an H200 grid (d128 causal at 1k, 4k and 16k, 20 seeds, no
        # warm start), ordinal knobs sampled independently came within 3% of the best in a median
        # of 7, 8 and 6.5 trials; sampled jointly (Optuna 5's default) 7, 11 and 8; one categorical
        # per knob, jointly, 7.5, 12.5 and 9; with Optuna's default 10 random trials, 9.5, 10 and 6.5.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=3, multivariate=False)

    # Parameter names of their own: a study made when the knobs were categorical by value keeps
    # those names, and Optuna refuses a second distribution under a name it already knows.
    def suggest(self, trial: optuna.Trial) -> Config:
        return self.config_type(**{name: values[trial.suggest_int(f"{name}_index", 0, len(values) - 1)]
                                   for name, values in self.space.items()})

    def params(self, config: Config) -> dict[str, int]:
        return {f"{name}_index": values.index(getattr(config, name)) for name, values in self.space.items()}


class _Choices:
    """The grid's space: one categorical over the feasible configs (by canonical JSON, their
    identity), so infeasible ones are never proposed."""

    # GridSampler assigns every point itself, and Optuna 5.0's GridSampler.after_trial raises
    # KeyError('grid_id') on an enqueued trial; an exhaustive search needs no warm start anyway.
    takes_queue = False
    # Not "config", which studies of earlier tilegen releases hold with labels as values.
    _PARAM = "config_json"

    def __init__(self, configs: list[Config]):
        self.by_json = {c.to_json(): c for c in configs}

    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.GridSampler({self._PARAM: list(self.by_json)}, seed=seed)

    def suggest(self, trial: optuna.Trial) -> Config:
        return self.by_json[trial.suggest_categorical(self._PARAM, list(self.by_json))]

    def params(self, config: Config) -> dict[str, str]:
        return {self._PARAM: config.to_json()}


def _run_index(base: str, name: str) -> int | None:
    """1 for the key's first study ``base``, k for ``base-run<k>``, None for another key's."""
    if name == base:
        return 1
    suffix = name[len(base):] if name.startswith(base) else ""
    if suffix.startswith("-run") and suffix[4:].isdigit():
        return int(suffix[4:])
    return None


def _best(done: dict[str, TrialResult]) -> TrialResult | None:
    ok = [r for r in done.values() if r.status == "ok"]
    return min(ok, key=lambda r: r.time_ms) if ok else None
