"""What a row must be before any writer stores it: a config its family's kernel can run, sane numbers.

A stored row is what dispatch launches and what later tunes must beat, so one bad row (an
edited export with ``block_m`` 48 and 0.001 ms, say) would break the op for a bucket or
win every tune. Every writer (``record_best``, ``record_trial``, ``import_json``) checks
its rows here first. Families are reached through the registry only.
"""

from __future__ import annotations

import math
from typing import Any

from tilegen.device import DeviceInfo
from tilegen.families import Config, ConfigError, family_of
from tilegen.ir import Spec

__all__ = ["RowError", "check_best", "check_trial", "device_from_gpu", "SMEM_BY_CAPABILITY"]

#: Opt-in shared memory per block by compute capability, for GPUs named only by an export's
#: ``gpus`` entry (which carries no shared-memory size). An unknown capability takes the largest,
#: so the check never refuses a row that its GPU could run; dispatch checks again on the real GPU.
SMEM_BY_CAPABILITY = {
    (7, 0): 98_304, (7, 5): 65_536, (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
    (9, 0): 232_448, (10, 0): 232_448, (10, 3): 232_448, (12, 0): 101_376,
}


class RowError(ValueError):
    """A row no writer may store; the message names the field and says why."""


def device_from_gpu(gpu: dict[str, Any]) -> DeviceInfo:
    """The device an export's ``gpus`` entry describes (``name``, ``capability`` as "9.0", ...)."""
    try:
        major, minor = (int(part) for part in str(gpu["capability"]).split("."))
    except ValueError:
        raise RowError(f"capability: expected \"major.minor\", got {gpu['capability']!r}") from None
    smem = SMEM_BY_CAPABILITY.get((major, minor), max(SMEM_BY_CAPABILITY.values()))
    return DeviceInfo(gpu["name"], (major, minor), gpu["sm_count"], gpu["memory_bytes"], smem)


def check_best(spec: Spec, device: DeviceInfo, bucket: int, config: dict[str, Any], time_ms: float,
               max_error: float, trials: int) -> Config:
    """The row's config when a tuned row may be stored; else ``RowError`` naming what is wrong."""
    _check_bucket(spec, bucket)
    _check_time("time_ms", time_ms)
    if not _is_number(max_error) or math.isnan(max_error) or max_error < 0:
        raise RowError(f"max_error: expected a non-negative number, got {max_error!r}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
        raise RowError(f"trials: expected a non-negative integer, got {trials!r}")
    return _runnable(spec, device, config)


def check_trial(spec: Spec, device: DeviceInfo, bucket: int, config: dict[str, Any], status: str,
                time_ms: float | None) -> None:
    """Raise ``RowError`` unless a trial may be stored.

    Any trial needs known knobs and a bucket of its family; a trial that says "ok" is one a
    tune may make its winner, so it must also be runnable and carry a positive, finite time.
    """
    _check_bucket(spec, bucket)
    family = family_of(spec)
    try:
        family.config_type.from_dict(config)
    except ConfigError as e:
        raise RowError(f"config: {e}") from None
    if status == "ok":
        _check_time("time_ms", time_ms)
        _runnable(spec, device, config)
    elif time_ms is not None and not _is_number(time_ms):
        raise RowError(f"time_ms: expected a number or null, got {time_ms!r}")


def _runnable(spec: Spec, device: DeviceInfo, config: dict[str, Any]) -> Config:
    family = family_of(spec)
    try:
        parsed = family.config_type.from_dict(config)
    except ConfigError as e:
        raise RowError(f"config: {e}") from None
    reason = family.feasible(spec, parsed, device)
    if reason is not None:
        raise RowError(f"config {parsed}: {spec.name} cannot run it on {device.key}: {reason}")
    return parsed


def _check_bucket(spec: Spec, bucket: int) -> None:
    buckets = family_of(spec).buckets
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise RowError(f"bucket: expected a positive integer, got {bucket!r}")
    reason = buckets.check(bucket)  # a packed bucket (decode: context x batch) is checked by its own rule
    if reason is not None:
        raise RowError(f"bucket: {bucket} is not a bucket of {spec.family} ({reason})")


def _check_time(name: str, value: Any) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise RowError(f"{name}: expected a positive, finite number of milliseconds, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
