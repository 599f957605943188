"""Opening a tuning database file: connection settings, schema check, Alembic upgrade.

Connections run in WAL mode with a busy timeout, so readers never block the tuner and
concurrent writers wait for each other instead of failing. pysqlite's own transaction
handling is switched off and tilegen emits ``BEGIN`` itself: write sessions take the
write lock up front with ``BEGIN IMMEDIATE``, because in WAL mode a transaction that
reads first and writes later fails at once (no busy wait) when another process
committed in between.

Opening a file runs ``alembic upgrade head`` inside such a locked transaction, so two
processes opening a fresh file at once migrate it exactly once. A file already at
``SCHEMA_REVISION`` is recognised with one query, and a newer one against the revision
list of ``tilegen.db.sqlite``: Alembic, a slow import, is loaded only when a file needs
upgrading. A read-only open of an older revision reads an upgraded copy in memory.
(Dispatch does not come here at all: it reads with ``tilegen.db.sqlite``.)

A PostgreSQL server (``open_server_engine``) is migrated by the same revisions. There the
transaction that checks and upgrades the schema first takes a transaction-scoped advisory
lock, the server's counterpart of ``BEGIN IMMEDIATE``: tune processes on several hosts
starting at once against an empty database migrate it exactly once (PostgreSQL's DDL is
transactional, so the others find the tables when the lock is theirs).
"""

from __future__ import annotations

import functools
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import QueuePool, StaticPool

from tilegen.db.errors import DatabaseError
from tilegen.db.sqlite import (BUSY_TIMEOUT_MS, FORGED_VIEWS, REVISIONS, SCHEMA_REVISION, VERSION_TABLE, explain_error,
                               readonly_uri, refuse_special)

if TYPE_CHECKING:
    from alembic.config import Config as AlembicConfig

__all__ = [
    "BUSY_TIMEOUT_MS", "REVISIONS", "SCHEMA_REVISION", "WRITE", "open_engine", "open_server_engine",
    "explain_error", "explain_server_error", "advisory_key", "known_revisions", "studies_connection",
]

#: Execution option that makes a connection begin with ``BEGIN IMMEDIATE``.
WRITE = {"tilegen_write": True}

#: First half of every PostgreSQL advisory lock key tilegen takes ("tg"), so its locks never
#: collide with another application's on the same server.
ADVISORY_CLASS = 0x7467

#: Seconds a connection attempt to a server may take: an unreachable host fails in one line
#: instead of hanging for the operating system's TCP timeout.
CONNECT_TIMEOUT_S = 10

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
    refuse_special(path)
    if not readonly:
        _refuse_corrupt(path)
    engine = create_engine("sqlite://", creator=_connector(path, readonly), poolclass=QueuePool)
    event.listen(engine, "connect", functools.partial(_configure_connection, readonly=readonly))
    event.listen(engine, "begin", _begin)
    try:
        _check_schema(engine, path, readonly)
    except SQLAlchemyError as e:
        engine.dispose()
        raise explain_error(e, path, readonly) from e
    except _OlderSchema:
        engine.dispose()
        return _upgraded_copy(path)
    except DatabaseError:
        engine.dispose()
        raise
    return engine


def open_server_engine(url, shown: str, *, readonly: bool) -> Engine:
    """An engine on a PostgreSQL database whose schema is at the head revision (upgraded unless ``readonly``).

    Raises ``DatabaseError`` for a server it cannot reach or log in to, a database it may not
    read or write, or one of a newer schema; ``shown`` is the URL as messages print it.
    """
    engine = create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    try:
        _check_schema(engine, shown, readonly, server=True)
    except SQLAlchemyError as e:
        engine.dispose()
        raise explain_server_error(e, shown, readonly) from e
    except _OlderSchema as e:
        engine.dispose()
        raise DatabaseError(
            f"{shown} holds tilegen schema revision {e.args[0]}, older than this tilegen's {SCHEMA_REVISION}; "
            f"open it writable once (e.g. tilegen db list --db <url>) to upgrade it"
        ) from None
    except DatabaseError:
        engine.dispose()
        raise
    return engine


def explain_server_error(error: Exception, shown: str, readonly: bool) -> DatabaseError:
    """One line for what went wrong talking to a server, saying what to check."""
    text = " ".join(str(getattr(error, "orig", None) or error).split())
    lowered = text.lower()
    if "password" in lowered or "authentication" in lowered or ("role" in lowered and "does not exist" in lowered):
        return DatabaseError(f"cannot log in to {shown}: {text}; check the user name and password in the URL")
    if "database" in lowered and "does not exist" in lowered:
        return DatabaseError(f"{shown}: {text}; create the database first (createdb), or fix its name in the URL")
    if any(words in lowered for words in ("connection refused", "could not translate", "timeout", "timed out",
                                          "no such file or directory", "could not connect", "connection failed",
                                          "network is unreachable", "no route to host", "server closed")):
        return DatabaseError(f"cannot reach the database server {shown}: {text}; "
                             f"check the host and port in the URL, and that the server runs")
    if "permission denied" in lowered or "read-only" in lowered:
        return DatabaseError(f"cannot {'read' if readonly else 'write'} the tilegen database {shown}: {text}; "
                             f"grant this user access, or give another --db")
    return DatabaseError(f"tilegen database {shown}: {text}")


def advisory_key(name: str) -> int:
    """The second half of an advisory lock key: a stable signed 32-bit hash of ``name``."""
    import zlib

    value = zlib.crc32(name.encode())
    return value - 2**32 if value >= 2**31 else value


class _OlderSchema(Exception):
    """A read-only open met a known revision older than this tilegen's."""


def _upgraded_copy(path: Path) -> Engine:
    """An in-memory copy of a read-only file of an older schema, upgraded to the head revision.

    A read-only file (a shared one, or one shipped inside an installed wheel) cannot be
    migrated in place; reading it must still work, so its copy is. Such files are small.
    """
    try:
        source = sqlite3.connect(readonly_uri(path), uri=True)
        memory = sqlite3.connect(":memory:", check_same_thread=False)
        try:
            source.backup(memory)
        finally:
            source.close()
    except sqlite3.Error as e:
        raise explain_error(e, path, True) from e
    memory.isolation_level = None  # tilegen emits BEGIN itself, see _begin
    memory.execute("PRAGMA foreign_keys = ON")
    engine = create_engine("sqlite://", creator=lambda: memory, poolclass=StaticPool)
    event.listen(engine, "begin", _begin)
    try:
        _check_schema(engine, path, readonly=False)
    except SQLAlchemyError as e:
        engine.dispose()
        raise explain_error(e, path, True) from e
    return engine


def _refuse_corrupt(path: Path) -> None:
    """``DatabaseError`` for an existing file that is corrupt or not SQLite's, found read-only:
    a writable open sets WAL mode (a write to the file's header) and a tune creates the studies file
    beside it, so a file refused only later would have been changed first. ``quick_check`` reads the
    whole file once, which a writable open (a tune, an import) can afford."""
    if not path.is_file() or path.stat().st_size == 0:
        return  # a new file: SQLite creates it
    # A file that says it is in WAL mode gets -shm and -wal files beside it from a plain read-only open. Where none
    # is there (nor a rollback journal), no connection is writing it: the file alone is the database, read as
    # immutable, so that a corrupt one is left with nothing new beside it.
    alone = not any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-shm", "-journal"))
    try:
        connection = sqlite3.connect(readonly_uri(path, immutable=alone), uri=True, timeout=BUSY_TIMEOUT_MS / 1000)
    except sqlite3.Error as e:
        raise explain_error(e, path, True) from e
    try:
        problems = [row[0] for row in connection.execute("PRAGMA quick_check(1)")]
        if problems != ["ok"]:
            raise DatabaseError(f"not a tilegen database / corrupt: {path}")
        # Another program's tables (or a tune's Optuna studies file): tilegen adds its own only to a new file.
        tables = sorted(name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
        if tables and VERSION_TABLE not in tables:
            shown = ", ".join(tables[:3]) + (", ..." if len(tables) > 3 else "")
            raise DatabaseError(f"not a tilegen database: {path} holds other tables ({shown}); tilegen creates its "
                                "tables only in a new or empty file")
    except sqlite3.Error as e:
        raise explain_error(e, path, True) from e
    finally:
        connection.close()


def _connector(path: Path, readonly: bool):
    if readonly:
        uri = readonly_uri(path)
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


def studies_connection(path: str, timeout_s: float) -> sqlite3.Connection:
    """A connection to the file of Optuna's studies, for its engine: WAL and ``synchronous =
    NORMAL``, as tilegen's own file. Optuna's default, a rollback journal synced in full on every
    commit, made a trial's bookkeeping 45 ms against 32 (``tilegen.bench.bookkeeping`` on the 2-CPU
    CI machine); with WAL a killed process loses no commit, and a power cut only the last ones."""
    connection = sqlite3.connect(path, timeout=timeout_s, check_same_thread=False)
    try:
        cursor = connection.cursor()
        try:
            _enable_wal(cursor)
            cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()
    except sqlite3.Error:
        connection.close()
        raise
    return connection


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


def _check_schema(engine: Engine, path: Path | str, readonly: bool, *, server: bool = False) -> None:
    connectable = engine if readonly else engine.execution_options(**WRITE)
    with connectable.connect() as connection, connection.begin():
        if server and not readonly:
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({ADVISORY_CLASS}, 0)")
        current = _stored_revisions(connection)
        if current == (SCHEMA_REVISION,):
            return
        newer = [revision for revision in current if revision not in REVISIONS] if current else []
        if newer:
            raise DatabaseError(
                f"{path} was written by a newer tilegen schema (revision {newer[0]}); "
                f"this tilegen knows up to revision {SCHEMA_REVISION}. Upgrade tilegen or use another database file"
            )
        if readonly:
            if not current:
                if server:
                    raise DatabaseError(f"{path} holds no tilegen tables; any tilegen db command or tune with "
                                        f"--db and this URL creates them")
                raise DatabaseError(f"not a tilegen database / corrupt: {path}")
            raise _OlderSchema(current[0])
        from alembic import command  # here, not at the top: see the module docstring

        config = _alembic_config()
        config.attributes["connection"] = connection  # env.py migrates on this locked connection
        command.upgrade(config, "head")


def _stored_revisions(connection: Connection) -> tuple[str, ...]:
    """The revisions in the version table, none for a file without one (empty, or not tilegen's)."""
    if connection.dialect.name == "sqlite":
        tables = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
        if connection.exec_driver_sql(tables, (VERSION_TABLE,)).first() is None:
            return ()
        view = connection.exec_driver_sql(FORGED_VIEWS).first()
        if view is not None:
            raise DatabaseError(f"not a tilegen database / corrupt: {view[0]} is not a table")
    elif not inspect(connection).has_table(VERSION_TABLE):
        return ()
    return tuple(revision for (revision,) in connection.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}"))
