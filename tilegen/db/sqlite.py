"""The database layer's SQLAlchemy-free core: file names, revisions, read-only URIs, error wording.

Dispatch reads its handful of rows through here with the standard library's sqlite3:
importing SQLAlchemy, the models and an engine costs an inference process hundreds of
milliseconds on its first call, for one indexed query. Writers and the CLI use the
SQLAlchemy layer (``tilegen.db.store``), which shares these definitions.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from pathlib import Path
from urllib.parse import quote

from tilegen.db.errors import DatabaseError

__all__ = ["BUSY_TIMEOUT_MS", "FORGED_VIEWS", "REVISIONS", "SCHEMA_REVISION", "VERSION_TABLE", "explain_error",
           "lookup_error", "readonly_uri", "refuse_special"]

#: Every revision in ``migrations/versions``, oldest first (a test checks them against Alembic's).
REVISIONS = ("0001", "0002", "0003")

#: The newest revision: what a writable open upgrades a file to.
SCHEMA_REVISION = REVISIONS[-1]

#: Alembic's revision table, prefixed like the rest (Optuna has its own ``alembic_version``).
VERSION_TABLE = "tg_alembic_version"

#: How long a connection waits for another process's write lock before giving up.
BUSY_TIMEOUT_MS = 30_000


def readonly_uri(path: Path, immutable: bool = False) -> str:
    """A URI that opens ``path`` read-only; SQLite itself then refuses writes, so a shipped or shared
    file is never touched. ``immutable``: read the file alone, creating nothing beside it (no -shm)."""
    uri = f"file:{quote(str(path))}?mode=ro"
    if immutable or not (os.access(path.parent, os.W_OK) or _wal_beside(path)):
        # Reading a WAL file needs its -shm file, which SQLite cannot create in a folder we cannot write (an
        # installed wheel): read the file as immutable there. Where a writer's -wal and -shm are beside it (a team's
        # database that a tune is writing, or one killed mid-tune), SQLite reads them as they are: immutable would
        # leave out every row still in the -wal, and take no lock against the writer's checkpoint.
        uri += "&immutable=1"
    return uri


def _wal_beside(path: Path) -> bool:
    return all(os.path.isfile(f"{path}{suffix}") for suffix in ("-wal", "-shm"))


def explain_error(error: Exception, path: Path, readonly: bool) -> DatabaseError:
    """Turn SQLite's message (raw, or wrapped by SQLAlchemy) into one line that names the file."""
    text = str(getattr(error, "orig", None) or error)
    if "not a database" in text or "malformed" in text:
        return DatabaseError(f"not a tilegen database / corrupt: {path}")
    if "unable to open" in text or "readonly" in text or "read-only" in text:
        return DatabaseError(f"cannot open the tilegen database {path} for {'reading' if readonly else 'writing'}: {text}")
    return DatabaseError(f"tilegen database {path}: {text}")


#: A view under one of tilegen's table names (a forged file): reading it could run any query, one without end.
FORGED_VIEWS = "SELECT name FROM sqlite_master WHERE type = 'view' AND name LIKE 'tg\\_%' ESCAPE '\\'"


def refuse_special(path: Path) -> os.stat_result | None:
    """``DatabaseError`` for a path that exists but is no regular file (a pipe, a device, a socket): opening one
    would block or read without end; and for one whose lookup fails (see ``lookup_error``). Else the path's
    ``stat``, for the caller to read what it needs of it, or ``None`` when nothing is there."""
    try:
        found = path.stat()
    except OSError as e:
        if lookup_error(e):
            raise DatabaseError(f"cannot reach the tilegen database {path}: {e.strerror or e}") from None
        return None
    if not stat.S_ISREG(found.st_mode) and not stat.S_ISDIR(found.st_mode):
        raise DatabaseError(f"not a tilegen database: {path} is not a regular file")
    return found


def lookup_error(error: OSError) -> bool:
    """Whether ``error``, from looking a path up, says more than that nothing is there: a folder on the way that
    this user may not enter, a name too long. ``Path.exists`` raises those instead of answering False."""
    return error.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


def stored_revisions(conn: sqlite3.Connection, path: Path) -> tuple[str, ...]:
    """The file's revisions; ``DatabaseError`` for a file that is not tilegen's or is newer than this tilegen."""
    tables = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
    if conn.execute(tables, (VERSION_TABLE,)).fetchone() is None:
        raise DatabaseError(f"not a tilegen database / corrupt: {path}")
    view = conn.execute(FORGED_VIEWS).fetchone()
    if view is not None:
        raise DatabaseError(f"not a tilegen database / corrupt: {path} ({view[0]} is not a table)")
    current = tuple(revision for (revision,) in conn.execute(f"SELECT version_num FROM {VERSION_TABLE}"))
    newer = [revision for revision in current if revision not in REVISIONS]
    if newer:
        raise DatabaseError(
            f"{path} was written by a newer tilegen schema (revision {newer[0]}); "
            f"this tilegen knows up to revision {SCHEMA_REVISION}. Upgrade tilegen or use another database file"
        )
    if not current:
        raise DatabaseError(f"not a tilegen database / corrupt: {path}")
    return current


#: What ``read_tuned`` gives per row: the columns every revision since 0001 has that the row's check reads.
TUNED_FIELDS = ("bucket", "config_json", "time_ms", "max_error", "trials", "tflops", "gbps", "triton_version",
                "torch_version", "tilegen_version")
_TUNED = (
    f"SELECT {', '.join('t.' + name for name in TUNED_FIELDS)} FROM tg_tuned_configs t"
    " JOIN tg_variants v ON v.id = t.variant_id JOIN tg_gpus g ON g.id = t.gpu_id"
    " WHERE v.spec_hash = ? AND v.template_hash = ? AND g.key = ?"
)


_READ_STEPS = 50_000_000


def read_tuned(path: Path, spec_hash: str, template_hash: str, gpu_key: str) -> list[dict]:
    """The tuned rows of one variant on one GPU, every Triton's (the reader chooses among them), read-only,
    any known revision: ``TUNED_FIELDS`` of each as stored, unchecked (SQLite lets a column hold any type)."""
    found = refuse_special(path)  # nothing there: the connection below says so
    if found is not None and stat.S_ISDIR(found.st_mode):  # SQLite's own word for one is "disk I/O error"
        raise DatabaseError(f"not a tilegen database: {path} is a folder; give the database file")
    if found is not None and found.st_size == 0:  # a database with no rows yet, as tune and db take it
        return []
    try:
        conn = sqlite3.connect(readonly_uri(path), uri=True, timeout=BUSY_TIMEOUT_MS / 1000)
    except sqlite3.Error as e:
        raise explain_error(e, path, True) from e
    # A bound on the work of the read (SQLite's virtual machine steps, counted by the thousand): a variant's rows
    # take a few thousand; a forged file's query without end is interrupted, and the caller falls back.
    steps = [0]

    def budget() -> int:
        steps[0] += 1
        return steps[0] > _READ_STEPS // 1000

    conn.set_progress_handler(budget, 1000)
    # Text that is not UTF-8 (a forged file) reads as replacement characters, for the row's check to refuse,
    # instead of failing the whole read.
    conn.text_factory = lambda data: data.decode("utf-8", "replace")
    try:
        stored_revisions(conn, path)
        rows = conn.execute(_TUNED, (spec_hash, template_hash, gpu_key)).fetchall()
        return [dict(zip(TUNED_FIELDS, row)) for row in rows]
    except sqlite3.Error as e:
        raise explain_error(e, path, True) from e
    finally:
        conn.close()
