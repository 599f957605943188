"""Generated sources on disk: rendered once, written atomically, imported once per process.

A file is named by the spec (readable name and hash) and the template hash, inside
a folder per tilegen and Triton version, so any change that could change the code
gives a new file rather than a stale one.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import triton

from tilegen import env
from tilegen.files import write_atomically
from tilegen.version import __version__
from tilegen.codegen.render import render_spec, template_hash
from tilegen.families import family_of
from tilegen.ir import Spec

__all__ = ["source_for", "source_path", "module_for"]


def source_for(spec: Spec) -> str:
    """The generated Python source of the kernel and launcher for ``spec``, by its family's template."""
    return render_spec(family_of(spec), spec)


def source_path(spec: Spec) -> Path:
    folder = env.cache_dir() / f"tilegen-{__version__}_triton-{triton.__version__}"
    return folder / f"{spec.name}_{spec.hash}_{template_hash(family_of(spec))}.py"


@functools.cache
def module_for(spec: Spec) -> ModuleType:
    """Import the generated module for ``spec``, rendering and caching it first if needed."""
    if env.interpreting():
        from tilegen.triton_internals.interpreter import patch_interpreter

        patch_interpreter()
    path = source_path(spec)
    text = source_for(spec)
    # Rewrite when absent or different (a hand-edited or truncated file must not be trusted).
    if not path.exists() or path.read_text() != text:
        write_atomically(path, text)
    name = f"tilegen_generated.{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # Triton reads kernel source through the module's file
    module_spec.loader.exec_module(module)
    return module
