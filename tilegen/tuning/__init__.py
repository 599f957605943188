"""Autotuning: Optuna studies per tuning key, measured in a worker process, stored in the tuning database.

    from tilegen.db import TuningDB
    from tilegen.device import device_info
    from tilegen.tuning import Tuner

    with Tuner(TuningDB(None), device_info(), trials=30) as tuner:
        result = tuner.tune(spec, 4096)  # doctest: +SKIP
"""

from tilegen.key import TuningKey
from tilegen.tuning.report import ProgressReporter, summary_table
from tilegen.tuning.tuner import SAMPLERS, BucketResult, Reporter, TrialResult, Tuner
from tilegen.tuning.worker import INJECT_ENV, WorkerError

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
