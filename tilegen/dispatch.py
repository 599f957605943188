"""Choosing a config for a call, for every family: tuned table in memory, nearest bucket, heuristic default.

The first call for a (spec, device) pair loads the tuned rows that apply to it (this
GPU, this template; this Triton's, else, for a bucket it has none for, the nearest Triton
version's that this one can run: ``tilegen.db.lookup``) from the user's database and then
the shipped one; every later call is a dictionary lookup. The family's bucket rule maps a
call's size (one int, or the pair a two-size family buckets: decode's ``(context, batch)``) to a bucket;
the exact bucket is used when tuned, else the nearest tuned one
(``tilegen.families.buckets``). With no tuned row at all, the family's heuristic default
for the bucket is used and one log line names the ``tilegen tune`` command that would
tune this variant.

Each op keeps its checked per-call plans in a ``plan_cache()``; ``reset`` empties every
one together with the tables, so a plan never outlives the table it was made from.

Every op launches the same way: choose -> launcher -> replay. ``planned(table, size, make)``
chooses the config for the call's size and has the op make its plan for that choice
(``make(choice)``): the checked launch values and ``launch(key, *args)``, a
``Launcher.replay`` of the spec's generated launcher (``launcher_for``) with those values as
keywords. ``key`` is what the launcher reads besides the plan (the tensors' strides: the plan
fixes the shapes, dtypes and scalars), and repeated calls replay the recorded kernel launches.

A tuned row can still fail where its feasibility check passed (a compiler that rejects
the config, an imported row from another setup). So while a plan's choice is a tuned row,
its first launch goes through ``Table.run``: a row that fails to compile or launch is
skipped for good with one warning, the plan is made again for the next choice (another
tuned bucket, else the default, whose failure is raised) and that launch runs; then the
plan launches its replay directly. One bad row never takes an op down, and a plan made for
the default pays nothing for it. The tuner measures through the same launchers
(``tilegen.tuning.measure``), so what is tuned is what runs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from tilegen.codegen import module_for
from tilegen.device import DeviceInfo, device_info
from tilegen.families import Buckets, Config, family_of
from tilegen.ir import Spec
from tilegen.key import TuningKey
from tilegen.triton_internals.launch import Launcher

__all__ = ["Choice", "PlanCache", "Table", "launcher_for", "plan_cache", "planned", "reset", "table_for", "table_on",
           "tune_command"]

_warned: set[str] = set()

P = TypeVar("P")

log = logging.getLogger("tilegen.dispatch")


@dataclass(frozen=True)
class Choice:
    """What a call ran with and why: the answer of ``tilegen.explain``."""

    config: Config
    source: str  # "default" or the database file the row came from
    bucket: int  # the call's bucket
    tuned_bucket: int | None  # the bucket of the tuned row used, None for the default
    rule: Buckets | None = field(default=None, compare=False)  # the family's, to show what a bucket means
    tuned_under: str | None = None  # the Triton version of a row served for want of the installed one's
    installed_triton: str | None = field(default=None, compare=False)  # the version the rows were chosen for
    tuned_for: str | None = None  # the spec a row served from another spec of the family was tuned for

    @property
    def note(self) -> str | None:
        """What a user should know about where the config came from: a row of another Triton or another spec
        (``Family.rows_from``) says so."""
        from tilegen.db.lookup import row_note  # explain's, never a call's: the database layer loads lazily

        return row_note(self.tuned_for, self.tuned_under, self.installed_triton)

    def __repr__(self) -> str:
        def shown(bucket: int | None) -> str:
            label = None if bucket is None or self.rule is None else self.rule.label(bucket)
            # A packed bucket (decode's context x batch) says what it holds; a plain one is its own label.
            return f"{bucket}" if label in (None, str(bucket)) else f"{bucket} ({label})"

        note = "" if self.note is None else f", note={self.note!r}"
        return (f"Choice(config={self.config!r}, source={self.source!r}, bucket={shown(self.bucket)}, "
                f"tuned_bucket={shown(self.tuned_bucket)}{note})")


class Table:
    """Tuned configs of one spec on one device, keyed by bucket; memoizes each bucket's choice."""

    def __init__(self, spec: Spec, device: DeviceInfo, rows: dict[int, tuple[Config, str]]):
        self.spec = spec
        self.device = device
        self.family = family_of(spec)
        self.rows = dict(rows)
        # ``tuned_rows`` says which rows another Triton tuned (a plain dict of rows has none).
        self.tuned_under: dict[int, str] = dict(getattr(rows, "tuned_under", {}))
        self.triton_version: str | None = getattr(rows, "triton_version", None)
        self.tuned_for: dict[int, str] = dict(getattr(rows, "tuned_for", {}))
        self._choices: dict[int, Choice] = {}

    def choose(self, size: int | tuple[int, int]) -> Choice:
        """The choice for a call of ``size`` (what the family buckets: the longer sequence, say, or
        decode's ``(max context, batch)``)."""
        bucket = self.family.buckets.of(size)
        choice = self._choices.get(bucket)
        if choice is None:
            choice = self._choices[bucket] = self._resolve(bucket)
        return choice

    def _resolve(self, bucket: int) -> Choice:
        if not self.rows:
            default = self.family.default_config(self.spec, self.device, bucket)
            if not self._choices:  # one line per table, not per bucket
                log.info(
                    "tilegen: no tuned config for %s on %s; using the default %s. Tune it with: %s",
                    self.spec.name, self.device.key, default, tune_command(self.spec, bucket),
                )
            return Choice(default, "default", bucket, None, self.family.buckets)
        nearest = self.family.buckets.nearest(bucket, self.rows)
        config, source = self.rows[nearest]
        return Choice(config, source, bucket, nearest, self.family.buckets, self.tuned_under.get(nearest),
                      self.triton_version, self.tuned_for.get(nearest))

    def run(self, size: int | tuple[int, int], launch: Callable[[Choice], Any]) -> tuple[Choice, Any]:
        """``launch(choice)`` with the choice for ``size``; a tuned row that fails is skipped for good
        (one warning) and the next choice runs, down to the default, whose failure is raised."""
        while True:
            choice = self.choose(size)
            try:
                return choice, launch(choice)
            except Exception as error:  # any failure of a stored row: the default must still run
                if choice.tuned_bucket is None:
                    raise
                self.skip(choice, error)

    def skip(self, choice: Choice, error: BaseException) -> None:
        """Forget the tuned row behind ``choice``: it failed to compile or launch here."""
        self.rows.pop(choice.tuned_bucket, None)
        self.tuned_under.pop(choice.tuned_bucket, None)
        self.tuned_for.pop(choice.tuned_bucket, None)
        self._choices.clear()
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        message = (
            f"tilegen: skipping the tuned config {choice.config} of {self.spec.name} "
            f"(bucket {self.family.buckets.label(choice.tuned_bucket)}) "
            f"from {choice.source}{f' ({choice.note})' if choice.note else ''}: "
            f"it failed here ({type(error).__name__}: {reason}). `tilegen db verify` checks "
            f"every row"
        )
        if message not in _warned:
            _warned.add(message)
            log.warning(message)


def tune_command(spec: Spec, bucket: int) -> str:
    """The command that tunes ``spec`` at ``bucket``. A mod is named by its import path (a trial needs the function),
    which only the caller knows: the command takes the spec without it and says where the path goes. A spec the
    tuner does not measure (a ragged backward) is served the rows of its family's ``rows_from``: the command tunes
    that spec."""
    family = family_of(spec)
    kin = family.rows_from(spec) if family.rows_from is not None else ()
    if kin:
        try:
            family.problem_type.for_bucket(spec, bucket, on_gpu=False)
        except NotImplementedError:
            spec = kin[0]
    mods = [kind for kind in ("score_mod", "mask_mod") if getattr(spec, kind, None) is not None]
    base = spec.replace(**dict.fromkeys(mods)) if mods else spec
    options = "".join(f" --{kind.replace('_', '-')} PKG.MODULE:FUNCTION" for kind in mods)
    return f"tilegen tune --spec '{base.to_json()}'{options} {family_of(spec).buckets.cli_args(bucket)}"


class PlanCache(dict):
    """An op's checked plans by call signature; ``put`` keeps it bounded (varying sizes would grow it)."""

    limit = 4096

    def put(self, key: Any, plan: Any) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan


_plan_caches: list[PlanCache] = []
_tables: dict[tuple[Spec, DeviceInfo], Table] = {}


@functools.cache
def launcher_for(spec: Spec) -> Launcher:
    """The ``Launcher`` of ``spec``'s generated module (one per process), made at an op's first plan
    or a tuning trial: a ``Table`` holds none, so choosing a config renders and imports nothing."""
    return Launcher(module_for(spec))


def table_for(spec: Spec, device: DeviceInfo) -> Table:
    key = (spec, device)
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = Table(spec, device, _load_rows(spec, device))
    return table


def table_on(spec: Spec, device) -> Table:
    """The spec's table for the GPU (or the interpreter) that a ``torch.device`` names."""
    return table_for(spec, device_info(device.index if device.type == "cuda" else None))


def planned(table: Table, size: int | tuple[int, int], make: Callable[[Choice], P], *, fallback: bool = True) -> P:
    """An op's plan for a call of ``size``: ``make(choice)`` with ``table``'s choice for it.

    The plan is a dataclass (frozen or not) with a ``launch(key, *args)`` field, usually
    ``launcher_for(spec).replay(launch values)``; ``make`` builds every field that depends on
    the config, so that a plan can be made again for another choice. While the choice is a
    tuned row, the plan's first launch falls back (``_FirstLaunch``). ``fallback=False`` leaves
    that out, for a launch that cannot be run again once it has failed part way: the error is
    raised, as for the default's.
    """
    choice = table.choose(size)
    plan = make(choice)
    if fallback and choice.tuned_bucket is not None:
        object.__setattr__(plan, "launch", _FirstLaunch(table, size, make, choice, plan))
    return plan


class _FirstLaunch:
    """A plan's ``launch`` until its tuned row has launched here once.

    The call goes through ``Table.run``. If the row fails (skipped with one warning), the plan is
    made again for the next choice and launched with the same arguments, except that the failed
    plan's own tensors among them (``PagedDecode``'s split partials, sized for its config)
    become the new plan's. The plan, which caches and planners hold, then takes the new
    plan's fields in place. Either way its ``launch`` is the replay from then on: later calls
    pay nothing for the fallback.
    """

    __slots__ = ("choice", "launch", "make", "plan", "size", "table")

    def __init__(self, table: Table, size, make: Callable[[Choice], Any], choice: Choice, plan: Any):
        self.table, self.size, self.make, self.choice, self.plan = table, size, make, choice, plan
        self.launch = plan.launch

    def __call__(self, key, *args) -> None:
        plan = self.plan
        owned = {id(value): f.name for f in dataclasses.fields(plan)
                 if isinstance(value := getattr(plan, f.name), torch.Tensor)}

        def attempt(choice: Choice):
            if choice == self.choice:
                self.launch(key, *args)
                return None
            made = self.make(choice)
            made.launch(key, *[getattr(made, owned[id(a)]) if id(a) in owned else a for a in args])
            return made

        _, made = self.table.run(self.size, attempt)
        if made is None:
            object.__setattr__(plan, "launch", self.launch)
        else:
            for f in dataclasses.fields(plan):
                object.__setattr__(plan, f.name, getattr(made, f.name))


def plan_cache() -> PlanCache:
    """A plan cache for one op, emptied by ``reset``."""
    cache = PlanCache()
    _plan_caches.append(cache)
    return cache


def reset() -> None:
    """Forget loaded tables and plans, so the next call reads the databases again (after a tune, say)."""
    _tables.clear()
    for cache in _plan_caches:
        cache.clear()


def _load_rows(spec: Spec, device: DeviceInfo) -> dict[int, tuple[Config, str]]:
    from tilegen.db.lookup import tuned_rows  # once per table, never per call

    return tuned_rows(**TuningKey.current(spec, device).variant_fields())
