"""The tuner's own cost per trial: a grid tune whose worker answers at once, so what is timed is
the bookkeeping around each measurement (Optuna's ask and tell, the studies lock, tilegen's
trial rows, the checks for configs in flight elsewhere), on SQLite or a PostgreSQL server.

    python -m tilegen.bench.bookkeeping                      # SQLite, then PostgreSQL if pgserver is installed
    python -m tilegen.bench.bookkeeping --dbs sqlite --runs 5

On a GPU each trial also measures for a tenth of a second or more; this is the rest. A
grid tune of ``mha-d128-causal`` on the H200 spent 0.07-0.09 s between trials against 0.14
s measuring one, so the bookkeeping was about a third of its time. Runs on any machine and
compiles nothing: two buckets of ``mha-d128-causal``'s H200 grid (60 configs each), filed
under an H200's identity in temporary databases.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

PRESET = "mha-d128-causal"
BUCKETS = (512, 1024)


class _Instant:
    """A worker that measures nothing: every config answers at once, with a time of its own."""

    def __init__(self):
        self.count = 0

    def measure(self, task, timeout) -> dict:
        self.count += 1
        return {"status": "ok", "time_ms": 1.0 + (self.count * 7919 % 97) / 100, "max_error": 0.0, "reason": None}

    def close(self) -> None:
        pass


def per_trial_ms(url: str) -> float:
    """Milliseconds of bookkeeping per trial of a grid tune over ``BUCKETS`` into ``url``."""
    import optuna

    from tilegen.cli.spec_args import resolve_spec
    from tilegen.db import TuningDB
    from tilegen.device import DeviceInfo
    from tilegen.tuning import Tuner

    optuna.logging.set_verbosity(optuna.logging.CRITICAL)
    spec = resolve_spec(None, PRESET)
    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_000_000_000, 232_448)
    worker = _Instant()
    with TuningDB(url) as db, Tuner(db, h200, sampler="grid", worker=worker, compile_ahead=0) as tuner:
        start = time.perf_counter()
        tuner.tune_many(spec, list(BUCKETS))
        elapsed = time.perf_counter() - start
    return elapsed * 1e3 / worker.count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dbs", default="sqlite,postgresql", help="Comma-separated: sqlite, postgresql.")
    parser.add_argument("--runs", type=int, default=3, help="Fresh databases per kind; the median is reported.")
    args = parser.parse_args(argv)
    kinds = [kind.strip() for kind in args.dbs.split(",")]
    unknown = sorted(set(kinds) - {"sqlite", "postgresql"})
    if unknown or args.runs < 1:
        parser.error(f"--dbs: expected sqlite and/or postgresql, got {args.dbs!r}" if unknown
                     else f"--runs: expected 1 or more, got {args.runs}")
    results = {}
    for kind in kinds:
        server = None
        if kind == "postgresql":
            try:
                import pgserver
                from sqlalchemy.engine import make_url
            except ImportError as e:
                print(f"postgresql: skipped ({e}; pip install pgserver \"psycopg[binary]\")")
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                server = pgserver.get_server(tempfile.mkdtemp(prefix="tgbk"), cleanup_mode="delete")
        try:
            times = []
            for run in range(args.runs):
                if server is None:
                    url = str(Path(tempfile.mkdtemp(prefix="tgbk")) / "tuning.sqlite")
                else:
                    server.psql(f"CREATE DATABASE tg_bk{run};")
                    url = make_url(server.get_uri()).set(drivername="postgresql+psycopg",
                                                         database=f"tg_bk{run}").render_as_string(hide_password=False)
                times.append(per_trial_ms(url))
        finally:
            if server is not None:
                server.cleanup()
        results[kind] = times
        print(f"{kind}: {statistics.median(times):.1f} ms per trial (runs: {', '.join(f'{t:.1f}' for t in times)})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
