"""Triton made to compile kernels without launching them, for compile-ahead's processes.

``tilegen.tuning.compile_ahead`` runs a family Problem's own launch of each config in a few
processes of its own, so that the tune's measuring worker finds the kernels in Triton's disk
cache. What that takes of Triton's internals is here, behind the gate
(``tilegen.triton_internals.gate``): ``enable`` makes every ``kernel[grid](...)`` of the
process a warmup (Triton's "compile, launch nothing") and refuses loading a binary,
``answer_without_cuda`` answers the driver's questions so that no CUDA context starts, and
``always_compile`` makes Triton compile even what its cache holds. On a Triton whose
internals are not recognised, ``support()`` says why and compile-ahead starts no process:
each config then compiles in the worker, on its first launch, as without compile-ahead.
"""

from __future__ import annotations

import contextlib

from tilegen.triton_internals import OPTIONS, gate

__all__ = ["KERNEL_CALLS", "always_compile", "answer_without_cuda", "enable", "support"]

#: Kernel calls this process's launches reached since a caller last set it to 0.
KERNEL_CALLS = [0]


def support() -> str | None:
    """``None`` when this Triton can be made to compile only, else why not."""
    found = gate.reason()
    return None if found is None else f"compile-ahead is off: {found}"


def enable() -> None:
    """Make every ``kernel[grid](...)`` of this process a warmup (compile, launch nothing), and
    refuse loading a binary, which any real launch needs first. Raises where ``support()`` does not
    allow it: a compile process must never launch a kernel on the GPU."""
    reason = support()
    if reason is not None:
        raise RuntimeError(reason)
    from triton.compiler import compiler
    from triton.runtime import jit

    def warmup_item(self, grid):
        def run(*args, **kwargs):
            KERNEL_CALLS[0] += 1
            # With the options the launches of the worker that finds these kernels pass.
            return self.run(*args, grid=grid, warmup=True, **{**OPTIONS, **kwargs})

        return run

    def refuse(self):
        raise RuntimeError("a compile-ahead process loads no kernel")

    jit.KernelInterface.__getitem__ = warmup_item
    compiler.CompiledKernel._init_handles = refuse


def answer_without_cuda(capability: tuple[int, int] | None) -> None:
    """Answer the questions Triton's JIT asks the driver on every call without starting CUDA:
    the device is 0 (a tune process sees its one GPU as 0, a one-process tune uses the
    current one, 0), a warmup launches on no stream, and the capability is the one the tune
    read from its GPU (left to the driver when not known)."""
    from triton.runtime.driver import driver

    active = driver.active
    active.get_current_device = lambda: 0
    active.get_current_stream = lambda device=None: 0
    if capability is not None:
        active.get_device_capability = lambda device=None: capability


@contextlib.contextmanager
def always_compile():
    """Inside, Triton compiles a kernel even when its cache holds it."""
    from triton import knobs

    before = knobs.compilation.always_compile
    knobs.compilation.always_compile = True
    try:
        yield
    finally:
        knobs.compilation.always_compile = before
