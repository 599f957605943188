"""Every path tilegen reads or writes, and the environment variables that move them."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import platformdirs

__all__ = ["cache_dir", "db_path", "db_target", "shipped_db_path", "template_dir", "interpreting", "debug"]

_PACKAGE = Path(__file__).resolve().parent


def cache_dir() -> Path:
    """Where generated kernel sources and the kernel index go (``TILEGEN_CACHE_DIR`` overrides); made
    private to the user, and not trusted where another user could write to it (``tilegen.files``)."""
    override = os.environ.get("TILEGEN_CACHE_DIR")
    return _absolute(override) if override else Path(platformdirs.user_cache_dir("tilegen"))


def db_path() -> Path:
    """The user's local tuning database file, which dispatch reads (``TILEGEN_DB`` overrides).

    When ``TILEGEN_DB`` names a database server, this is still the file in the user data
    folder: dispatch never talks to a server (``tilegen db pull`` copies rows into this file).
    """
    override = os.environ.get("TILEGEN_DB")
    if override and "://" not in override:
        return _absolute(override)
    return Path(platformdirs.user_data_dir("tilegen")) / "tuning.sqlite"


@functools.cache
def _absolute(value: str) -> Path:
    """A variable's path made absolute the first time this process reads that value: a relative one keeps naming
    the same place when the process changes its working directory later."""
    try:
        return Path(value).expanduser().absolute()
    except RuntimeError:  # pathlib's answer to "~name" of no user known here: an OSError, as of a path not there
        raise FileNotFoundError(f"{value}: no user's home folder to expand its '~' into") from None


def db_target() -> str | Path:
    """Where ``tilegen tune`` and ``tilegen db`` read and write: ``TILEGEN_DB`` (a file, or a server's
    URL), else the file in the user data folder; ``--db`` overrides both."""
    override = os.environ.get("TILEGEN_DB")
    return override if override and "://" in override else db_path()


def shipped_db_path() -> Path:
    """The read-only database that ships with tilegen, consulted after the user's."""
    for candidate in (_PACKAGE / "tuning_db" / "tuned.sqlite", _PACKAGE.parent / "tuning_db" / "tuned.sqlite"):
        if candidate.exists():
            return candidate
    return _PACKAGE / "tuning_db" / "tuned.sqlite"


def template_dir() -> Path:
    """Templates ship inside the wheel as ``tilegen/templates``; a source checkout keeps them at the top."""
    for candidate in (_PACKAGE / "templates", _PACKAGE.parent / "templates"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"tilegen templates not found next to {_PACKAGE}")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# The ops ask ``debug`` at every call. ``os.environ.get`` encodes the name and decodes the value each time (1.3 µs
# on the CPU machine, a short ragged call's whole lead over SDPA's host time); its encoded mapping, which setting
# and deleting keep current, answers in 0.07.
_ENVIRON = getattr(os.environ, "_data", None)
_DEBUG = os.environ.encodekey("TILEGEN_DEBUG") if _ENVIRON is not None and hasattr(os.environ, "encodekey") else None
_OFF = ("", "0", b"", b"0")


def debug() -> bool:
    """Whether ops also check values on the device, at one synchronization per call (``TILEGEN_DEBUG=1``)."""
    value = _ENVIRON.get(_DEBUG) if _DEBUG is not None else os.environ.get("TILEGEN_DEBUG")
    return value is not None and value not in _OFF
