"""Stopping a tune from a signal handler without breaking the database code it interrupts.

Ctrl-C, SIGTERM and a pool's ``STOP_SIGNAL`` unwind a tune process as ``KeyboardInterrupt``,
after which the tuner queues its trial in flight again, which takes the studies' storage. Raised
inside SQLAlchemy or Optuna's storage, the exception could leave a pooled connection half used
for those writes, or land in one of SQLAlchemy's finalizers, where Python prints it as "Exception
ignored" and drops it: the tune would not stop. So a handler that finds the main thread there
raises it a few milliseconds later instead, once the thread has left.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

__all__ = ["cancel", "interrupt"]

#: How soon a deferred interrupt looks again.
_RETRY_S = 0.005


def _storage_roots() -> tuple[str, ...]:
    # Only modules already imported: code never loaded cannot be running.
    roots = []
    for name in ("sqlalchemy", "optuna.storages"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            roots.append(os.path.dirname(path) + os.sep)
    return tuple(roots)


def _in_storage(frame: FrameType | None) -> bool:
    roots = _storage_roots()
    while roots and frame is not None:
        if frame.f_code.co_filename.startswith(roots):
            return True
        frame = frame.f_back
    return False


_previous_alarm = None  # SIGALRM's handler before a retry was armed; None: none is armed


def interrupt(frame: FrameType | None) -> None:
    """From a signal handler given ``frame``: raise ``KeyboardInterrupt`` now, or, inside the
    database code, on SIGALRM once the main thread has left it."""
    global _previous_alarm
    if _in_storage(frame):
        if _previous_alarm is None:
            _previous_alarm = signal.signal(signal.SIGALRM, lambda _signum, later: interrupt(later))
        signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
        return
    cancel()
    raise KeyboardInterrupt


def cancel() -> None:
    """Drop an interrupt still deferred, once what it was to stop has ended: raised later, it would land in
    whatever runs next (the interpreter's exit handlers, which print it as a traceback)."""
    global _previous_alarm
    if _previous_alarm is not None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, _previous_alarm)
        _previous_alarm = None
