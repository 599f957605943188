"""``tuned_rows``: what dispatch reads, once per (spec, device), from the user's and the shipped database.

The op must run even when a database cannot be read: a broken, foreign or newer file
costs one warning and its rows, never an exception. Both files are opened read-only,
so an inference process never creates, migrates or locks a database. They are read with
the standard library's sqlite3 (``tilegen.db.sqlite``): SQLAlchemy and the models are for
writers, and cost a first call more than the query. Any known schema revision reads, so
an older shipped file (inside a read-only wheel) needs no upgrade.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tilegen import env
from tilegen.db.errors import DatabaseError
from tilegen.db.sqlite import read_tuned
from tilegen.db.validate import RowError, check_best, config_from_json, safe_text
from tilegen.device import DeviceInfo
from tilegen.families import Config
from tilegen.ir import Spec

__all__ = ["tuned_rows"]

log = logging.getLogger("tilegen.db")

_warned: set[str] = set()


def tuned_rows(
    spec: Spec, device: DeviceInfo, template_hash: str, triton_version: str, *, user_db: Path | None = None
) -> dict[int, tuple[Config, str]]:
    """Tuned configs by bucket, each with the database file it came from; the user's rows win per bucket.

    ``user_db`` defaults to ``tilegen.env.db_path()``; a file that does not exist is skipped
    (and not created), as is a missing shipped database. A row that fails the writers' checks
    (``tilegen.db.validate.check_best``: a config the family cannot run on ``device``, a bucket
    its rule never gives, a value of the wrong type, as an edited or forged file holds) is
    skipped with a warning, so one bad row never breaks the op.
    """
    rows: dict[int, tuple[Config, str]] = {}
    # Shipped first, so the user's rows overwrite it bucket by bucket.
    for path in (env.shipped_db_path(), user_db if user_db is not None else env.db_path()):
        if not path.exists():
            continue
        try:
            found = read_tuned(path, spec.hash, template_hash, device.key, triton_version)
        except DatabaseError as e:
            _warn_once(f"tilegen: ignoring the tuning database: {e}")
            continue
        for row in found:
            try:
                versions = {name: row[name] for name in ("triton_version", "torch_version", "tilegen_version")}
                config = check_best(spec, device, row["bucket"], config_from_json(row["config_json"]), row["time_ms"],
                                    row["max_error"], row["trials"], tflops=row["tflops"], gbps=row["gbps"],
                                    versions=versions)
            except RowError as e:
                _warn_once(f"tilegen: ignoring a tuned row of {spec.name} (bucket {safe_text(repr(row['bucket']), 40)}) "
                           f"in {safe_text(path)}: {e}")
                continue
            bucket = row["bucket"]
            rows[bucket] = (config, str(path))
    return rows


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)
