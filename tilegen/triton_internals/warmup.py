"""Triton's one-time costs of a process, paid in the background from ``import tilegen``.

The first kernel launch of a process, even with every cache warm, spends most of its time
in two places that have nothing to do with the kernel (measured on the H200, Triton 3.6:
0.61 s for the first ``tilegen.attention`` call, 0.39 s and 0.13 s of it here):

- ``triton.runtime.cache.triton_key()``: a hash of Triton's own compiler sources and of
  ``libtriton.so`` (hundreds of megabytes), which every compiled kernel's cache key includes;
  computed once per process and memoised.
- importing ``triton.experimental.gluon``, which the argument specialization of the first
  launch pulls in.

Both are pure functions of the installed Triton, so a daemon thread started at import does
them while the process goes on importing and setting up (hashing releases the GIL). A launch
through the JIT waits for the thread first, so the work is never done twice; a launch that
the kernel index (``tilegen.triton_internals.kernel_index``) serves needs neither, and does not wait. On a
Triton whose internals are not recognised (``tilegen.triton_internals.gate``) the thread
does nothing else; under the interpreter, which compiles nothing, it is not started.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading

__all__ = ["start", "wait"]

_thread: threading.Thread | None = None
_lock = threading.Lock()


def _work() -> None:
    try:
        from triton.runtime import cache

        from tilegen.triton_internals import gate

        # Asked here, off the importing thread: the launches ask it again, answered by then.
        if gate.reason() is not None:
            return  # another Triton's cache may key on other things: leave its first launch to it

        # Gluon first: the importing thread reaches it only at a first call (a generated module
        # imports it), by which time this import is long done.
        if importlib.util.find_spec("triton.experimental.gluon") is not None:
            importlib.import_module("triton.experimental.gluon")
        key = getattr(cache, "triton_key", None)
        if callable(key):
            key()
    except BaseException:  # noqa: BLE001 - a warm-up must never fail a process; the launch redoes it
        pass


def start() -> None:
    """Start the warm-up once per process (a no-op afterwards)."""
    global _thread
    with _lock:
        if _thread is None:
            # Triton is imported whole here, in the calling thread, before the warm-up starts: a
            # thread importing Triton's modules while another imports others of them can meet the
            # package half made (seen on the H200: ``KeyError: 'triton'`` from its C extension's
            # submodules in ``triton.tools``). ``import triton`` brings every module the warm-up
            # and the gate read, and the importing thread needs them next anyway.
            import triton  # noqa: F401
            import triton.tools.tensor_descriptor  # noqa: F401

            _thread = threading.Thread(target=_work, name="tilegen-triton-warmup", daemon=True)
            _thread.start()


def wait() -> None:
    """Block until the warm-up is done, if it was started; cheap once it is."""
    thread = _thread
    if thread is not None and thread.is_alive():
        thread.join()
