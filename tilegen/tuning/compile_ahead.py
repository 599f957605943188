"""Compile a bucket's candidate configs into Triton's on-disk cache while the worker measures.

Triton compiles a kernel on its first launch, so without help the measuring worker spends
the first bucket of a tune compiling its candidates one after another (about a second each
on an H200 host). A few low-priority processes compile them meanwhile: each runs the
family Problem's own launch of a config with every ``kernel[grid](...)`` in Triton's warmup
mode (compile, do not launch), on inputs the Problem builds for the bucket, so the
specialization Triton keys its cache on (dtypes, 16-byte alignment, ints equal to 1 or
divisible by 16, constexprs, options) is the one the worker's launch will have. The
worker's JIT then loads each kernel from the disk cache in milliseconds.

The processes only fill a cache: a config that fails to compile here is left to the worker
(which records its compile error as before), tasks of a bucket that has ended are dropped,
and the processes are killed when the tune closes, so a tune's results are the same with or
without them. Nothing runs on the GPU from here beyond allocating the bucket's inputs once:
Triton's warmup launches nothing, loading a compiled binary is refused, and the Problem's
launch runs under a guard that lets through only allocations and views; a family whose
launch computes with torch (the blockwise layer) is left to the worker.

A tune starts the processes when it opens (``CompileAhead.start``), not at its first bucket,
so their start-up overlaps the worker's and the studies'. Where the tune process has not yet
initialized CUDA's driver and runs one thread, they are forked: copies with torch and Triton
imported, which spawned ones would spend seconds each importing again, all at once. Each then
waits for the measuring worker's CUDA context (contexts created at once queue behind each
other), creates its own and compiles a tiny kernel, so the first bucket's first config does
not pay those one-time costs.

``TILEGEN_COMPILE_AHEAD=N`` sets the processes per tune process (0: none); by default a tune
on a GPU uses ``min(8, usable CPUs / 2 / tune processes on the host)``, and the interpreter,
which compiles nothing, none.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time

import triton
import triton.language as tl

__all__ = ["ENV", "CompileAhead", "default_processes"]

ENV = "TILEGEN_COMPILE_AHEAD"
_MAX_PROCESSES = 8
#: The compile processes' niceness: the worker's own compiles and timing loop come first.
_NICE = 10
#: The most of the GPU's memory one compile process may take for a bucket's inputs: several
#: processes hold a copy each beside the worker's own, which must never run out.
_MEMORY_SHARE = 0.02
#: The longest the processes wait for the flag they start after (a spawned worker imports torch first).
_AFTER_S = 10.0
log = logging.getLogger(__name__)


def default_processes(share: int = 1) -> int:
    """Compile processes for one tune process: ``TILEGEN_COMPILE_AHEAD`` when set, else half the
    usable CPUs split over the ``share`` tune processes of the host, at most 8."""
    value = os.environ.get(ENV, "").strip()
    if value:
        if value.isdigit():
            return int(value)
        # It only speeds a tune up: a bad value is no reason to stop one.
        log.warning("%s=%r is not a whole number of processes; using the default", ENV, value)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return min(_MAX_PROCESSES, cpus // 2 // max(1, share))


class CompileAhead:
    """A pool of compile processes fed one bucket at a time; a no-op with ``processes=0``.

    ``start(fork=...)`` starts the processes now; ``bucket(family, problem, configs)`` queues
    the configs (in order), starting the processes if nothing did, and drops whatever an
    earlier bucket left queued; ``end_bucket()`` drops the rest; ``close()`` kills the
    processes. They serve every bucket of a tune, which pays their start-up (importing torch
    and Triton, unless forked, and a CUDA context) once.
    ``reports()`` gives what they did: ``(bucket index, config JSON, "ok" | error, seconds)``.
    """

    def __init__(self, processes: int, *, after=None):
        self.processes = max(0, int(processes))
        # A shared flag (the tuning worker's ``cuda_up``) the processes wait for, up to _AFTER_S
        # seconds, before they create their CUDA contexts: the worker's comes first.
        self._after = after
        self._ctx = multiprocessing.get_context("spawn")  # the tune process may hold threads and CUDA-free state alike
        self._procs: list = []
        self._tasks = None
        self._done = None
        self._current = None  # the bucket the processes serve; a task of another is dropped
        self._index = 0

    def __enter__(self) -> CompileAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, *, fork: bool = False) -> None:
        """Start the processes now, in the background; a no-op when there are none or they run.

        ``fork``: copy this process, where that is safe (see ``tilegen.tuning.worker.forkable``),
        rather than start fresh interpreters."""
        if self.processes and not self._procs:
            from tilegen.tuning.worker import forkable

            self._start(fork=fork and forkable())

    def bucket(self, family, problem, configs: list) -> None:
        if not self.processes or not configs:
            return
        self.start()
        self._index += 1
        self._current.value = self._index
        for config in configs:
            self._tasks.put((self._index, family, problem, config))
        log.debug("compile ahead: %d configs queued for %s", len(configs), problem.spec.name)

    def end_bucket(self) -> None:
        if self._current is not None:
            self._current.value = 0

    def reports(self, wait_for: int = 0, timeout: float = 0.0) -> list[tuple]:
        """What the processes reported since the last call; waits up to ``timeout`` s for ``wait_for`` reports."""
        got = []
        if self._done is None:
            return got
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                got.append(self._done.get(timeout=left) if len(got) < wait_for and left > 0 else self._done.get_nowait())
            except queue.Empty:
                return got

    def close(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()  # Triton writes a cache entry by renaming a finished file, so a kill leaves none half-written
        for proc in self._procs:
            proc.join()
            proc.close()
        self._procs = []
        for q in (self._tasks, self._done):
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._tasks = self._done = self._current = None

    def _start(self, fork: bool = False) -> None:
        # Queues of the spawn context serve forked children too, which inherit them.
        self._tasks = self._ctx.Queue()
        self._done = self._ctx.Queue()
        # Lock-free: a child killed while reading it must not leave a lock held.
        self._current = self._ctx.RawValue("i", 0)
        ctx = multiprocessing.get_context("fork") if fork else self._ctx
        for _ in range(self.processes):
            proc = ctx.Process(target=_serve, args=(self._tasks, self._done, self._current, os.getpid(),
                                                    log.getEffectiveLevel(), self._after),
                               name="tilegen-compile-ahead", daemon=True)
            proc.start()
            self._procs.append(proc)
        log.debug("compile ahead: %d processes %s", self.processes, "forked" if fork else "spawned")


class _Refused(RuntimeError):
    """The bucket cannot be compiled ahead: its launch computes with torch, or its inputs are too large."""


def _check_memory(problem) -> None:
    """Refuse a GPU bucket whose inputs (about twice the bytes one launch moves, outputs and spare
    pages included) would take more than ``_MEMORY_SHARE`` of the device's memory."""
    if not problem.on_gpu:
        return
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    need = 2 * problem.bytes_moved()
    if need > _MEMORY_SHARE * total:
        raise _Refused(f"its inputs (~{need / 1e9:.1f} GB) exceed {_MEMORY_SHARE:.0%} of the GPU's "
                       f"{total / 1e9:.0f} GB per compile process")


def _allocate_only():
    """A torch dispatch mode that lets allocations and views through and refuses any computation,
    so a compile process never runs a torch kernel on the GPU."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    allowed = {aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.empty_like,
               aten.detach, aten.alias, aten.lift_fresh}

    class AllocateOnly(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.is_view or func.overloadpacket in allowed:
                return func(*args, **(kwargs or {}))
            raise _Refused(f"the launch computes with torch ({func})")

    return AllocateOnly()


def _compile_only() -> None:
    """Make every ``kernel[grid](...)`` of this process a warmup (compile, launch nothing), and
    refuse loading a binary, which any real launch needs first."""
    from triton.compiler import compiler
    from triton.runtime import jit

    def warmup_item(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=True, **kwargs)

    def refuse(self):
        raise RuntimeError("a compile-ahead process loads no kernel")

    jit.KernelInterface.__getitem__ = warmup_item
    compiler.CompiledKernel._init_handles = refuse


@triton.jit
def _first_compile(x_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)


def first_compile(x) -> None:
    """Launch (in a compile process: compile) a tiny kernel on ``x``, 16 floats: a process's first
    compile pays Triton's one-time costs, which this takes off a real kernel's. Its entry in
    Triton's cache is a few kilobytes."""
    _first_compile[(1,)](x, N=16)


def _warm_up() -> None:
    """Pay the process's one-time costs of compiling before the first bucket's configs arrive: on
    the H200 host a compile process's first config took 2.2-3.7 s and the next ones 0.7-1.2 s
    (CUDA's context for the inputs, Triton's backend and tools), and the first trial waits for it."""
    import torch

    start = time.perf_counter()
    try:
        first_compile(torch.empty(16, device="cuda") if torch.cuda.is_available() else torch.empty(16))
    except Exception as e:  # noqa: BLE001 - only a head start: the first config pays it instead
        log.debug("compile ahead: warm-up failed: %s: %s", type(e).__name__, e)
        return
    log.debug("compile ahead: warmed up in %.2f s", time.perf_counter() - start)


def _serve(tasks, done, current, parent: int, level: int = logging.WARNING, after=None) -> None:
    from tilegen.tuning.worker import _leave_with_parent, log_to_stderr

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the tune's to handle
    threading.Thread(target=_leave_with_parent, args=(parent,), daemon=True).start()
    os.nice(_NICE)
    log_to_stderr(level)
    # tilegen's own ops go through the JIT (which is in warmup here), never a direct launch.
    os.environ["TILEGEN_DIRECT_LAUNCH"] = "0"
    from tilegen.codegen import module_for
    from tilegen.families import register

    _compile_only()
    deadline = time.monotonic() + _AFTER_S
    while after is not None and not after.value and time.monotonic() < deadline:
        time.sleep(0.01)
    _warm_up()
    guard = _allocate_only()
    built = None  # (bucket index, module, inputs, outputs); module None when the bucket's launch computes
    while True:
        index, family, problem, config = tasks.get()
        if index != current.value:
            continue  # its bucket has ended
        if built is not None and built[0] == index and built[1] is None:
            continue  # every config's launch computes alike: the bucket is the worker's
        start = time.perf_counter()
        try:
            if built is None or built[0] != index:
                built = None
                register(family)
                _check_memory(problem)
                module = module_for(problem.spec)
                inputs = problem.inputs(0)
                built = (index, module, inputs, problem.outputs(inputs))
            _, module, inputs, outputs = built
            with guard:
                problem.launch(module, config, inputs, outputs)
            status = "ok"
        except _Refused as e:
            status = str(e)
            built = (index, None, None, None)
        except Exception as e:  # the worker meets the same error and records it
            status = f"{type(e).__name__}: {e}"[:500]
        seconds = time.perf_counter() - start
        log.debug("compile ahead: %s %s in %.2f s", config, "compiled" if status == "ok" else "failed", seconds)
        done.put((index, config.to_json(), status, seconds))
