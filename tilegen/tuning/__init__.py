"""Autotuning: Optuna studies per tuning key, measured in a worker process, stored in the tuning database.

    from tilegen.db import TuningDB
    from tilegen.device import device_info
    from tilegen.tuning import Tuner

    with Tuner(TuningDB(None), device_info(), trials=30) as tuner:
        result = tuner.tune(spec, 4096)  # doctest: +SKIP

The names below load on first use: the measuring worker process imports
``tilegen.tuning.worker`` and ``tilegen.tuning.measure`` through this package, and needs
neither Optuna, SQLAlchemy nor the progress display, which would only delay its start.
"""

from __future__ import annotations

from tilegen.lazy import lazy_names

_WHERE = {
    "INJECT_ENV": "tilegen.tuning.worker",
    "SAMPLERS": "tilegen.tuning.tuner",
    "BucketResult": "tilegen.tuning.tuner",
    "ProgressReporter": "tilegen.tuning.report",
    "Reporter": "tilegen.tuning.tuner",
    "TrialResult": "tilegen.tuning.tuner",
    "Tuner": "tilegen.tuning.tuner",
    "TuningKey": "tilegen.key",
    "WorkerError": "tilegen.tuning.worker",
    "summary_table": "tilegen.tuning.report",
}

__all__ = [
    "INJECT_ENV",
    "SAMPLERS",
    "BucketResult",
    "ProgressReporter",
    "Reporter",
    "TrialResult",
    "Tuner",
    "TuningKey",
    "WorkerError",
    "summary_table",
]


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
