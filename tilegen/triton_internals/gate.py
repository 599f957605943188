"""The one place that decides whether this Triton's internals are the ones tilegen was written against.

Every piece of ``tilegen.triton_internals`` that reads or patches Triton's private code asks
``internals()`` first (direct launch, the kernel index, the warm-up, compile-ahead's
compile-only mode) and steps aside on an answer it does not recognise, leaving Triton's
public path: ``kernel[grid](...)`` through the JIT. The interpreter's fixes are the one
exception: each is applied where a probe of the installed interpreter shows its bug
(``interpreter``), which answers for any version, known or not.

A Triton is recognised by what it runs, not by its version string: the source of
``JITFunction.run`` (hashed) names one of the variants below, ``CompiledKernel``'s launch
members hash as read, and the other internals the pieces touch are where they expect them.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
import threading
from dataclasses import dataclass

__all__ = ["Variant", "forget", "internals", "reason"]


@dataclass(frozen=True)
class Variant:
    """What one recognised ``JITFunction.run`` reads besides its arguments."""

    versions: str
    options: tuple[str, ...]  # knobs.compilation fields it adds to the options (debug is handled apart)
    stages_hook: bool  # reads knobs.runtime.add_stages_inspection_hook into the specialization

    @property
    def fpsan(self) -> bool:
        return "fpsan_homomorphic_casts" in self.options


# sha256 (first 16 hex digits) of textwrap.dedent(inspect.getsource(JITFunction.run)). Each of
# these was read: the launch is `kernel.run(grid_0, grid_1, grid_2, stream, kernel.function,
# kernel.packed_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, *bound_args.values())`.
VARIANTS = {
    "291d777295f762fb": Variant("3.6.0", ("instrumentation_mode",), False),
    "000dbf129d83a37c": Variant("3.7.0, 3.7.1, 3.8.0", ("instrumentation_mode",), True),
    "ff04bcaf80c9b456": Variant("3.9.0", ("instrumentation_mode", "fpsan_homomorphic_casts"), True),
}
# CompiledKernel.run (the property) and CompiledKernel.launch_metadata, the same in all of them.
_KERNEL_PARTS = {"run": "378fdccf32dfd6d3", "launch_metadata": "56d27a3e3e3a9e5b"}


def source_hash(fn) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]


_found: Variant | str | None = None
# The warm-up's thread may ask first: one answer, read before anything patches Triton.
_lock = threading.Lock()


def internals() -> Variant | str:
    """The recognised variant of the installed Triton, or why it is not recognised (once per process)."""
    global _found
    found = _found
    if found is None:
        with _lock:
            if _found is None:
                _found = _examine()
            found = _found
    return found


def forget() -> None:
    """Look again at the next question (for tests that change what Triton runs)."""
    global _found
    with _lock:
        _found = None


def _examine() -> Variant | str:
    try:
        import triton
        from triton import knobs
        from triton.compiler.compiler import ASTSource, CompiledKernel  # noqa: F401  (the kernel index's)
        from triton.knobs import HookChain  # noqa: F401  (the hooks' type, read per call)
        from triton.runtime import cache, driver  # noqa: F401  (Triton's cache; the driver's questions)
        from triton.runtime.jit import JITFunction, KernelInterface, compute_cache_key  # noqa: F401

        variant = VARIANTS.get(source_hash(JITFunction.run))
        if variant is None:
            return f"Triton {triton.__version__}: JITFunction.run is not one tilegen knows"
        for name, digest in _KERNEL_PARTS.items():
            member = inspect.getattr_static(CompiledKernel, name)
            if source_hash(member.fget if isinstance(member, property) else member) != digest:
                return f"Triton {triton.__version__}: CompiledKernel.{name} is not one tilegen knows"
        # What compile-ahead's compile-only mode replaces or sets.
        for owner, name in ((CompiledKernel, "_init_handles"), (KernelInterface, "__getitem__"),
                            (cache, "get_cache_manager"), (knobs.compilation, "always_compile")):
            if not hasattr(owner, name):
                return f"Triton {triton.__version__}: no {getattr(owner, '__name__', type(owner).__name__)}.{name}"
        return variant
    except Exception as error:  # noqa: BLE001 - a Triton laid out differently: its public path only
        return f"Triton internals not recognised ({type(error).__name__}: {error})"


def reason() -> str | None:
    """``None`` when this Triton's internals are recognised, else why not (a line for a log)."""
    found = internals()
    return found if isinstance(found, str) else None
