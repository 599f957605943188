"""Compiled kernels found again by a new process without going through Triton's JIT.

A process's first launch of a kernel goes through ``JITFunction.run``, and Triton's cache key
for the compiled kernel starts with a hash of Triton's own sources and of ``libtriton.so``:
about 0.4 s on the H200, once per process, before the cached kernel can even be looked up.
Once a direct launch (``tilegen.triton_internals.launch``) has been checked against the JIT, this index
records where Triton cached that kernel and how to describe its source again; a later
process with the same launch loads the kernel from Triton's cache directly.

A record's name is a hash of everything that decided the compiled kernel besides Triton's
own files: Triton's version and ``libtriton``'s size and modification time (standing in for
the hash of them), the device's compute capability, the kernel's source file, name and
source, the direct launch's fingerprint (dtypes, alignment, int classes, constexprs, launch
options), and Triton's cache-invalidating environment variables. Its content is Triton's
cache hash and what ``ASTSource`` needs. A record that is missing, unreadable or of another
layout, or whose kernel is gone from Triton's cache, sends the launch through the JIT as
before. The index is used only while the JIT has compiled nothing for the kernel in this
process: once it has, its own cache is as cheap to ask.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

from tilegen import env
from tilegen.files import write_atomically

__all__ = ["load", "store"]

#: Bumped when a record's content changes meaning.
_LAYOUT = 1


@functools.cache
def _triton_identity() -> tuple:
    import triton
    from triton._C import libtriton

    stat = os.stat(libtriton.__file__)
    return triton.__version__, stat.st_size, stat.st_mtime_ns


@functools.cache
def _target(device: int) -> tuple:
    """The compile target of ``device``, which is the current one when this is first asked."""
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    return target.backend, target.arch, target.warp_size


def _env_vars() -> tuple:
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
    except ImportError:
        return ()
    return tuple(sorted(get_cache_invalidating_env_vars().items()))


def _path(fn, device: int, fingerprint: Any) -> Path:
    code = fn.fn.__code__
    source = hashlib.sha256(fn.src.encode()).hexdigest()
    key = repr((_LAYOUT, _triton_identity(), _target(device), code.co_filename, fn.__name__, source,
                fingerprint, _env_vars()))
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    return env.cache_dir() / "kernels" / f"{fn.__name__}-{name}.pkl"


def _jit_is_cold(fn, device: int) -> bool:
    caches = fn.device_caches.get(device) if hasattr(fn.device_caches, "get") else None
    return caches is None or not caches[0]


def load(fn, device: int, fingerprint: Any):
    """``(kernel, tail)`` of a recorded launch whose kernel Triton still caches, else ``None``."""
    if not _jit_is_cold(fn, device):
        return None
    try:
        path = _path(fn, device, fingerprint)
        record = pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("layout") != _LAYOUT:
        return None
    from triton.compiler.compiler import ASTSource, CompiledKernel
    from triton.runtime.cache import get_cache_manager

    group = get_cache_manager(record["hash"]).get_group(f"{record['name'][:150]}.json")
    if not group:
        return None  # the kernel left Triton's cache: the JIT compiles it again
    try:
        source = ASTSource(fn, record["signature"], record["constexprs"], record["attrs"])
        return CompiledKernel(source, group, record["hash"]), record["tail"]
    except Exception:  # noqa: BLE001 - files of another layout: the JIT's path is the answer
        return None


def store(fn, device: int, fingerprint: Any, kernel, tail: tuple) -> None:
    """Record a launch the JIT has just confirmed; errors are ignored (the index is a cache)."""
    try:
        path = _path(fn, device, fingerprint)
        if path.exists():
            return
        source = kernel.src
        record = {"layout": _LAYOUT, "hash": kernel.hash, "name": source.name, "signature": dict(source.signature),
                  "constexprs": dict(source.constants), "attrs": dict(source.attrs), "tail": tail}
        write_atomically(path, pickle.dumps(record))
    except Exception:  # noqa: BLE001 - an unwritable cache or an unpicklable value: no record, nothing else
        return
