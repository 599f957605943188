"""Where a tuning database lives: a SQLite file, or a PostgreSQL server named by a SQLAlchemy URL.

A value with ``://`` in it is a URL; anything else is a file path. Only PostgreSQL through
psycopg 3 is a server tilegen stores to: Optuna's storages and tilegen's migrations are
tested there. ``postgresql://`` (the form ``psql`` and pgserver print) means the same.
"""

from __future__ import annotations

import os

from tilegen.db.errors import DatabaseError

__all__ = ["is_url", "refuse_file_uri", "server_url", "shown"]

#: What a server URL should look like, for error messages.
URL_EXAMPLE = "postgresql+psycopg://user:password@host:5432/dbname"


def is_url(value: str | os.PathLike[str] | None) -> bool:
    """Whether ``value`` names a database server rather than a file."""
    return isinstance(value, str) and "://" in value


def refuse_file_uri(value: str | os.PathLike[str]) -> None:
    """``DatabaseError`` for a SQLite ``file:`` URI where a file path is wanted: SQLite would open the file it names,
    while the studies file, the folders and every message took the text as a relative path (two files apart)."""
    if str(value).startswith("file:"):
        raise DatabaseError(f"{str(value)!r}: give a SQLite database as a file path, not a file: URI")


def server_url(text: str):
    """The SQLAlchemy URL of a server database; ``DatabaseError`` for a scheme tilegen cannot store to.

    >>> server_url("postgresql://tg@db.example.com/tilegen").render_as_string()
    'postgresql+psycopg://tg@db.example.com/tilegen'
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(text)
    except (ArgumentError, ValueError):  # ValueError: a port that is no number (an IPv6 host without brackets)
        raise DatabaseError(f"{text!r} is not a database URL; give a SQLite file path or a URL such as "
                            f"{URL_EXAMPLE}") from None
    if url.drivername in ("postgresql", "postgresql+psycopg"):
        url = url.set(drivername="postgresql+psycopg")
    elif url.drivername.startswith("sqlite"):
        raise DatabaseError(f"{shown(url)}: give a SQLite database as a file path, not a sqlite:// URL")
    else:
        raise DatabaseError(
            f"unsupported database URL scheme {url.drivername!r} in {shown(url)}; tilegen stores to a SQLite file "
            f"path or to PostgreSQL through psycopg ({URL_EXAMPLE})"
        )
    if not url.database:
        raise DatabaseError(f"{shown(url)} names no database; add it after the host, as in {URL_EXAMPLE}")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        raise DatabaseError(f"{shown(url)} needs psycopg 3: pip install \"psycopg[binary]\"") from None
    return url


def shown(url) -> str:
    """The URL with its password hidden, for messages and tables."""
    return url.render_as_string(hide_password=True)
