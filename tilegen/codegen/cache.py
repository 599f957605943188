"""Generated sources on disk: rendered once, written atomically, imported once per process.

A file is named by the spec (readable name and hash) and the template hash, inside
a folder per tilegen and Triton version, so any change that could change the code
gives a new file rather than a stale one.

Importing a module runs it, so a module is imported only from a folder that is the user's
alone (``tilegen.files``): the cache folders are made 0700 and the files 0600. When the cache
folder (``TILEGEN_CACHE_DIR``) or the one inside it is another user's or writable by other
users, the process renders its modules into a private temporary folder of its own instead,
removed at exit, and warns once; the ops work as before, without the cache's reuse across
processes. A file in the folder that is not the user's alone, or differs from the rendered
source, is replaced by a fresh one before the import.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
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
    except UnsafeError as error:
        scratch = _scratch()
        warn_once(f"tilegen: not importing generated modules from the cache ({error}); "
                  f"rendering them in {scratch} for this process")
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
    path = source_path(spec)
    text = source_for(spec)
    # Rewrite when absent, different (a hand-edited or truncated file must not be trusted) or not
    # the user's alone: the import runs the file.
    data = text.encode()  # Python reads a module's source as UTF-8
    try:
        same = read_private(path) == data
    except FileNotFoundError:
        same = False
    except UnsafeError as error:
        warn_once(f"tilegen: replacing a generated module: {error}")
        same = False
    if not same:
        write_atomically(path, data)
    name = f"tilegen_generated.{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # Triton reads kernel source through the module's file
    module_spec.loader.exec_module(module)
    return module
