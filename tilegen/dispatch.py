"""Choosing a config for a call: tuned table in memory, nearest bucket, heuristic fallback.

The first call for a (spec, device) pair loads the tuned rows that apply to it (this
GPU, this Triton, this template) from the user's database and then the shipped one;
every later call is a dictionary lookup. Nearest-bucket rule: a call is bucketed by
``max(n_q, n_k)`` rounded up to a power of two; the exact bucket is used when tuned,
else the tuned bucket nearest in log2 distance, the larger one on a tie. With no
tuned row at all, the heuristic default for the bucket is used and one log line names the
``tilegen tune`` command that would tune this variant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tilegen.codegen import attention_fwd, module_for
from tilegen.device import DeviceInfo
from tilegen.ir import AttentionSpec
from tilegen.key import TuningKey

__all__ = ["Choice", "Table", "bucket_of", "table_for", "reset"]

log = logging.getLogger("tilegen.dispatch")

MIN_BUCKET = 16


def bucket_of(n: int) -> int:
    """Sequence-length bucket: the next power of two, at least ``MIN_BUCKET``."""
    return max(MIN_BUCKET, 1 << (int(n) - 1).bit_length())


@dataclass(frozen=True)
class Choice:
    """What a call ran with and why: the answer of ``tilegen.explain``."""

    config: attention_fwd.Config
    source: str  # "default" or the database file the row came from
    bucket: int  # the call's bucket
    tuned_bucket: int | None  # the bucket of the tuned row used, None for the default


class Table:
    """Tuned configs of one spec on one device, keyed by bucket; memoizes each bucket's choice."""

    def __init__(self, spec: AttentionSpec, device: DeviceInfo, rows: dict[int, tuple[attention_fwd.Config, str]]):
        self.spec = spec
        self.device = device
        self.rows = dict(rows)
        self._choices: dict[int, Choice] = {}
        self.launch = module_for(spec).launch
        self.stale = False  # set by reset(): holders of this table fetch a fresh one

    def choose(self, bucket: int) -> Choice:
        choice = self._choices.get(bucket)
        if choice is None:
            choice = self._choices[bucket] = self._resolve(bucket)
        return choice

    def _resolve(self, bucket: int) -> Choice:
        if not self.rows:
            default = attention_fwd.default_config(self.spec, self.device, bucket)
            if not self._choices:  # one line per table, not per bucket
                log.info(
                    "tilegen: no tuned config for %s on %s; using the default %s. Tune it with: %s",
                    self.spec.name, self.device.key, default, tune_command(self.spec, bucket),
                )
            return Choice(default, "default", bucket, None)
        nearest = min(self.rows, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))
        config, source = self.rows[nearest]
        return Choice(config, source, bucket, nearest)


def tune_command(spec: AttentionSpec, bucket: int) -> str:
    return f"tilegen tune --spec '{spec.to_json()}' --seqlens {bucket}"


_tables: dict[tuple[AttentionSpec, str], Table] = {}


def table_for(spec: AttentionSpec, device: DeviceInfo) -> Table:
    key = (spec, device.key)
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = Table(spec, device, _load_rows(spec, device))
    return table


def reset() -> None:
    """Forget loaded tables, so the next call reads the databases again (after a tune, say)."""
    for table in _tables.values():
        table.stale = True
    _tables.clear()


def _load_rows(spec: AttentionSpec, device: DeviceInfo) -> dict[int, tuple[attention_fwd.Config, str]]:
    from tilegen.db import tuned_rows  # the database layer is needed once per table, never per call

    return tuned_rows(**TuningKey.current(spec, device).variant_fields())
