"""Choosing a config for a call, for every family: tuned table in memory, nearest bucket, heuristic default.

The first call for a (spec, device) pair loads the tuned rows that apply to it (this
GPU, this Triton, this template) from the user's database and then the shipped one;
every later call is a dictionary lookup. The family's bucket rule maps a call's size (one
int, or the pair a two-size family buckets: decode's ``(context, batch)``) to a bucket;
the exact bucket is used when tuned, else the nearest tuned one
(``tilegen.families.buckets``). With no tuned row at all, the family's heuristic default
for the bucket is used and one log line names the ``tilegen tune`` command that would
tune this variant.

Each op keeps its checked per-call plans in a ``plan_cache()``; ``reset`` empties every
one together with the tables, so a plan never outlives the table it was made from.

A tuned row can still fail where its feasibility check passed (a compiler that rejects
the config, an imported row from another setup): ``Table.run`` launches a tuned config
and, if it fails, skips that row with one warning and runs the next choice, down to the
default, so one bad row never takes an op down.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tilegen.codegen import module_for
from tilegen.device import DeviceInfo, device_info
from tilegen.families import Buckets, Config, family_of
from tilegen.ir import Spec
from tilegen.key import TuningKey
from tilegen.triton_internals.launch import Launcher

__all__ = ["Choice", "Table", "PlanCache", "launcher_for", "plan_cache", "table_for", "reset", "tune_command"]

_warned: set[str] = set()

log = logging.getLogger("tilegen.dispatch")


@dataclass(frozen=True)
class Choice:
    """What a call ran with and why: the answer of ``tilegen.explain``."""

    config: Config
    source: str  # "default" or the database file the row came from
    bucket: int  # the call's bucket
    tuned_bucket: int | None  # the bucket of the tuned row used, None for the default
    rule: Buckets | None = field(default=None, compare=False)  # the family's, to show what a bucket means

    def __repr__(self) -> str:
        def shown(bucket: int | None) -> str:
            label = None if bucket is None or self.rule is None else self.rule.label(bucket)
            # A packed bucket (decode's context x batch) says what it holds; a plain one is its own label.
            return f"{bucket}" if label in (None, str(bucket)) else f"{bucket} ({label})"

        return (f"Choice(config={self.config!r}, source={self.source!r}, bucket={shown(self.bucket)}, "
                f"tuned_bucket={shown(self.tuned_bucket)})")


class Table:
    """Tuned configs of one spec on one device, keyed by bucket; memoizes each bucket's choice."""

    def __init__(self, spec: Spec, device: DeviceInfo, rows: dict[int, tuple[Config, str]]):
        self.spec = spec
        self.device = device
        self.family = family_of(spec)
        self.rows = dict(rows)
        self._choices: dict[int, Choice] = {}
        self.launch = module_for(spec).launch

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
        return Choice(config, source, bucket, nearest, self.family.buckets)

    def run(self, size: int | tuple[int, int], launch: Callable[[Config], Any]) -> tuple[Choice, Any]:
        """``launch(config)`` with the choice for ``size``; a tuned row that fails is skipped for good
        (one warning) and the next choice runs, down to the default, whose failure is raised."""
        while True:
            choice = self.choose(size)
            try:
                return choice, launch(choice.config)
            except Exception as error:  # any failure of a stored row: the default must still run
                if choice.tuned_bucket is None:
                    raise
                self.skip(choice, error)

    def skip(self, choice: Choice, error: BaseException) -> None:
        """Forget the tuned row behind ``choice``: it failed to compile or launch here."""
        self.rows.pop(choice.tuned_bucket, None)
        self._choices.clear()
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        message = (
            f"tilegen: skipping the tuned config {choice.config} of {self.spec.name} "
            f"(bucket {self.family.buckets.label(choice.tuned_bucket)}) "
            f"from {choice.source}: it failed here ({type(error).__name__}: {reason}). `tilegen db verify` checks "
            f"every row"
        )
        if message not in _warned:
            _warned.add(message)
            log.warning(message)


def tune_command(spec: Spec, bucket: int) -> str:
    return f"tilegen tune --spec '{spec.to_json()}' {family_of(spec).buckets.cli_args(bucket)}"


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
    """The ``Launcher`` of ``spec``'s generated module (one per process)."""
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
