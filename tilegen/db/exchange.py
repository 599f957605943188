"""The JSON form of a tuning database, written by ``tilegen db export`` and read by ``import``.

Rows name their variant by ``(spec_hash, template_hash)`` and their GPU by ``key``,
never by row id, so a file moves between databases::

    {"format": "tilegen-tuning-db", "format_version": 1,
     "gpus":     [{"key", "name", "capability", "sm_count", "memory_bytes"}],
     "variants": [{"spec_hash", "template_hash", "family", "name", "spec_json"}],
     "tuned":    [{"spec_hash", "template_hash", "gpu_key", "bucket", "config", "time_ms", ...}],
     "trials":   [{"spec_hash", "template_hash", "gpu_key", "study_name", "trial_number", ...}]}

Keys a reader does not know are ignored, so a file can carry readable extras.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Callable

from tilegen.db.models import TRIAL_STATUSES
from tilegen.db.validate import INT32_MAX, INT64_MAX, RowError, check_best, check_gpu, check_trial, check_variant, safe_text

__all__ = ["FORMAT", "FORMAT_VERSION", "IMPORTED", "SECTIONS", "check", "imported_study", "jsonable_number",
           "measured_study"]

FORMAT = "tilegen-tuning-db"
FORMAT_VERSION = 1

#: What an imported trial's study name ends in (``TuningDB.import_json``).
IMPORTED = "-imported"


def imported_study(name: str) -> str:
    """The study an imported trial of study ``name`` is filed under: one no tune writes to."""
    return name if name.endswith(IMPORTED) else name + IMPORTED


def measured_study(name: str) -> str:
    """The study a tune measured the trials of study ``name`` in (an imported one's, before it was imported)."""
    return name.removesuffix(IMPORTED)


#: How an export writes an infinite number: standard JSON has none, and jq or a browser refuse a bare Infinity.
_INFINITIES = {"Infinity": math.inf, "-Infinity": -math.inf}


def jsonable_number(value: Any) -> Any:
    """``value`` as an export writes it: an infinite float as ``_INFINITIES``' string."""
    if isinstance(value, float) and math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "str": ("a string", lambda v: isinstance(v, str)),
    # Integer columns are 32 bits on a server, memory_bytes 64 (the "int64" kind): a larger value is refused
    # here, not by the database mid-import.
    "int": ("an integer of 32 bits", lambda v: isinstance(v, int) and not isinstance(v, bool) and -INT32_MAX <= v <= INT32_MAX),
    "int64": ("an integer of 64 bits", lambda v: isinstance(v, int) and not isinstance(v, bool) and -INT64_MAX <= v <= INT64_MAX),
    # Infinity passes (a trial may record an infinite error), as the string export writes (JSON has no number for it)
    # or as Python's json reads a bare Infinity; NaN cannot be stored in SQLite.
    "num": ("a number", lambda v: (isinstance(v, str) and v in _INFINITIES)
            or (isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v))),
    "dict": ("an object", lambda v: isinstance(v, dict)),
}

# Field -> kind; a trailing "?" allows null.
_VARIANT_KEY = {"spec_hash": "str", "template_hash": "str", "gpu_key": "str", "bucket": "int"}
SECTIONS: dict[str, dict[str, str]] = {
    "gpus": {"key": "str", "name": "str", "capability": "str", "sm_count": "int", "memory_bytes": "int64"},
    "variants": {"spec_hash": "str", "template_hash": "str", "family": "str", "name": "str", "spec_json": "str"},
    "tuned": {
        **_VARIANT_KEY, "triton_version": "str", "torch_version": "str", "tilegen_version": "str",
        "config": "dict", "time_ms": "num", "tflops": "num?", "gbps": "num?", "max_error": "num",
        "trials": "int", "created_at": "str",
    },
    "trials": {
        **_VARIANT_KEY, "triton_version": "str", "study_name": "str", "trial_number": "int", "config": "dict",
        "status": "str", "time_ms": "num?", "max_error": "num?", "reason": "str?", "created_at": "str",
    },
}


def check(data: Any, *, skip_bad: bool = False) -> dict[str, list[Any]]:
    """Validate an export and return its sections, ``created_at`` parsed; a ``ValueError`` names the bad field.

    Beyond the format, each tuned row and trial must pass ``tilegen.db.validate`` on the
    GPU its ``gpu_key`` names. A row that does not raises, unless ``skip_bad``: then it is
    left out and named in the ``skipped`` section.

    Example:
        >>> check({"format": FORMAT, "format_version": 1, "gpus": [], "variants": [], "tuned": [], "trials": []})
        {'gpus': [], 'variants': [], 'tuned': [], 'trials': [], 'skipped': []}
    """
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _malformed("", f"expected a JSON object with \"format\": \"{FORMAT}\"")
    if data.get("format_version") != FORMAT_VERSION:
        raise _malformed(
            "format_version", f"this tilegen reads version {FORMAT_VERSION}, got {safe_text(repr(data.get('format_version')), 80)}"
        )
    sections = {name: [_entry(data, name, i, fields) for i in range(_length(data, name))]
                for name, fields in SECTIONS.items()}
    devices = {}
    for i, gpu in enumerate(sections["gpus"]):
        try:
            devices[gpu["key"]] = check_gpu(gpu)
        except RowError as e:
            raise ValueError(f"malformed tilegen export: gpus[{i}].{e}") from None
    variants = {}  # (spec hash, template hash) -> spec
    for i, variant in enumerate(sections["variants"]):
        try:
            spec = check_variant(variant["family"], variant["spec_hash"], variant["template_hash"], variant["name"],
                                 variant["spec_json"])
        except RowError as e:
            raise ValueError(f"malformed tilegen export: variants[{i}].{e}") from None
        if spec is None:
            raise _malformed(f"variants[{i}].family", f"{safe_text(repr(variant['family']), 80)} is not a family this tilegen knows")
        variants[variant["spec_hash"], variant["template_hash"]] = spec
    for name in ("tuned", "trials"):
        for i, row in enumerate(sections[name]):
            where = f"{name}[{i}]"
            if (row["spec_hash"], row["template_hash"]) not in variants:
                raise _malformed(where, f"variant {safe_text(repr(row['spec_hash']), 80)}/{safe_text(repr(row['template_hash']), 80)} is not in \"variants\"")
            if row["gpu_key"] not in devices:
                raise _malformed(f"{where}.gpu_key", f"{safe_text(repr(row['gpu_key']), 80)} is not in \"gpus\"")
    for i, row in enumerate(sections["trials"]):
        if row["status"] not in TRIAL_STATUSES:
            raise _malformed(f"trials[{i}].status", f"expected one of {', '.join(TRIAL_STATUSES)}, got {safe_text(repr(row['status']), 80)}")
    skipped = []
    for name in ("tuned", "trials"):
        kept = []
        for i, row in enumerate(sections[name]):
            spec = variants[row["spec_hash"], row["template_hash"]]
            device = devices[row["gpu_key"]]
            try:
                if name == "tuned":
                    versions = {v: row[v] for v in ("triton_version", "torch_version", "tilegen_version")}
                    check_best(spec, device, row["bucket"], row["config"], row["time_ms"], row["max_error"],
                               row["trials"], tflops=row["tflops"], gbps=row["gbps"], versions=versions)
                else:
                    check_trial(spec, device, row["bucket"], row["config"], row["status"], row["time_ms"],
                                max_error=row["max_error"], trial_number=row["trial_number"],
                                # As it is stored: the suffix an import adds counts against the column's length.
                                study_name=imported_study(row["study_name"]), triton_version=row["triton_version"])
            except RowError as e:
                where = f"{name}[{i}] ({spec.name}, bucket {row['bucket']}, {row['gpu_key']}): {e}"
                if not skip_bad:
                    raise ValueError(
                        f"refused tilegen export: {where}. Fix or remove that row, or import the other rows "
                        f"with --skip-bad"
                    ) from None
                skipped.append(where)
                continue
            kept.append(row)
        sections[name] = kept
    return {**sections, "skipped": skipped}


def _length(data: dict[str, Any], name: str) -> int:
    if not isinstance(data.get(name), list):
        raise _malformed(name, "expected a list")
    return len(data[name])


def _entry(data: dict[str, Any], name: str, index: int, fields: dict[str, str]) -> dict[str, Any]:
    where = f"{name}[{index}]"
    entry = data[name][index]
    if not isinstance(entry, dict):
        raise _malformed(where, "expected an object")
    out = {}
    for field, kind in fields.items():
        optional = kind.endswith("?")
        what, accepts = _KINDS[kind.rstrip("?")]
        if field not in entry:
            raise _malformed(f"{where}.{field}", "missing")
        value = entry[field]
        if not (accepts(value) or (optional and value is None)):
            raise _malformed(f"{where}.{field}", f"expected {what}{' or null' if optional else ''}, got {safe_text(repr(value), 80)}")
        out[field] = _INFINITIES.get(value, value) if isinstance(value, str) and kind.startswith("num") else value
    if "created_at" in out:
        try:
            created = datetime.fromisoformat(out["created_at"])
            # Stored times are naive UTC (see models.utcnow); a zone can carry a date past the last one.
            out["created_at"] = created.astimezone(timezone.utc).replace(tzinfo=None) if created.tzinfo else created
        except (ValueError, OverflowError):
            raise _malformed(f"{where}.created_at", f"expected an ISO date, got {safe_text(repr(out['created_at']), 80)}") from None
    return out


def _malformed(where: str, message: str) -> ValueError:
    return ValueError(f"malformed tilegen export: {where + ': ' if where else ''}{message}")
