"""What the processes of a tune share: whether this one may fork a child, a child's logging and
its exit, and the tiny compile that pays Triton's one-time costs ahead of the first config.

The measuring worker (``tilegen.tuning.worker``) and the compile-ahead processes
(``tilegen.tuning.compile_ahead``) both start children this way; neither imports the other.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time

import triton
import triton.language as tl

__all__ = ["exit_now", "first_compile", "forkable", "leave_with_parent", "log_to_stderr"]


def log_to_stderr(level: int) -> None:
    """In a child process: tilegen.tuning's lines at ``level`` (the parent's) go to stderr, stamped
    with the wall clock and the process, so several processes' lines can be put in one order."""
    logger = logging.getLogger("tilegen.tuning")
    if level >= logging.WARNING or logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(created).3f %(process)d %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


def forkable() -> bool:
    """Whether a fork of this process is a clean start for a child: CUDA's driver API not yet
    initialized (a child cannot use a CUDA the parent initialized; torch reports only its own
    start of it), and no other thread, whose locks the child would inherit held."""
    from tilegen import env
    from tilegen.triton_internals import warmup
    from tilegen.triton_internals.interpreter import InterpreterSetupError, check_interpreter

    warmup.wait()  # its result (Triton's cache key) is worth inheriting, not cutting short
    if env.interpreting() and "triton.language" in sys.modules:
        # A copy has Triton as this process imported it; TRITON_INTERPRET set since (the tune
        # command sets it on a machine without a GPU) needs a fresh interpreter to take effect.
        try:
            check_interpreter()
        except InterpreterSetupError:
            return False
    return _driver_initialized() is False and threading.active_count() == 1


#: What the driver API answers before ``cuInit``.
_CUDA_ERROR_NOT_INITIALIZED = 3


def _driver_initialized() -> bool | None:
    """Whether this process initialized CUDA's driver API (``cuInit``); ``None`` when it cannot tell.

    Loading the library is not enough to spoil a fork: CUDA builds of torch load ``libcuda`` at
    import. Asked for a device count before ``cuInit``, the driver answers that it is not
    initialized, and initializes nothing."""
    try:
        with open("/proc/self/maps") as f:
            if "libcuda.so" not in f.read():
                return False
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)  # the copy already loaded, or none
    except OSError:
        return None
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED


def exit_now(code: int = 0) -> None:
    """Leave with ``code`` once the output is flushed, skipping the interpreter's teardown (torch,
    Triton, Optuna: about a second) that a waiting parent would otherwise sit through."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def leave_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


@triton.jit
def _first_compile(x_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)


def first_compile(x) -> None:
    """Launch (in a compile process: compile) a tiny kernel on ``x``, 16 floats: a process's first
    compile pays Triton's one-time costs, which this takes off a real kernel's. Its entry in
    Triton's cache is a few kilobytes."""
    _first_compile[(1,)](x, N=16)
