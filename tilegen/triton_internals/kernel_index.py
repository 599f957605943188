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
options), and Triton's cache-invalidating environment variables. Its content is plain JSON
(never pickle: a record is data, and reading it must not run code): Triton's cache hash and
what ``ASTSource`` needs, each field checked to be exactly the type it must be. A record
that is missing, unreadable, of another layout or of any other shape, in a cache folder or
file another user could write (``tilegen.files``), or whose kernel is gone from Triton's
cache, sends the launch through the JIT as before. The index is used only on a Triton whose
internals are recognised (``gate``), and only while the JIT has compiled nothing for the
kernel in this process: once it has, its own cache is as cheap to ask.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from tilegen import env
from tilegen.files import UnsafeError, private_folder, read_private, warn_once, write_atomically
from tilegen.triton_internals import OPTIONS, gate

__all__ = ["decode", "encode", "load", "store"]

#: Bumped when a record's content changes meaning (2: JSON, where 1 was a pickle).
_LAYOUT = 2
#: Triton's cache hash names a folder of its cache: nothing that could name another folder.
_HASH = re.compile(r"[A-Za-z0-9_-]{1,128}")


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


def _folder() -> Path | None:
    """The index's folder, or ``None`` (after one warning) when another user could write to it."""
    try:
        return private_folder(env.cache_dir(), "kernels")
    except UnsafeError as error:
        warn_once(f"tilegen: not using the kernel index: {error}")
    except OSError:
        pass  # an unwritable cache: no index, and nothing to warn about
    return None


def _name(fn, device: int, fingerprint: Any) -> str:
    code = fn.fn.__code__
    source = hashlib.sha256(fn.src.encode()).hexdigest()
    # With the compile options the launches pass: a record of a kernel compiled under others is not this one's.
    key = repr((_LAYOUT, _triton_identity(), _target(device), code.co_filename, fn.__name__, source,
                fingerprint, _env_vars(), sorted(OPTIONS.items())))
    return f"{fn.__name__}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _jit_is_cold(fn, device: int) -> bool:
    caches = fn.device_caches.get(device) if hasattr(fn.device_caches, "get") else None
    return caches is None or not caches[0]


# The record's JSON: {"layout": 2, "hash": str, "name": str, "signature": [[param, type], ...],
# "constexprs": [[path, scalar], ...], "attrs": [[path, [[attribute, scalar], ...]], ...],
# "tail": [[true, param] or [false, scalar], ...]}, a path being a list of ints (Triton's tuple keys).

def _scalar(value) -> bool:
    return value is None or type(value) in (bool, int, float, str)


def _path(value) -> bool:
    return type(value) is list and bool(value) and all(type(i) is int and i >= 0 for i in value)


def _pairs(value, check) -> bool:
    return type(value) is list and all(type(p) is list and len(p) == 2 and check(*p) for p in value)


def encode(hash_: str, name: str, signature: dict, constexprs: dict, attrs: dict, tail: tuple) -> str | None:
    """The JSON record of a launch, or ``None`` where a value is not one ``decode`` gives back as it was."""
    record = {
        "layout": _LAYOUT, "hash": hash_, "name": name,
        "signature": [[k, v] for k, v in signature.items()],
        "constexprs": [[list(k) if type(k) is tuple else k, v] for k, v in constexprs.items()],
        "attrs": [[list(k) if type(k) is tuple else k, v] for k, v in attrs.items()],
        "tail": [list(item) if type(item) is tuple else item for item in tail],
    }
    try:
        text = json.dumps(record, allow_nan=False)
    except (TypeError, ValueError):
        return None
    # Only what comes back exactly (tuples as tuples, lists as lists, no float turned int) is kept.
    if decode(text) != (hash_, name, signature, constexprs, attrs, tail):
        return None
    return text


def _refuse_constant(name):
    raise ValueError(f"{name} is not a number JSON allows")


def decode(text: str | bytes):
    """``(hash, name, signature, constexprs, attrs, tail)`` of a record, ``None`` for anything that
    is not exactly a record of this layout."""
    try:
        record = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return None
    if type(record) is not dict or set(record) != {"layout", "hash", "name", "signature", "constexprs", "attrs",
                                                     "tail"}:
        return None
    if type(record["layout"]) is not int or record["layout"] != _LAYOUT:
        return None
    hash_, name = record["hash"], record["name"]
    if type(hash_) is not str or not _HASH.fullmatch(hash_) or type(name) is not str or not name.isidentifier():
        return None
    signature, constexprs, attrs, tail = record["signature"], record["constexprs"], record["attrs"], record["tail"]
    if not (_pairs(signature, lambda k, v: type(k) is str and type(v) is str)
            and _pairs(constexprs, lambda k, v: _path(k) and _scalar(v))
            and _pairs(attrs, lambda k, v: _path(k) and _pairs(v, lambda a, x: type(a) is str and _scalar(x)))
            and _pairs(tail, lambda named, v: type(named) is bool and (type(v) is str if named else _scalar(v)))):
        return None
    decoded = dict(signature), {tuple(k): v for k, v in constexprs}, {tuple(k): v for k, v in attrs}
    if any(len(d) != len(pairs) for d, pairs in zip(decoded, (signature, constexprs, attrs))):
        return None  # a key twice: which one Triton was given cannot be told
    return (hash_, name, *decoded, tuple(tuple(item) for item in tail))


def load(fn, device: int, fingerprint: Any):
    """``(kernel, tail)`` of a recorded launch whose kernel Triton still caches, else ``None``."""
    if gate.reason() is not None or not _jit_is_cold(fn, device):
        return None
    folder = _folder()
    if folder is None:
        return None
    path = folder / _name(fn, device, fingerprint)
    try:
        found = decode(read_private(path))
    except UnsafeError as error:
        warn_once(f"tilegen: not reading a kernel index record: {error}")
        return None
    except OSError:
        return None
    if found is None:
        return None
    hash_, name, signature, constexprs, attrs, tail = found
    if name != fn.__name__ or list(signature) != [p.name for p in fn.params]:
        return None  # another kernel's record: its launcher would lay the arguments out otherwise
    from triton.compiler.compiler import ASTSource, CompiledKernel
    from triton.runtime.cache import get_cache_manager

    try:
        group = get_cache_manager(hash_).get_group(f"{name[:150]}.json")
        if not group:
            return None  # the kernel left Triton's cache: the JIT compiles it again
        if getattr(fn, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
        return CompiledKernel(ASTSource(fn, signature, constexprs, attrs), group, hash_), tail
    except Exception:  # noqa: BLE001 - files of another layout, or a record that does not fit fn: the JIT's path
        return None


def store(fn, device: int, fingerprint: Any, kernel, tail: tuple) -> None:
    """Record a launch the JIT has just confirmed; errors are ignored (the index is a cache)."""
    if gate.reason() is not None:
        return
    try:
        folder = _folder()
        if folder is None:
            return
        # Written even over a record that is there: this launch found none it could use in it.
        path = folder / _name(fn, device, fingerprint)
        source = kernel.src
        text = encode(kernel.hash, source.name, dict(source.signature), dict(source.constants), dict(source.attrs),
                      tail)
        if text is not None:
            write_atomically(path, text)
    except Exception:  # noqa: BLE001 - an unwritable cache or an unexpected value: no record, nothing else
        return
