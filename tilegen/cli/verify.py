"""``tilegen db verify``: re-run stored rows on this machine against their family's reference.

Each row runs as a tuning trial does (``tilegen.tuning.measure`` in the tuning worker
process, through the family's ``Problem``): fresh random inputs, NaN-poisoned outputs,
the reference check, then timing. A row that does not compile, faults or is wrong here
fails; dispatch would skip it at its first launch anyway, this says so up front.
"""

from __future__ import annotations

import os

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tilegen.codegen.render import template_hash
from tilegen.db import TuningDB
from tilegen.db.validate import safe_text
from tilegen.device import device_info
from tilegen.families import ConfigError, family_of
from tilegen.ir import SpecError
from tilegen.families import spec_from_json

__all__ = ["verify_rows"]


def verify_rows(database: TuningDB, prefix: str, *, seed: int, timeout: float, console: Console,
                drop_failed: bool) -> int:
    """Verify the rows of ``database`` that can run here; print a table; return how many failed."""
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
    runnable, elsewhere = [], 0
    for row in rows:
        try:
            spec = spec_from_json(specs[row.spec_hash, row.template_hash])
            family = family_of(spec)
            current = row.template_hash == template_hash(family)
        except SpecError:  # a family or field this tilegen does not know
            current = False
        if current and row.gpu_key == device.key and row.triton_version == triton.__version__:
            runnable.append((row, spec, family))
        else:
            elsewhere += 1
    if elsewhere:
        console.print(escape(f"{elsewhere} row(s) belong to another GPU, Triton or template than this machine's "
                             f"({device.key}, Triton {triton.__version__}): not run here"))
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
                result = {"status": "infeasible", "time_ms": None, "max_error": None, "reason": reason}
            else:
                result = worker.measure((family, problem, config, seed), timeout)
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
