"""Generated sources on disk: rendered once, written atomically, imported once per process.

A file is named by the spec (readable name and hash) and the template hash, inside
a folder per tilegen and Triton version, so any change that could change the code
gives a new file rather than a stale one.

Importing a module runs it, so a module is imported only from a folder that is the user's
alone (``tilegen.files``): the cache folders are made 0700 and the files 0600. When the cache
folder (``TILEGEN_CACHE_DIR``) or the one inside it is another user's or writable by other
users, the process renders its modules into a private temporary folder of its own instead,
removed at exit, and warns once; the ops work as before, without the cache's reuse across
processes; so does a cache folder that cannot be made (a file in its place, no permission). A file in the
folder that is not the user's alone, or differs from the rendered source, is replaced by a fresh one before the
import, and its bytecode file removed (Python would take one of the same size and second as current); a bytecode
file that fails to load is removed and the module compiled again.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import triton

from tilegen import env
from tilegen.files import UnsafeError, private_folder, read_private, warn_once, write_atomically
from tilegen.version import __version__
from tilegen.codegen.render import render_spec, template_hash
from tilegen.families import family_of
from tilegen.ir import Spec

__all__ = ["source_for", "source_path", "module_for"]


def source_for(spec: Spec) -> str:
    """The generated Python source of the kernel and launcher for ``spec``, by its family's template."""
    return render_spec(family_of(spec), spec)


def source_path(spec: Spec) -> Path:
    """Where ``module_for`` keeps the source of ``spec`` in this process (see the module's notes)."""
    return _folder() / f"{spec.name}_{spec.hash}_{template_hash(family_of(spec))}.py"


def _folder() -> Path:
    name = f"tilegen-{__version__}_triton-{triton.__version__}"
    try:
        return private_folder(env.cache_dir(), name)
    except OSError as error:  # UnsafeError, or a folder that cannot be made: a file in its place, no permission
        return _scratch_folder(name, error)


def _scratch_folder(name: str, error: OSError) -> Path:
    scratch = _scratch()
    named = "TILEGEN_CACHE_DIR: " if os.environ.get("TILEGEN_CACHE_DIR") else ""
    warn_once(f"tilegen: not importing generated modules from the cache ({named}{error}); rendering them in "
              f"{scratch} for this process")
    return private_folder(scratch, name)


@functools.cache
def _scratch() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="tilegen-"))  # 0700, this process's
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@functools.cache
def module_for(spec: Spec) -> ModuleType:
    """Import the generated module for ``spec``, rendering and caching it first if needed."""
    if env.interpreting():
        from tilegen.triton_internals.interpreter import patch_interpreter

        patch_interpreter()
    data = source_for(spec).encode()  # Python reads a module's source as UTF-8
    path = source_path(spec)
    try:
        _place(path, data)
    except FileNotFoundError:  # the cache folder was removed meanwhile: made again, once
        path = source_path(spec)
        _place(path, data)
    except OSError as error:  # a folder where the file goes, say: this process's scratch folder instead
        path = _scratch_folder(path.parent.name, error) / path.name
        _place(path, data)
    name = f"tilegen_generated.{path.stem}"
    try:
        return _import(name, path)
    except FileNotFoundError:  # removed since it was written: written again, once
        _place(path, data)
        return _import(name, path)
    except (EOFError, ValueError, TypeError):
        # Bad marshal data: a broken bytecode file of the module, which Python would read again at every import.
        if not _drop_bytecode(path):
            raise
        return _import(name, path)


def _place(path: Path, data: bytes) -> None:
    """``data`` at ``path``, rewritten when absent, different (a hand-edited or truncated file must not be
    trusted) or not the user's alone: the import runs the file."""
    try:
        same = read_private(path) == data
    except FileNotFoundError:
        same = False
    except UnsafeError as error:
        warn_once(f"tilegen: replacing a generated module: {error}")
        same = False
    if not same:
        write_atomically(path, data)
        # Python takes a bytecode file as current when its source's size and modification second match: one of
        # the file just replaced could.
        _drop_bytecode(path)


def _drop_bytecode(path: Path) -> bool:
    """Remove the bytecode file Python keeps for ``path``; whether there was one."""
    try:
        Path(importlib.util.cache_from_source(str(path))).unlink()
    except (FileNotFoundError, NotImplementedError):  # none, or bytecode caching off in this interpreter
        return False
    return True


def _import(name: str, path: Path) -> ModuleType:
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # Triton reads kernel source through the module's file
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
