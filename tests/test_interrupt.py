"""A stop signal that lands in the database code is raised once the tune has left it."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import sqlalchemy

from tilegen.tuning.interrupt import interrupt


def _inside_sqlalchemy():
    """A function whose code sits in SQLAlchemy's folder, as a pooled connection's finalizer does."""
    source = "def call(f, sleep):\n    f(sys._getframe())\n    sleep(0.05)\n    return 'left'\n"
    namespace = {"sys": sys}
    exec(compile(source, os.path.join(os.path.dirname(sqlalchemy.__file__), "_finalizer.py"), "exec"), namespace)
    return namespace["call"]


def test_an_interrupt_outside_the_database_code_is_raised_at_once():
    with pytest.raises(KeyboardInterrupt):
        interrupt(sys._getframe())


def test_an_interrupt_inside_the_database_code_is_raised_once_it_has_left():
    before = signal.getsignal(signal.SIGALRM)
    call = _inside_sqlalchemy()
    returned = []
    with pytest.raises(KeyboardInterrupt):
        # Inside, the interrupt waits (through the SIGALRM retries during the sleep); out, it is raised.
        returned.append(call(interrupt, time.sleep))
        time.sleep(1)
    assert returned == ["left"]
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_an_interrupt_still_deferred_when_the_tune_ends_is_dropped():
    """A second Ctrl-C that lands in the database code while the tune handles the first (queuing its trial in
    flight again) is deferred; the tune then ends in its one line, and that interrupt must not be raised later,
    in the exit handlers, as a traceback."""
    from tilegen.cli.tune import _interrupts

    before = signal.getsignal(signal.SIGALRM)
    # The whole tune sits in SQLAlchemy's folder, so no retry can raise before the tune has ended.
    source = "def call(context, f):\n    with context():\n        f(sys._getframe())\n"
    namespace = {"sys": sys}
    exec(compile(source, os.path.join(os.path.dirname(sqlalchemy.__file__), "_finalizer.py"), "exec"), namespace)
    namespace["call"](_interrupts, interrupt)
    time.sleep(0.1)  # a retry still armed would raise here
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
