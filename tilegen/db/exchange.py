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
from tilegen.db.validate import RowError, check_best, check_trial, device_from_gpu
from tilegen.families import family_of
from tilegen.ir import SpecError
from tilegen.families import spec_from_json

__all__ = ["FORMAT", "FORMAT_VERSION", "SECTIONS", "check"]

FORMAT = "tilegen-tuning-db"
FORMAT_VERSION = 1

_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    # Infinity passes (a trial may record an infinite error); NaN cannot be stored in SQLite.
    "num": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)),
    "dict": ("an object", lambda v: isinstance(v, dict)),
}

# Field -> kind; a trailing "?" allows null.
_VARIANT_KEY = {"spec_hash": "str", "template_hash": "str", "gpu_key": "str", "bucket": "int"}
SECTIONS: dict[str, dict[str, str]] = {
    "gpus": {"key": "str", "name": "str", "capability": "str", "sm_count": "int", "memory_bytes": "int"},
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
            "format_version", f"this tilegen reads version {FORMAT_VERSION}, got {data.get('format_version')!r}"
        )
    sections = {name: [_entry(data, name, i, fields) for i in range(_length(data, name))]
                for name, fields in SECTIONS.items()}
    gpus = {g["key"] for g in sections["gpus"]}
    variants = {}  # (spec hash, template hash) -> spec
    for i, variant in enumerate(sections["variants"]):
        where = f"variants[{i}]"
        try:
            spec = spec_from_json(variant["spec_json"])
        except (SpecError, ValueError, TypeError) as e:
            raise _malformed(f"{where}.spec_json", str(e)) from None
        if spec.hash != variant["spec_hash"]:
            raise _malformed(f"{where}.spec_hash", f"{variant['spec_hash']} is not the hash of its spec ({spec.hash})")
        if spec.family != variant["family"]:
            raise _malformed(f"{where}.family", f"{variant['family']!r} is not its spec's family ({spec.family!r})")
        variants[variant["spec_hash"], variant["template_hash"]] = spec
    for name in ("tuned", "trials"):
        for i, row in enumerate(sections[name]):
            where = f"{name}[{i}]"
            if (row["spec_hash"], row["template_hash"]) not in variants:
                raise _malformed(where, f"variant {row['spec_hash']}/{row['template_hash']} is not in \"variants\"")
            if row["gpu_key"] not in gpus:
                raise _malformed(f"{where}.gpu_key", f"{row['gpu_key']!r} is not in \"gpus\"")
            if row["bucket"] < 1:
                raise _malformed(f"{where}.bucket", f"expected a positive integer, got {row['bucket']}")
    for i, row in enumerate(sections["tuned"]):
        try:
            family_of(variants[row["spec_hash"], row["template_hash"]]).config_type.from_dict(row["config"])
        except ValueError as e:
            raise _malformed(f"tuned[{i}].config", str(e)) from None
    for i, row in enumerate(sections["trials"]):
        if row["status"] not in TRIAL_STATUSES:
            raise _malformed(f"trials[{i}].status", f"expected one of {', '.join(TRIAL_STATUSES)}, got {row['status']!r}")
    devices = {}
    for i, gpu in enumerate(sections["gpus"]):
        try:
            devices[gpu["key"]] = device_from_gpu(gpu)
        except RowError as e:
            raise ValueError(f"malformed tilegen export: gpus[{i}].{e}") from None
    skipped = []
    for name in ("tuned", "trials"):
        kept = []
        for i, row in enumerate(sections[name]):
            spec = variants[row["spec_hash"], row["template_hash"]]
            device = devices[row["gpu_key"]]
            try:
                if name == "tuned":
                    check_best(spec, device, row["bucket"], row["config"], row["time_ms"], row["max_error"],
                               row["trials"])
                else:
                    check_trial(spec, device, row["bucket"], row["config"], row["status"], row["time_ms"])
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
            raise _malformed(f"{where}.{field}", f"expected {what}{' or null' if optional else ''}, got {value!r}")
        out[field] = value
    if "created_at" in out:
        try:
            created = datetime.fromisoformat(out["created_at"])
        except ValueError:
            raise _malformed(f"{where}.created_at", f"expected an ISO date, got {out['created_at']!r}") from None
        # Stored times are naive UTC (see models.utcnow).
        out["created_at"] = created.astimezone(timezone.utc).replace(tzinfo=None) if created.tzinfo else created
    return out


def _malformed(where: str, message: str) -> ValueError:
    return ValueError(f"malformed tilegen export: {where + ': ' if where else ''}{message}")
