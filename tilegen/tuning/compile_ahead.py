"""Compile a bucket's candidate configs into Triton's on-disk cache while the worker measures.

Triton compiles a kernel on its first launch, so without help the measuring worker spends
the first bucket of a tune compiling its candidates one after another (about a second each
on an H200 host). A few low-priority processes compile them meanwhile: each runs the
family Problem's own launch of a config with every ``kernel[grid](...)`` in Triton's warmup
mode (compile, do not launch), on inputs the Problem builds for the bucket, so the
specialization Triton keys its cache on (dtypes, 16-byte alignment, ints equal to 1 or
divisible by 16, constexprs, options) is the one the worker's launch will have. The
worker's JIT then loads each kernel from the disk cache in milliseconds.

The inputs are the Problem's placeholders (``Problem.placeholder_inputs``: its inputs'
shapes, dtypes and strides, with a paged cache's buffers and kv_append's inputs sized from
the lengths and no page table computed) built on torch's meta device: no memory, at address 0, which is
aligned as any allocation is. With Triton's questions to the driver (the current device and
stream, the GPU's capability) answered from what the tune read from its GPU, a compile
process then never starts CUDA. Contexts created at once on a host queue behind each other:
on the 2-GPU H200 host, 16 compile processes that each made one were ready 2.2-2.5 s after
the measuring workers' own, against 1.3 s for 8. A Problem whose placeholders cannot be
built on meta tensors falls back to real inputs on the GPU, made once the worker's context is
up, as does a config whose launch fails on meta tensors.

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
waits for the GPU's capability (``CompileAhead.target``, which the tuner sends once it has
read its device) and compiles a tiny kernel, so the first bucket's first config does not pay
Triton's one-time costs.

``TILEGEN_COMPILE_AHEAD=N`` sets the processes per tune process (0: none); by default a tune
on a GPU uses ``min(8, usable CPUs / 2 / tune processes on the host)``, and the interpreter,
which compiles nothing, none. What this takes of Triton's internals (compile without
launching, the driver's questions answered without CUDA) is in
``tilegen.triton_internals.compile_only``; on a Triton whose internals are not recognised
there, a pool starts no process, says so once in the log, and the worker compiles each config.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time

from tilegen.triton_internals import compile_only
from tilegen.tuning.process import first_compile

__all__ = ["ENV", "FIRST_WAIT_S", "CompileAhead", "default_processes"]

ENV = "TILEGEN_COMPILE_AHEAD"
_MAX_PROCESSES = 8
#: The compile processes' niceness: the worker's own compiles and timing loop come first.
_NICE = 10
#: The most of the GPU's memory one compile process may take for a bucket's inputs: several
#: processes hold a copy each beside the worker's own, which must never run out.
_MEMORY_SHARE = 0.02
#: The longest the processes wait for the worker's CUDA context, or for the GPU's capability
#: (a spawned worker imports torch first).
_AFTER_S = 10.0
#: The longest a tune's first trial waits for the compile processes to compile its config.
#: Its worker would compile it itself once warmed up: on the 2-GPU H200 host a compile process
#: had the first config (BM64-BN128-w4-s3, 1.9-2.1 s to compile) 1.0-1.5 s before the worker.
FIRST_WAIT_S = 5.0
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
        if self.processes and compile_only.support() is not None:
            log.warning("%s; each config compiles in the measuring worker", compile_only.support())
            self.processes = 0
        # A shared flag (the tuning worker's ``cuda_up``) the processes wait for, up to _AFTER_S
        # seconds, before they create a CUDA context (only for a bucket that cannot go on meta
        # tensors): the worker's comes first.
        self._after = after
        self._ctx = multiprocessing.get_context("spawn")  # the tune process may hold threads and CUDA-free state alike
        # The GPU's compute capability, (0, 0) until ``target`` sets it; shared memory, as ``after`` is.
        self._target = self._ctx.RawArray("i", 2)
        self._procs: list = []
        self._tasks = None
        self._done = None
        self._current = None  # the bucket the processes serve; a task of another is dropped
        self._index = 0
        self._forked = False
        self._front: set[str] = set()  # the current bucket's configs the processes take first, at once
        self._backlog: list[tuple] = []  # reports ``wait`` read, which ``reports`` has yet to give

    def __enter__(self) -> CompileAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, *, fork: bool = False) -> None:
        """Start the processes now, in the background; a no-op when there are none or they run.

        ``fork``: copy this process, where that is safe (see ``tilegen.tuning.worker.forkable``),
        rather than start fresh interpreters."""
        if self.processes and not self._procs:
            from tilegen.tuning.process import forkable

            self._start(fork=fork and forkable())

    def target(self, capability: tuple[int, int]) -> None:
        """The GPU's compute capability, which the processes compile for without asking CUDA."""
        self._target[:] = list(capability)

    def bucket(self, family, problem, configs: list) -> None:
        if not self.processes or not configs:
            return
        self.start()
        self._index += 1
        self._current.value = self._index
        self._front = {c.to_json() for c in configs[:self.processes]}
        for config in configs:
            self._tasks.put((self._index, family, problem, config))
        log.debug("compile ahead: %d configs queued for %s", len(configs), problem.spec.name)

    def end_bucket(self) -> None:
        if self._current is not None:
            self._current.value = 0

    def wait(self, config, timeout: float = FIRST_WAIT_S) -> bool:
        """Wait up to ``timeout`` s for the processes to compile ``config`` of the current bucket,
        where one of them took it up as the bucket was queued (one of the first ``processes``
        configs) and they were forked, so ready by then; ``True`` once it is compiled."""
        key = config.to_json()
        if not self._forked or key not in self._front or self._done is None:
            return False
        deadline = time.monotonic() + timeout
        while True:
            for index, done, status, _ in self._backlog:
                if index == self._index and done == key:
                    return status == "ok"
            try:
                self._backlog.append(self._done.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                return False

    def reports(self, wait_for: int = 0, timeout: float = 0.0) -> list[tuple]:
        """What the processes reported since the last call; waits up to ``timeout`` s for ``wait_for`` reports."""
        got, self._backlog = self._backlog, []
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
        self._forked = fork
        for _ in range(self.processes):
            proc = ctx.Process(target=_serve, args=(self._tasks, self._done, self._current, os.getpid(),
                                                    log.getEffectiveLevel(), self._after, self._target),
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


class _OnMeta:
    """Every tensor built inside lands on torch's meta device: a Problem's inputs and outputs
    with their shapes, dtypes and strides, no memory and no CUDA. Random generators are
    dropped (a meta tensor holds no values) and ``torch.Generator`` makes CPU ones, which
    start nothing. Code that needs values (``tolist``, a data-dependent shape) raises.

    Random tensors are made as empty ones: torch's random functions on meta run its Python
    reference code, whose first call imports sympy (about 500 modules), and that took 2.4-3.2 s
    per process on the 2-GPU H200 host (4.0-4.1 s with 16 processes at once), where packages
    ship without bytecode, in the first bucket's path. Arithmetic on meta tensors imports more
    (torch._dynamo); a Problem that computes its inputs pays that once per process, at its
    first bucket."""

    def __enter__(self):
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._device import _device_constructors

        constructors = _device_constructors()
        random = {torch.randn, torch.rand, torch.randint}
        random_like = {torch.randn_like, torch.rand_like, torch.randint_like}

        def to_meta(value):
            return "meta" if isinstance(value, (str, torch.device)) else value

        def empty(func, args, kwargs):
            if func in random_like:
                return torch.empty_like(args[0], dtype=kwargs.get("dtype"), device="meta")
            if func is torch.randint:  # randint([low,] high, size)
                size, dtype = kwargs.get("size", args[-1] if args else None), kwargs.get("dtype", torch.int64)
            else:  # randn(*size) or randn(size)
                one = len(args) == 1 and isinstance(args[0], (tuple, list))
                size, dtype = kwargs.get("size", args[0] if one else args), kwargs.get("dtype")
            return torch.empty(size, dtype=dtype, device="meta", requires_grad=kwargs.get("requires_grad", False))

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = dict(kwargs or {})
                if func in random or func in random_like:
                    return empty(func, args, kwargs)
                if func in constructors:
                    kwargs["device"] = "meta"
                    kwargs.pop("generator", None)
                elif func is torch.Tensor.to:
                    args = tuple(to_meta(a) for a in args)
                    if "device" in kwargs:
                        kwargs["device"] = "meta"
                elif func in (torch.Tensor.cuda, torch.Tensor.cpu):
                    return args[0].to("meta")
                return func(*args, **kwargs)

        class CpuGenerator(torch.Generator):  # a class still: modules imported meanwhile annotate with it
            def __new__(cls, device=None):
                return super().__new__(cls)

            def __init__(self, device=None):
                super().__init__()

        self._generator = torch.Generator
        torch.Generator = CpuGenerator
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        self._mode.__exit__(*exc)
        torch.Generator = self._generator


def _warm_up(device: str) -> None:
    """Pay Triton's one-time costs of compiling (its compiler, LLVM and ptxas starting) before the
    first bucket's configs arrive, which the first trials wait for. The tiny kernel is compiled
    even when Triton's cache holds it (the measuring worker compiles it too): a cache hit would
    start none of that."""
    import torch

    start = time.perf_counter()
    try:
        with compile_only.always_compile():
            first_compile(torch.empty(16, device=device))
    except Exception as e:  # noqa: BLE001 - only a head start: the first config pays it instead
        log.debug("compile ahead: warm-up failed: %s: %s", type(e).__name__, e)
        return
    log.debug("compile ahead: warmed up in %.2f s (%s)", time.perf_counter() - start, device)


def _wait_for(ready) -> None:
    """Poll ``ready()`` (shared memory another process sets) until it holds, at most ``_AFTER_S`` s."""
    deadline = time.monotonic() + _AFTER_S
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.01)


class _Bucket:
    """One bucket's module and its inputs and outputs: on meta tensors, and on real ones (the
    GPU's, or the interpreter's CPU) only once a launch needs them."""

    def __init__(self, index: int, family, problem, after, on_meta: bool):
        from tilegen.codegen import module_for
        from tilegen.families import register

        start = time.perf_counter()
        register(family)
        self.index, self.problem, self._after = index, problem, after
        # The generated module, not the ops' Launcher (tilegen.dispatch.launcher_for) that the worker measures
        # through: nothing is launched here (Triton's JIT is patched to compile only, and direct launches are
        # off), and the module's JIT launch (with the launcher's compile options: compile_only) compiles the very
        # kernels, under the same cache keys, that the launcher's first launch of each config asks the JIT for.
        self.module = module_for(problem.spec)
        loaded = time.perf_counter()
        self.meta = self.real = None
        self.refused = None  # why the bucket is the worker's alone
        if on_meta:
            try:
                with _OnMeta():
                    inputs = problem.placeholder_inputs()
                    self.meta = (inputs, problem.outputs(inputs))
            except Exception as e:  # noqa: BLE001 - the inputs need values: real ones then
                log.debug("compile ahead: %s builds on the GPU (%s: %s)", problem.spec.name, type(e).__name__, e)
        log.debug("compile ahead: bucket ready in %.2f s (module %.2f s)", time.perf_counter() - start, loaded - start)

    def real_inputs(self):
        if self.real is None:
            _wait_for(lambda: not self.problem.on_gpu or self._after is None or self._after.value)
            _check_memory(self.problem)
            inputs = self.problem.inputs(0)
            self.real = (inputs, self.problem.outputs(inputs))
        return self.real


def _serve(tasks, done, current, parent: int, level: int = logging.WARNING, after=None, target=None) -> None:
    from tilegen.tuning.process import leave_with_parent, log_to_stderr

    # Ctrl-C and a kill of the job are the tune's to handle (it kills these processes); a fork would
    # otherwise also inherit its SIGTERM handler, which unwinds the tune.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=leave_with_parent, args=(parent,), daemon=True).start()
    os.nice(_NICE)
    log_to_stderr(level)
    # tilegen's own ops go through the JIT (which is in warmup here), never a direct launch.
    os.environ["TILEGEN_DIRECT_LAUNCH"] = "0"

    try:
        compile_only.enable()
    except RuntimeError as e:  # a Triton the gate does not know: this process must not launch anything
        log.warning("%s", e)
        return
    # The capability comes from the tune once it has read its device; a first task may come first.
    _wait_for(lambda: target is None or target[0] or not tasks.empty())
    try:
        compile_only.answer_without_cuda(tuple(target) if target is not None and target[0] else None)
        on_meta = True
    except Exception as e:  # noqa: BLE001 - a driver of another shape: ask CUDA as the worker does
        log.debug("compile ahead: the driver answers itself (%s: %s)", type(e).__name__, e)
        on_meta = False
    _warm_up("meta" if on_meta else "cuda")
    guard = _allocate_only()
    built = None
    while True:
        index, family, problem, config = tasks.get()
        if index != current.value:
            continue  # its bucket has ended
        if built is not None and built.index == index and built.refused:
            continue  # every config's launch computes alike: the bucket is the worker's
        start = time.perf_counter()
        try:
            if built is None or built.index != index:
                built = None
                built = _Bucket(index, family, problem, after, on_meta)
            status = _compile(built, config, guard)
        except _Refused as e:
            status = built.refused = str(e)
        except Exception as e:  # the worker meets the same error and records it
            status = f"{type(e).__name__}: {e}"[:500]
        seconds = time.perf_counter() - start
        log.debug("compile ahead: %s %s in %.2f s", config, "compiled" if status == "ok" else "failed", seconds)
        done.put((index, config.to_json(), status, seconds))


def _compile(built: _Bucket, config, guard) -> str:
    """Compile one config through the Problem's launch: on meta tensors where the bucket has them,
    else (or where that launch fails) on real ones."""
    if built.meta is not None:
        compile_only.KERNEL_CALLS[0] = 0
        try:
            with guard:
                built.problem.launch(built.module, config, *built.meta)
            return "ok"
        except Exception as e:
            if isinstance(e, _Refused) or compile_only.KERNEL_CALLS[0]:
                raise  # the launch computes with torch, or Triton refused the config: the same on any inputs
            log.debug("compile ahead: %s on meta tensors: %s: %s", config, type(e).__name__, e)
    inputs, outputs = built.real_inputs()
    with guard:
        built.problem.launch(built.module, config, inputs, outputs)
    return "ok"
