"""``tilegen db verify``: re-run stored rows on this machine against their family's reference.

Each row runs as a tuning trial does (``tilegen.tuning.measure`` in the tuning worker
process, through the family's ``Problem``): fresh random inputs, NaN-poisoned outputs,
the reference check, then timing. A row that does not compile, faults or is wrong here
fails; dispatch would skip it at its first launch anyway, this says so up front.

``--retime`` (``retime_rows``) runs the same way the rows of another Triton that dispatch
serves on this GPU, and stores each that passes under the installed Triton: the measured
time replaces one taken under another compiler, and the row stops being a stand-in.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import triton
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB, TunedRow
from tilegen.db.lookup import served_rows
from tilegen.db.validate import RowError, device_from_gpu, safe_text
from tilegen.device import device_info
from tilegen.families import ConfigError, family_of
from tilegen.ir import SpecError
from tilegen.families import spec_from_json

__all__ = ["gpu_available", "listing", "retime_rows", "served", "verify_rows"]


def verify_rows(database: TuningDB, prefix: str, *, seed: int, timeout: float, console: Console,
                drop_failed: bool, mods: dict[str, str] | None = None) -> int:
    """Verify the rows of ``database`` that can run here; print a table; return how many failed. ``mods``: the
    canonical texts of the mods the command named, by spec field; rows of specs with other mods are not run."""
    import triton

    from tilegen.tuning.worker import Worker

    if not torch.cuda.is_available():
        # The worker imports Triton afresh, so it inherits interpreter mode from here.
        os.environ["TRITON_INTERPRET"] = "1"
    device = device_info()
    specs = {(v.spec_hash, v.template_hash): v.spec_json for v in database.variants(prefix)}
    rows = [r for r in database.list_tuned() if (r.spec_hash, r.template_hash) in specs]
    # Rows no reader uses (a config or bucket no writer would store, edited in behind the checks) fail on
    # every machine: listed as failed, dropped with --drop-failed.
    refused = [r for r in database.take_refused()
               if r.kind == "tuned" and str(r.raw["variant_spec_hash"]).startswith(prefix)]
    runnable, elsewhere, unnamed = [], 0, 0
    for row in rows:
        try:
            spec = spec_from_json(specs[row.spec_hash, row.template_hash])
            family = family_of(spec)
            current = row.template_hash == template_hash(family)
        except SpecError:  # a family or field this tilegen does not know
            current = False
        if not current or row.gpu_key != device.key or row.triton_version != triton.__version__:
            elsewhere += 1
        elif not _mods_named(spec, mods):
            unnamed += 1
        else:
            runnable.append((row, spec, family))
    if elsewhere:
        console.print(escape(f"{elsewhere} row(s) belong to another GPU, Triton or template than this machine's "
                             f"({device.key}, Triton {triton.__version__}): not run here"))
    _say_unnamed(unnamed, console)
    if not runnable and not refused:
        console.print(escape(f"no row of {database.path} can run on this machine"))
        return 0
    table = Table(title=escape(f"{database.path} on {device.key}"))
    for name in ("variant", "bucket", "config", "from", "stored ms", "measured ms", "max err", "result"):
        table.add_column(name, justify="right" if name in ("bucket", "stored ms", "measured ms", "max err") else "left")
    failed = len(refused)
    for row in refused:
        if drop_failed:
            database.delete_refused(row)
        raw = row.raw
        table.add_row(*(Text(safe_text(v)) for v in (
            raw["variant_name"], raw["bucket"], raw["config_json"], raw["provenance"], raw["time_ms"], "-", "-",
            f"infeasible: {row.reason}" + (" (deleted)" if drop_failed else ""))))
    worker = Worker()
    try:
        for row, spec, family in runnable:
            config, _, result = _measure(worker, row, spec, family, device, seed, timeout)
            ok = result["status"] == "ok"
            failed += not ok
            if not ok and drop_failed:
                database.delete_tuned(row)
            table.add_row(*(Text(safe_text(v)) for v in (
                row.variant_name, family.buckets.label(row.bucket), str(config or row.config), row.provenance,
                f"{row.time_ms:.4f}", "-" if result["time_ms"] is None else f"{result['time_ms']:.4f}",
                "-" if result["max_error"] is None else f"{result['max_error']:.2e}",
                "ok" if ok else f"{result['status']}: {result['reason']}" + (" (deleted)" if drop_failed else ""),
            )))
    finally:
        worker.close()
    console.print(table)
    return failed


def _mods_named(spec, mods: dict[str, str] | None) -> bool:
    """Whether a row of ``spec`` can run: a spec without mods can, one with mods when the command named exactly
    them (``--score-mod``/``--mask-mod``, whose functions its trials build)."""
    texts = (getattr(spec, "score_mod", None), getattr(spec, "mask_mod", None))
    return texts == (None, None) or texts == ((mods or {}).get("score_mod"), (mods or {}).get("mask_mod"))


def _say_unnamed(count: int, console: Console) -> None:
    if count:
        console.print(escape(f"{count} row(s) of specs with score or mask mods the command did not name: not run "
                             "(give the --score-mod/--mask-mod they were tuned with)"))


def _measure(worker, row: TunedRow, spec, family, device, seed: int, timeout: float):
    """Run one stored row as a tuning trial: ``(config or None, problem or None, the worker's result)``."""
    problem = None
    try:
        config = family.config_type.from_dict(row.config)
        reason = family.feasible(spec, config, device)
    except ConfigError as e:
        config, reason = None, str(e)
    if reason is None:
        try:
            problem = family.problem(spec, row.bucket, on_gpu=not device.is_interpreter)
        except ValueError as e:  # a bucket its family's rule no longer makes (an older key)
            reason = str(e)
    if reason is not None:
        return config, None, {"status": "infeasible", "time_ms": None, "max_error": None, "reason": reason}
    return config, problem, worker.measure((family, problem, config, seed), timeout)


def gpu_available() -> bool:
    """Whether a CUDA GPU is here to time rows on (the CPU interpreter's times say nothing of a GPU's)."""
    return torch.cuda.is_available()


def retime_rows(database: TuningDB, shipped: TuningDB | None, prefix: str, *, seed: int, timeout: float,
                console: Console, mods: dict[str, str] | None = None) -> tuple[int, int]:
    """Time here the rows of another Triton that dispatch serves on this GPU, from ``database`` and
    ``shipped`` (``tilegen.db.lookup.served_rows``), and store each that passes the reference check in
    ``database`` under the installed Triton; print a table; return how many were stored and how many failed.

    Each row is stored as soon as it is timed, in a transaction of its own: a run cut short keeps
    every row stored so far, and a run again skips them, as they are now the installed Triton's.
    """
    from tilegen.tuning.worker import Worker

    installed = triton.__version__
    device = device_info()
    listings = [listing(database)] + ([listing(shipped)] if shipped is not None else [])
    specs = {key: spec for _, found, _ in listings for key, spec in found.items()}
    # This GPU as it is (its shared memory measured), not as an entry describes one of its kind.
    devices = {device.key: device}
    chosen = served_rows([rows for rows, _, _ in listings], specs, devices, installed)
    rows = [listings[f][0][i] for f, i in sorted(chosen)]
    rows = [row for row in rows if row.spec_hash.startswith(prefix)]
    named = [row for row in rows if _mods_named(specs[row.spec_hash, row.template_hash], mods)]
    _say_unnamed(len(rows) - len(named), console)
    rows = named
    if not rows:
        console.print(escape(f"no row of another Triton is served on {device.key} under Triton {installed}"
                             + (f" for spec {prefix}" if prefix else "") + ": nothing to re-time"))
        return 0, 0
    table = Table(title=escape(f"re-timed on {device.key} under Triton {installed}, into {database.location}"))
    for name in ("variant", "bucket", "config", "tuned under", "stored ms", "measured ms", "max err", "result"):
        table.add_column(name, justify="right" if name in ("bucket", "stored ms", "measured ms", "max err") else "left")
    stored = failed = 0
    worker = Worker()
    try:
        for row in rows:
            spec = specs[row.spec_hash, row.template_hash]
            family = family_of(spec)
            config, problem, result = _measure(worker, row, spec, family, device, seed, timeout)
            ok = result["status"] == "ok"
            if ok:
                time_ms = result["time_ms"]
                database.record_best(
                    spec=spec, device=device, template_hash=row.template_hash, triton_version=installed,
                    bucket=row.bucket, config=config.to_dict(), time_ms=time_ms, max_error=result["max_error"],
                    trials=row.trials, tflops=problem.flops() / (time_ms * 1e9),
                    gbps=problem.bytes_moved() / (time_ms * 1e6),
                )
                stored += 1
            else:
                failed += 1
            table.add_row(*(Text(safe_text(v)) for v in (
                row.variant_name, family.buckets.label(row.bucket), str(config or row.config), row.triton_version,
                f"{row.time_ms:.4f}", "-" if result["time_ms"] is None else f"{result['time_ms']:.4f}",
                "-" if result["max_error"] is None else f"{result['max_error']:.2e}",
                f"stored under {installed}" if ok else f"{result['status']}: {result['reason']}",
            )))
    finally:
        worker.close()
        console.print(table)
    return stored, failed


def listing(database: TuningDB) -> tuple[list[TunedRow], dict[tuple[str, str], Any], dict[str, Any]]:
    """A file's tuned rows, with what judging which of them dispatch serves takes: the current
    template's variants by (spec hash, template hash) and the GPUs by key."""
    rows = database.list_tuned()
    specs = {}
    for variant in database.variants():
        try:
            spec = spec_from_json(variant.spec_json)
        except SpecError:  # a family or field this tilegen does not know: nothing it holds is served
            continue
        if variant.template_hash == template_hash(family_of(spec)):
            specs[variant.spec_hash, variant.template_hash] = spec
    devices = {}
    for gpu in database.gpus():
        with contextlib.suppress(RowError):
            devices[gpu["key"]] = device_from_gpu(gpu)
    return rows, specs, devices


def served(listings: list[tuple[list[TunedRow], dict, dict]]) -> set[tuple[int, int]]:
    """``(listing, row)`` of each row of another Triton dispatch serves, the listings in dispatch's order."""
    specs = {key: spec for _, found, _ in listings for key, spec in found.items()}
    devices = {key: device for _, _, found in listings for key, device in found.items()}
    return served_rows([rows for rows, _, _ in listings], specs, devices, triton.__version__)
