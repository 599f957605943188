"""What a row must be before anyone stores, reads, launches, prints or emits it.

A stored row is what dispatch launches, what later tunes must beat, what ``tilegen emit
--tuned`` writes into a module's source and what ``tilegen db`` prints. A database is
something users share (a colleague's file, a download, a server), so a row is checked
here whichever way it arrives: every writer (``record_best``, ``record_trial``,
``import_json``) before storing it, and every reader (dispatch's ``tuned_rows``, the
``TuningDB`` queries behind ``tilegen db`` and ``emit``) before using it. SQLite lets a
column hold any type, so values are type-checked, not trusted to their column's type.
Families are reached through the registry only.
"""

from __future__ import annotations

import functools
import json
import math
import re
from datetime import datetime
from typing import Any

import triton

from tilegen.db.rows import TrialRow, TunedRow
from tilegen.device import DeviceInfo
from tilegen.families import Config, ConfigError, family_of, get, spec_from_json
from tilegen.ir import Spec, SpecError

__all__ = [
    "RowError", "TIME_FLOOR_MS", "check_best", "check_gpu", "check_stored_trial", "check_stored_tuned",
    "check_text", "check_trial", "check_variant", "device_from_gpu", "runnable_here", "safe_text",
    "SMEM_BY_CAPABILITY",
]

#: Opt-in shared memory per block by compute capability, for GPUs named only by an export's
#: ``gpus`` entry (which carries no shared-memory size). An unknown capability takes the largest,
#: so the check never refuses a row that its GPU could run; dispatch checks again on the real GPU.
SMEM_BY_CAPABILITY = {
    (7, 0): 98_304, (7, 5): 65_536, (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
    (9, 0): 232_448, (10, 0): 232_448, (10, 3): 232_448, (12, 0): 101_376,
}

#: The GPU whose search space bounds the knobs of rows filed under the interpreter.
_BOUNDING_GPU = DeviceInfo("NVIDIA H100", (9, 0), 132, 80 * 2**30, SMEM_BY_CAPABILITY[9, 0])

#: No knob of any family comes near this; it bounds a row this process cannot judge (see ``_runnable``).
_KNOB_CEILING = 1 << 16

#: The shortest time a row may claim: 1 ns. A kernel launch alone takes microseconds, so a
#: smaller time is a typo or forged, and (tunes keep the faster row) would beat every later tune.
TIME_FLOOR_MS = 1e-6

#: Integer columns are 32 bits on a server (``INTEGER``); ``memory_bytes`` is 64.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

#: Names, keys and versions: letters, digits and a little punctuation, nothing a terminal or
#: rich reads as a command (escape sequences, ``[markup]``), nothing Python reads as code.
_SAFE = re.compile(r"[A-Za-z0-9_.+\-:/@(), ]*")
_HEX = re.compile(r"[0-9a-f]+")

#: Column widths (the models' ``String(n)``): a server refuses a longer value.
NAME_CHARS, VERSION_CHARS, HASH_CHARS = 255, 64, 64

#: Every character that is not printable: C0/C1 controls (ESC included), and the like.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


class RowError(ValueError):
    """A row no one may store or use; the message names the field and says why."""


def safe_text(value: Any, limit: int = 200) -> str:
    """``value`` as text that prints as itself: controls (ANSI ESC, newlines, bidi marks) shown as
    ``\\xNN`` escapes and the length bounded. Rich markup is left to the printer (``rich.markup.escape``)."""
    text = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_text(name: str, value: Any, limit: int = NAME_CHARS, pattern: re.Pattern[str] = _SAFE) -> str:
    """``value`` when it is a string of at most ``limit`` characters from the safe set, else ``RowError``."""
    if not isinstance(value, str):
        raise RowError(f"{name}: expected a string, got {safe_text(repr(value), 80)}")
    if not value or len(value) > limit:
        raise RowError(f"{name}: expected 1 to {limit} characters, got {len(value)}")
    if not pattern.fullmatch(value):
        what = "hex digits" if pattern is _HEX else "letters, digits, spaces and _.+-:/@(),"
        raise RowError(f"{name}: expected {what} only, got {safe_text(repr(value), 80)}")
    return value


def check_int(name: str, value: Any, low: int = 0, high: int = INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RowError(f"{name}: expected an integer from {low} to {high}, got {safe_text(repr(value), 80)}")
    return value


def device_from_gpu(gpu: dict[str, Any]) -> DeviceInfo:
    """The device an export's ``gpus`` entry describes (``name``, ``capability`` as "9.0", ...)."""
    try:
        major, minor = (int(part) for part in str(gpu["capability"]).split("."))
    except ValueError:
        raise RowError(f"capability: expected \"major.minor\", got {safe_text(repr(gpu['capability']), 80)}") from None
    smem = SMEM_BY_CAPABILITY.get((major, minor), max(SMEM_BY_CAPABILITY.values()))
    return DeviceInfo(gpu["name"], (major, minor), gpu["sm_count"], gpu["memory_bytes"], smem)


def check_gpu(gpu: dict[str, Any]) -> DeviceInfo:
    """The device of a ``gpus`` entry (``key``, ``name``, ``capability``, ``sm_count``, ``memory_bytes``);
    ``RowError`` unless each is sane and the key is the one its name and capability give, so an entry
    cannot claim another capability for a GPU's key."""
    check_text("name", gpu["name"])
    if not isinstance(gpu["capability"], str) or not re.fullmatch(r"\d{1,2}\.\d{1,2}", gpu["capability"]):
        raise RowError(f"capability: expected \"major.minor\", got {safe_text(repr(gpu['capability']), 80)}")
    check_int("sm_count", gpu["sm_count"])
    check_int("memory_bytes", gpu["memory_bytes"], 0, INT64_MAX)
    device = device_from_gpu(gpu)
    if check_text("key", gpu["key"]) != device.key:
        raise RowError(f"key: {gpu['key']!r} is not the key of a {device.name} of capability {gpu['capability']} "
                       f"({device.key!r})")
    return device


def check_variant(family: str, spec_hash: str, template_hash: str, name: str, spec_json: str) -> Spec | None:
    """The variant's spec; ``None`` for a family this tilegen does not know (a newer one wrote it), whose
    names are still checked. ``RowError`` unless the spec parses, has that hash, family and name."""
    check_text("spec_hash", spec_hash, HASH_CHARS, _HEX)
    check_text("template_hash", template_hash, HASH_CHARS)
    check_text("family", family, VERSION_CHARS)
    check_text("name", name)
    if not isinstance(spec_json, str):
        raise RowError(f"spec_json: expected a string, got {type(spec_json).__name__}")
    try:
        get(family)
    except SpecError:
        return None
    spec = _spec(spec_json)
    if spec_hash != spec.hash:
        raise RowError(f"spec_hash: {spec_hash} is not the hash of its spec ({spec.hash})")
    for field, value, want in (("family", family, spec.family), ("name", name, spec.name)):
        if value != want:
            raise RowError(f"{field}: {safe_text(repr(value), 80)} is not its spec's {field} ({want!r})")
    return spec


@functools.lru_cache(maxsize=256)
def _spec(spec_json: str) -> Spec:
    try:
        return spec_from_json(spec_json)
    except (SpecError, ValueError, TypeError, RecursionError) as e:  # deep nesting overflows the parser
        raise RowError(f"spec_json: {safe_text(e, 200) if not isinstance(e, RecursionError) else 'nested too deeply'}"
                       ) from None


def check_best(spec: Spec | None, device: DeviceInfo, bucket: int, config: dict[str, Any], time_ms: float,
               max_error: float, trials: int, *, tflops: float | None = None, gbps: float | None = None,
               versions: dict[str, Any] | None = None, stored: bool = False) -> Config | None:
    """The row's config when a tuned row may be stored or used; else ``RowError`` naming what is wrong.
    ``versions`` are its version strings by field (``triton_version``, ...), which a server keeps in 64 characters.
    ``spec`` is ``None`` for a stored row of a family this tilegen does not know: all but its family's own
    rules (bucket, knobs) are checked, and ``None`` returned. ``stored``: a row read back from a
    database, which may be another Triton's (see ``_runnable``); a row to be written is this one's."""
    _check_bucket(spec, bucket)
    _check_time("time_ms", time_ms)
    _check_error(max_error, finite=True)
    check_int("trials", trials)
    for name, value in (("tflops", tflops), ("gbps", gbps)):
        if value is not None and (not _is_number(value) or not math.isfinite(value) or value < 0):
            raise RowError(f"{name}: expected a non-negative, finite number or null, got {safe_text(repr(value), 80)}")
    for name, value in (versions or {}).items():
        check_text(name, value, VERSION_CHARS)
    triton_version = (versions or {}).get("triton_version") if stored else None
    return _runnable(spec, device, config, triton_version) if spec is not None else _knobs_of_unknown(config)


def check_trial(spec: Spec | None, device: DeviceInfo, bucket: int, config: dict[str, Any], status: str,
                time_ms: float | None, *, max_error: float | None, trial_number: int, study_name: str,
                triton_version: str, stored: bool = False) -> None:
    """Raise ``RowError`` unless a trial may be stored or used.

    Any trial needs known knobs and a bucket of its family; a trial that says "ok" is one a
    tune may make its winner, so it must also be runnable and carry a positive, finite time
    and a finite error (a wrong one may have measured an infinite error).
    """
    _check_bucket(spec, bucket)
    check_int("trial_number", trial_number)
    check_text("study_name", study_name)
    check_text("triton_version", triton_version, VERSION_CHARS)
    if spec is None:
        _knobs_of_unknown(config)
    else:
        _config(spec, config)
    if status == "ok":
        _check_time("time_ms", time_ms)
        _check_error(max_error, finite=True, optional=True)
        if spec is not None:
            _runnable(spec, device, config, triton_version if stored else None)
    else:
        if time_ms is not None and (not _is_number(time_ms) or math.isnan(time_ms) or time_ms < 0):
            raise RowError(f"time_ms: expected a non-negative number or null, got {safe_text(repr(time_ms), 80)}")
        _check_error(max_error, finite=False, optional=True)


def check_stored_tuned(row: TunedRow, spec_json: str, gpu: dict[str, Any]) -> None:
    """``RowError`` unless a tuned row as read (with its variant's spec and its GPU entry) passes every
    check a writer makes; a row of a family this tilegen does not know gets the checks that need none."""
    device = check_gpu(gpu)
    spec = check_variant(row.family, row.spec_hash, row.template_hash, row.variant_name, spec_json)
    _check_stored(row)
    versions = {name: getattr(row, name) for name in ("triton_version", "torch_version", "tilegen_version")}
    check_best(spec, device, row.bucket, row.config, row.time_ms, row.max_error, row.trials,
               tflops=row.tflops, gbps=row.gbps, versions=versions, stored=True)


def check_stored_trial(row: TrialRow, spec_json: str, gpu: dict[str, Any], name: str) -> None:
    """``check_stored_tuned`` for a trial (``name`` is its variant's)."""
    device = check_gpu(gpu)
    spec = check_variant(row.family, row.spec_hash, row.template_hash, name, spec_json)
    _check_stored(row)
    if row.reason is not None and not isinstance(row.reason, str):
        raise RowError(f"reason: expected a string or null, got {type(row.reason).__name__}")
    check_trial(spec, device, row.bucket, row.config, row.status, row.time_ms, max_error=row.max_error,
                trial_number=row.trial_number, study_name=row.study_name, triton_version=row.triton_version,
                stored=True)


def config_from_json(text: Any) -> dict[str, Any]:
    """A stored ``config_json`` as its knob dict; ``RowError`` for anything but a JSON object."""
    if not isinstance(text, str) or len(text) > 4096:
        raise RowError(f"config: expected JSON text, got {safe_text(repr(text), 80)}")
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):
        raise RowError(f"config: not JSON: {safe_text(repr(text), 80)}") from None
    if not isinstance(config, dict):
        raise RowError(f"config: expected a JSON object, got {safe_text(repr(text), 80)}")
    return config


def _check_stored(row: TunedRow | TrialRow) -> None:
    from tilegen.db.models import PROVENANCES, TRIAL_STATUSES

    if isinstance(row, TrialRow) and row.status not in TRIAL_STATUSES:
        raise RowError(f"status: expected one of {', '.join(TRIAL_STATUSES)}, got {safe_text(repr(row.status), 80)}")
    if row.provenance not in PROVENANCES:
        raise RowError(f"provenance: expected one of {', '.join(PROVENANCES)}, got {safe_text(repr(row.provenance), 80)}")
    if not isinstance(row.created_at, datetime):
        raise RowError(f"created_at: expected a date, got {safe_text(repr(row.created_at), 80)}")


def _config(spec: Spec, config: dict[str, Any]) -> Config:
    family = family_of(spec)
    try:
        return family.config_type.from_dict(config)
    except ConfigError as e:
        raise RowError(f"config: {safe_text(e)}") from None


def _runnable(spec: Spec, device: DeviceInfo, config: dict[str, Any], triton_version: str | None = None) -> Config:
    family = family_of(spec)
    parsed = _config(spec, config)
    if triton_version is not None and triton_version != triton.__version__:
        # A stored row of another Triton (a shipped 3.6 row listed under 3.7): what it can run, and its
        # search space, depend on the Triton it was tuned with, not this one. The commands that list it
        # check its knobs against a bound no family's knob nears; dispatch, before serving it for want of
        # this Triton's row, judges it by this Triton too (``runnable_here``). A row to be written (tune,
        # import, pull) is judged by this Triton, as before.
        for knob, value in parsed.to_dict().items():
            if value > _KNOB_CEILING:
                raise RowError(f"config: {knob}: {value} is past any {knob} tilegen launches ({_KNOB_CEILING})")
        return parsed
    # A knob past the search space's largest value (a warp count of 2**80) is no launch the GPU
    # takes. The interpreter's space is a CPU tune's small one, while tests store larger tiles
    # there: it is bounded by a Hopper's. Switches and choices are checked by from_dict already.
    largest_of = _largest(spec, device, triton.__version__)
    for knob, value in parsed.to_dict().items():
        largest = largest_of.get(knob)
        if knob in parsed.switches or knob in parsed.choices or largest is None:
            continue
        if value > largest:
            raise RowError(f"config: {knob}: {value} is past the largest {knob} of {spec.family} on {device.key} "
                           f"({largest})")
    reason = family.feasible(spec, parsed, device)
    if reason is not None:
        raise RowError(f"{reason} ({spec.name} cannot run config {parsed} on {device.key})")
    return parsed


def runnable_here(spec: Spec, device: DeviceInfo, config: dict[str, Any]) -> Config:
    """The config when the installed Triton can run it on ``device`` (the checks a row to be written
    gets), else ``RowError``: what a row tuned under another Triton must pass before it is served here."""
    return _runnable(spec, device, config)


@functools.lru_cache(maxsize=256)
def _largest(spec: Spec, device: DeviceInfo, triton_version: str) -> dict[str, int]:
    """The largest value of each knob in the search space (a read checks every row: computed once per
    Triton too, since a space may depend on it: the Gluon kernel's tiles are Triton 3.6's)."""
    family = family_of(spec)
    spaces = [family.search_space(spec, device)]
    if device.is_interpreter:
        spaces.append(family.search_space(spec, _BOUNDING_GPU))
    return {knob: max(v for space in spaces for v in space.get(knob, ())) for knob in family.config_type.knobs()
            if any(space.get(knob) for space in spaces)}


def _knobs_of_unknown(config: dict[str, Any]) -> None:
    """The knobs of a family this tilegen does not know: named safely, each an int (every family's are)."""
    for knob, value in config.items():
        check_text("config", knob, VERSION_CHARS)
        check_int(f"config: {knob}", value, -INT32_MAX)


def _check_bucket(spec: Spec | None, bucket: int) -> None:
    # An int first: the rule's arithmetic on a str or float stored in the column would raise, or pass.
    if isinstance(bucket, bool) or not isinstance(bucket, int) or not 1 <= bucket <= INT32_MAX:
        raise RowError(f"bucket: expected a positive integer of 32 bits, got {safe_text(repr(bucket), 80)}")
    if spec is None:
        return
    reason = family_of(spec).buckets.check(bucket)  # a packed bucket (decode: context x batch) is checked by its own rule
    if reason is not None:
        raise RowError(f"bucket: {bucket} is not a bucket of {spec.family} ({reason})")


def _check_time(name: str, value: Any) -> None:
    if not _is_number(value) or not math.isfinite(value) or value < TIME_FLOOR_MS:
        raise RowError(f"{name}: expected a positive, finite number of milliseconds, at least {TIME_FLOOR_MS:g} (1 ns), "
                       f"got {safe_text(repr(value), 80)}")


def _check_error(value: Any, *, finite: bool, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_number(value) or math.isnan(value) or value < 0 or (finite and math.isinf(value)):
        raise RowError(f"max_error: expected a non-negative{', finite' if finite else ''} number, "
                       f"got {safe_text(repr(value), 80)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
