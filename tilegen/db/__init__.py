"""The tuning database: tuned configs, the trials behind them, and the lookup dispatch uses.

One SQLite file per user (``tilegen.env.db_path()``, ``TILEGEN_DB`` overrides) plus a
read-only one shipped with tilegen (``tilegen.env.shipped_db_path()``); tuning may write to a
PostgreSQL server instead (a ``postgresql+psycopg://`` URL, ``tilegen.db.location``), which
dispatch never reads. The schema is versioned with Alembic (``tilegen/db/migrations``);
opening a database writable upgrades it. Optuna's studies live beside a file, at
``studies_url(db_path)``, and in the same database on a server.

Names load on first use: dispatch needs only ``tuned_rows`` (the standard library's
sqlite3), and should not pay for SQLAlchemy, which ``TuningDB`` and the models import.
"""

from tilegen.lazy import lazy_names

__all__ = [
    "DatabaseError",
    "IMPORTED",
    "RowError",
    "SCHEMA_REVISION",
    "TRIAL_STATUSES",
    "TrialRow",
    "TunedRow",
    "TuningDB",
    "VariantRow",
    "imported_study",
    "measured_study",
    "studies_path",
    "studies_url",
    "tuned_rows",
]

_WHERE = {
    "DatabaseError": "tilegen.db.errors",
    "IMPORTED": "tilegen.db.exchange",
    "RowError": "tilegen.db.validate",
    "SCHEMA_REVISION": "tilegen.db.sqlite",
    "TRIAL_STATUSES": "tilegen.db.models",
    "TrialRow": "tilegen.db.rows",
    "TunedRow": "tilegen.db.rows",
    "VariantRow": "tilegen.db.rows",
    "TuningDB": "tilegen.db.store",
    "imported_study": "tilegen.db.exchange",
    "measured_study": "tilegen.db.exchange",
    "studies_path": "tilegen.db.store",
    "studies_url": "tilegen.db.store",
    "tuned_rows": "tilegen.db.lookup",
}


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
