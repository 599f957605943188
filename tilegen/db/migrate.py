"""Opening a tuning database file: connection settings, schema check, Alembic upgrade.

Connections run in WAL mode with a busy timeout, so readers never block the tuner and
concurrent writers wait for each other instead of failing. pysqlite's own transaction
handling is switched off and tilegen emits ``BEGIN`` itself: write sessions take the
write lock up front with ``BEGIN IMMEDIATE``, because in WAL mode a transaction that
reads first and writes later fails at once (no busy wait) when another process
committed in between.

Opening a file runs ``alembic upgrade head`` inside such a locked transaction, so two
processes opening a fresh file at once migrate it exactly once. A file already at
``SCHEMA_REVISION`` is recognised with one query: Alembic, a slow import that an
inference process should not pay, is loaded only when a file needs upgrading or holds an
unknown revision.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import QueuePool

from tilegen.db.errors import DatabaseError
from tilegen.db.models import VERSION_TABLE

if TYPE_CHECKING:
    from alembic.config import Config as AlembicConfig

__all__ = ["BUSY_TIMEOUT_MS", "SCHEMA_REVISION", "WRITE", "open_engine", "explain_error", "known_revisions"]

#: The newest revision in ``migrations/versions`` (a test checks it against Alembic's head).
SCHEMA_REVISION = "0001"

#: How long a connection waits for another process's write lock before giving up.
BUSY_TIMEOUT_MS = 30_000

#: Execution option that makes a connection begin with ``BEGIN IMMEDIATE``.
WRITE = {"tilegen_write": True}

_MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def known_revisions() -> list[str]:
    """Every revision in ``migrations/versions``, oldest first, as Alembic reads them."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(_alembic_config())
    return [revision.revision for revision in reversed(list(script.walk_revisions()))]


def _alembic_config() -> AlembicConfig:
    from alembic.config import Config

    config = Config()
    # The value goes through ConfigParser interpolation, where a bare "%" is an error.
    config.set_main_option("script_location", str(_MIGRATIONS).replace("%", "%%"))
    return config


def open_engine(path: Path, *, readonly: bool) -> Engine:
    """An engine on ``path`` whose schema is at the head revision (upgraded first unless ``readonly``).

    Raises ``DatabaseError`` for a corrupt or foreign file, a newer schema, or a path that
    cannot be opened.
    """
    engine = create_engine("sqlite://", creator=_connector(path, readonly), poolclass=QueuePool)
    event.listen(engine, "connect", functools.partial(_configure_connection, readonly=readonly))
    event.listen(engine, "begin", _begin)
    try:
        _check_schema(engine, path, readonly)
    except SQLAlchemyError as e:
        engine.dispose()
        raise explain_error(e, path, readonly) from e
    except DatabaseError:
        engine.dispose()
        raise
    return engine


def explain_error(error: SQLAlchemyError | sqlite3.Error, path: Path, readonly: bool) -> DatabaseError:
    """Turn SQLite's message into one line that names the file."""
    text = str(getattr(error, "orig", None) or error)
    if "not a database" in text or "malformed" in text:
        return DatabaseError(f"not a tilegen database / corrupt: {path}")
    if "unable to open" in text or "readonly" in text or "read-only" in text:
        return DatabaseError(f"cannot open the tilegen database {path} for {'reading' if readonly else 'writing'}: {text}")
    return DatabaseError(f"tilegen database {path}: {text}")


def _connector(path: Path, readonly: bool):
    if readonly:
        # mode=ro: SQLite itself refuses writes, so a shipped or shared file is never touched.
        uri = f"file:{quote(str(path))}?mode=ro"
        if not os.access(path.parent, os.W_OK):
            # Reading a WAL file needs its -shm file, which SQLite cannot create in a folder we
            # cannot write (an installed wheel). Nothing writes the file there: read it as immutable.
            uri += "&immutable=1"
        return lambda: sqlite3.connect(uri, uri=True, check_same_thread=False)
    return lambda: sqlite3.connect(str(path), check_same_thread=False)


def _configure_connection(dbapi_connection: sqlite3.Connection, _record, *, readonly: bool) -> None:
    dbapi_connection.isolation_level = None  # tilegen emits BEGIN itself, see _begin
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            _enable_wal(cursor)
            # With WAL, NORMAL never corrupts the file; a power cut may only drop the last commits.
            cursor.execute("PRAGMA synchronous = NORMAL")
    finally:
        cursor.close()


def _enable_wal(cursor: sqlite3.Cursor) -> None:
    """Switch the file to WAL (a persistent setting); reading the mode also rejects a junk file here."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while cursor.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as e:
            # Two processes switching a fresh file at once both hold a shared lock and want an
            # exclusive one; SQLite fails one of them at once rather than wait (no busy
            # handler for a deadlock), so the loser waits here and finds WAL on.
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _begin(connection: Connection) -> None:
    immediate = connection.get_execution_options().get("tilegen_write", False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _check_schema(engine: Engine, path: Path, readonly: bool) -> None:
    connectable = engine if readonly else engine.execution_options(**WRITE)
    with connectable.connect() as connection, connection.begin():
        current = _stored_revisions(connection)
        if current == (SCHEMA_REVISION,):
            return
        newer = [revision for revision in current if revision not in known_revisions()] if current else []
        if newer:
            raise DatabaseError(
                f"{path} was written by a newer tilegen schema (revision {newer[0]}); "
                f"this tilegen knows up to revision {SCHEMA_REVISION}. Upgrade tilegen or use another database file"
            )
        if readonly:
            if not current:
                raise DatabaseError(f"not a tilegen database / corrupt: {path}")
            raise DatabaseError(
                f"{path} has an older tilegen schema (revision {current[0]}, this tilegen needs {SCHEMA_REVISION}); "
                f"upgrade it by opening it writable once: tilegen db --db {path} list"
            )
        from alembic import command  # here, not at the top: see the module docstring

        config = _alembic_config()
        config.attributes["connection"] = connection  # env.py migrates on this locked connection
        command.upgrade(config, "head")


def _stored_revisions(connection: Connection) -> tuple[str, ...]:
    """The revisions in the version table, none for a file without one (empty, or not tilegen's)."""
    tables = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
    if connection.exec_driver_sql(tables, (VERSION_TABLE,)).first() is None:
        return ()
    return tuple(revision for (revision,) in connection.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}"))
