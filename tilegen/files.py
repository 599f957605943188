"""Files tilegen writes into its caches: whole or not at all, and only where no one else can.

What tilegen reads back from its cache decides what code runs: a generated module is
imported, a kernel index record names a compiled kernel to launch. So, as Python does
with its own bytecode cache, the cache is made private to the user (folders 0700, files
0600) and a folder or file in it that another user owns or could write is not trusted:
``private_folder`` and ``read_private`` raise ``UnsafeError`` for it, and their callers go
round it (with one warning per folder or file) rather than use it.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
import warnings
from pathlib import Path

__all__ = ["UnsafeError", "private_folder", "read_private", "warn_once", "write_atomically"]


class UnsafeError(OSError):
    """A cache folder or file that another user owns or could write."""


def write_atomically(path: Path, text: str | bytes) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it (mode 0600), so that readers
    (another process importing a generated module, say) see the old file or the whole new one,
    never a torn one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _refusal(path: Path, info: os.stat_result) -> str | None:
    """Why ``path`` (whose status is ``info``) cannot be trusted, or ``None``."""
    if info.st_uid != os.geteuid():
        return f"{path} is owned by user id {info.st_uid}, not this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def private_folder(root: Path, relative: str | Path = "") -> Path:
    """``root / relative``, each missing folder made private to the user (0700); raises
    ``UnsafeError`` when ``root`` or a folder below it on the way is not the user's alone to write."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = root
    _check_folder(folder)
    for part in Path(relative).parts:
        folder = folder / part
        folder.mkdir(mode=0o700, exist_ok=True)
        _check_folder(folder)
    return folder


def _check_folder(folder: Path) -> None:
    info = os.stat(folder)
    problem = _refusal(folder, info) if stat.S_ISDIR(info.st_mode) else f"{folder} is not a folder"
    if problem:
        raise UnsafeError(problem)


def read_private(path: Path) -> bytes:
    """The bytes of ``path``, a plain file of the user's that no one else can write (checked on the
    open file, so a file swapped in between is not read); ``FileNotFoundError`` when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeError(f"{path} is a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # before fdopen, which refuses a folder naming the descriptor
            raise UnsafeError(f"{path} is not a plain file")
        problem = _refusal(path, info)
        if problem:
            raise UnsafeError(problem)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read()


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(message: str) -> None:
    """A ``RuntimeWarning`` with ``message``, once per process."""
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
