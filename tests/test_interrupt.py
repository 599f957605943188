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
