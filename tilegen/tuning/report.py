"""What ``tilegen tune`` shows: a progress bar per bucket while it runs, a summary table after."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from tilegen.families import family_of
from tilegen.key import TuningKey
from tilegen.tuning.tuner import BucketResult, Reporter, TrialResult

__all__ = ["ProgressReporter", "bucket_text", "summary_table"]

#: Statuses counted as "failed" in the summary: the config broke, not merely computed wrong.
_FAILED = ("compile_error", "fault", "timeout")


class ProgressReporter(Reporter):
    """One bar per bucket: configs measured out of the budget, and the best time so far.

    A context manager: the bars appear with the first bucket (an error before it prints
    nothing) and stay on screen when it exits.
    """

    def __init__(self, console: Console):
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("best {task.fields[best]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self._tasks = {}

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc) -> None:
        if self._tasks:  # stopping a Progress that never started still prints a blank line
            self.progress.stop()

    def start(self, key: TuningKey, budget: int, best: TrialResult | None) -> None:
        if not self._tasks:
            self.progress.start()
        label = bucket_text(key)
        name = f"n={label}" if label == str(key.bucket) else label  # a packed bucket names its own sizes
        self._tasks[key] = self.progress.add_task(name, total=budget, best=_best_text(best))

    def trial(self, key: TuningKey, result: TrialResult, best: TrialResult | None) -> None:
        advance = 0 if result.status == "infeasible" else 1  # infeasible configs cost no measurement
        self.progress.update(self._tasks[key], advance=advance, best=_best_text(best))


def summary_table(results: list[BucketResult]) -> Table:
    table = Table(title=f"{results[0].key.spec.name} on {results[0].key.device.key}" if results else None)
    # Both figures: TFLOP/s judges compute-bound kernels (prefill), GB/s memory-bound ones (decode, merge).
    for name in ("bucket", "best config", "time ms", "TFLOP/s", "GB/s", "max err", "trials ok/wrong/failed"):
        # A config is read whole: in a narrow terminal it folds onto a second line rather than being cut.
        table.add_column(name, justify="left" if name == "best config" else "right", no_wrap=name == "bucket",
                         overflow="fold" if name == "best config" else "ellipsis")
    for r in results:
        counts = f"{r.statuses['ok']}/{r.statuses['wrong']}/{sum(r.statuses[s] for s in _FAILED)}"
        if r.best is None:
            table.add_row(bucket_text(r.key), "no correct config", "-", "-", "-", "-", counts)
        else:
            table.add_row(
                bucket_text(r.key), str(r.best.config), f"{r.best.time_ms:.4g}", _figure(r.tflops), _figure(r.gbps),
                f"{r.best.max_error:.2e}", counts,
            )
    return table


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def bucket_text(key: TuningKey) -> str:
    """The key's bucket as its family reads it: the number, or what a packed one holds (decode)."""
    return family_of(key.spec).buckets.label(key.bucket)


def _best_text(best: TrialResult | None) -> str:
    return "-" if best is None else f"{best.time_ms:.4g} ms {best.config}"
