"""The one error the database layer raises for a file it cannot use."""

from __future__ import annotations

__all__ = ["DatabaseError"]


class DatabaseError(RuntimeError):
    """A tuning database that cannot be opened, read or written; the message is one user-facing line."""
