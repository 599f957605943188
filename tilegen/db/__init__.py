"""The tuning database: tuned configs, the trials behind them, and the lookup dispatch uses.

One SQLite file per user (``tilegen.env.db_path()``, ``TILEGEN_DB`` overrides) plus a
read-only one shipped with tilegen (``tilegen.env.shipped_db_path()``). The schema is
versioned with Alembic (``tilegen/db/migrations``); opening a file upgrades it.
Optuna's studies live beside the database, at ``studies_url(db_path)``.
"""

from tilegen.db.errors import DatabaseError
from tilegen.db.lookup import tuned_rows
from tilegen.db.migrate import SCHEMA_REVISION
from tilegen.db.models import TRIAL_STATUSES
from tilegen.db.rows import TrialRow, TunedRow, VariantRow
from tilegen.db.store import TuningDB, studies_url

__all__ = [
    "DatabaseError",
    "SCHEMA_REVISION",
    "TRIAL_STATUSES",
    "TrialRow",
    "TunedRow",
    "TuningDB",
    "VariantRow",
    "studies_url",
    "tuned_rows",
]
