"""The process candidates run in, so a faulting kernel cannot take the tune down.

A CUDA fault (an illegal address, say) poisons the CUDA context of its process:
every later launch there fails too. So configs are measured in a long-lived child
process started with "spawn" (a forked child would share the parent's CUDA state).
When the child dies, hangs, or reports a broken context, the trial is recorded as
"fault" or "timeout" and a fresh child takes the next trial; it is started at once, so
its start-up overlaps the recording of the failed trial.

A child's start (importing torch and Triton, creating the CUDA context) takes seconds, so
a tune starts it in the background (``Worker.start``) before it opens its studies, and
the first trial waits only for what is left of it. A process that has not initialized CUDA's
driver and runs one thread (a tune process of ``tilegen tune --gpus``, first thing) may
fork its first child instead: the copy has torch and Triton imported already. Should
that child fail to start, a spawned one takes its place.

Testing hook: ``TILEGEN_TUNE_INJECT='{"<config>": "<failure>"}'``, the config written
as its label (``str(config)``, e.g. ``"BM32-BN32-w4-s1"``) or its canonical JSON, makes the worker fail it on
purpose: ``"compile_error"`` raises the error Triton 3.6 gives when its pipeliner
rejects a config, ``"wrong"`` spoils the output after the kernel, ``"crash"`` exits the
worker mid-trial, ``"hang"`` never answers, ``"sleep:<seconds>"`` waits that long and then
measures (a trial that is in flight long enough to kill its tune process). The worker
reads it when it starts.

The child leaves when its parent dies: killed with -9, the tune process cannot close the
pipe's other end in a way a measuring child notices, and an orphan would keep its GPU.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import wait

from tilegen.tuning.process import exit_now, first_compile, forkable, leave_with_parent, log_to_stderr

__all__ = ["Worker", "WorkerError", "INJECT_ENV"]

INJECT_ENV = "TILEGEN_TUNE_INJECT"
log = logging.getLogger(__name__)
_REASON_CHARS = 2000
#: Seconds a forked child may take to say it is ready (it only creates its CUDA context).
_FORK_START_S = 60.0


class WorkerError(RuntimeError):
    """The worker could not start at all (so no trial can run)."""


class Worker:
    """Measures one config at a time in a child process; replaces the child when it fails.

    ``start()`` starts the child without waiting for it, so its imports (torch, Triton) and
    set-up overlap the caller's own before the first trial; ``measure`` waits for it then.
    Without ``start()`` the first ``measure`` starts it.
    """

    def __init__(self, start_timeout: float = 300.0):
        self._start_timeout = start_timeout  # importing torch and Triton, and CUDA start-up
        self._proc = None
        self._conn = None
        self._ready = False  # the child said it can measure
        self._forked = False  # the child is a copy of this process
        self._deadline = 0.0  # by when it must say so
        # Set once the child has its CUDA context (or failed to start): compile processes
        # create theirs after it, since contexts created at once on a host queue behind each
        # other (on the 2-GPU H200 host a first worker was warm 3.7-4.4 s after its fork while 16
        # compile processes created theirs, 1.9-2.1 s after it once they waited).
        # Shared memory, not an Event: a semaphore of the spawn context would be tracked, and
        # reported leaked when a tune process leaves through os._exit.
        self.cuda_up = multiprocessing.get_context("spawn").RawValue("b", 0)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, *, fork: bool = False) -> None:
        """Start the child now, in the background; a no-op while one runs or starts.

        ``fork``: copy this process rather than start a fresh interpreter, so the child skips
        importing torch and Triton, where that is safe: nothing but this thread runs, and
        CUDA's driver is not initialized here; else it spawns. A forked child that cannot start
        is replaced by a spawned one. Replacements after a failed trial are always spawned.
        """
        if self._proc is None:
            self._start(fork=fork and forkable())

    def measure(self, task, timeout: float) -> dict:
        """Measure ``task = (family, problem, config, seed)``, or run a ``measure.Compare``, in the
        child; ``timeout`` in seconds.

        The family travels with the task, so the child knows families registered at run time
        (a project's own, or a test's), not only tilegen's built-in ones. Raises
        ``WorkerError`` when a child cannot start.
        """
        if self._proc is not None and self._ready and not self._proc.is_alive():
            self._kill()  # it died between trials (killed from outside)
        if self._proc is None:
            self._start()
        if not self._ready:
            self._wait_ready()
        try:
            self._conn.send(task)
            ready = wait([self._conn, self._proc.sentinel], timeout)
            if self._conn in ready:
                try:
                    result = self._conn.recv()
                except EOFError:
                    pass  # the child died before answering
                else:
                    if result["status"] == "fault":
                        self._replace()  # it is exiting (its CUDA context broke); the next trial gets a new one
                    return result
        except KeyboardInterrupt:
            # Interrupted mid-measurement (Ctrl-C, or SIGTERM in `tilegen tune`): nobody will read the
            # child's answer, and an orderly close would wait for it.
            self._kill()
            raise
        if not ready:
            self._replace()
            return {"status": "timeout", "reason": f"no result after {timeout:g} s; worker replaced"}
        self._proc.join(5)
        code = self._proc.exitcode
        self._replace()
        return {"status": "fault", "reason": f"worker died ({_describe_exit(code)}); worker replaced"}

    def close(self) -> None:
        if self._proc is None:
            return
        if self._ready:
            self._conn.close()  # the child reads EOF and exits on its own
            self._proc.join(10)
        self._kill()  # one still starting holds nothing worth an orderly exit

    def _start(self, fork: bool = False) -> None:
        self._kill()
        self._forked = fork
        ctx = multiprocessing.get_context("fork" if fork else "spawn")
        self._conn, child_conn = ctx.Pipe()
        # A forked child holds a copy of this end too, and would never read EOF unless it closes it.
        self._proc = ctx.Process(target=_serve, args=(child_conn, os.getpid(), log.getEffectiveLevel(),
                                                      self._conn if fork else None, self.cuda_up),
                                 name="tilegen-tune-worker", daemon=True)
        self._proc.start()
        # A copy imports nothing: a long silence means it is stuck, and a spawned one should take over.
        self._deadline = time.monotonic() + (min(self._start_timeout, _FORK_START_S) if fork else self._start_timeout)
        log.debug("worker %d %s", self._proc.pid, "forked" if fork else "spawned")
        child_conn.close()

    def _replace(self) -> None:
        """Kill the child, and start the next one now: its start overlaps recording this trial."""
        self._kill()
        self._start()

    def _wait_ready(self) -> None:
        hello = None
        if wait([self._conn, self._proc.sentinel], max(0.0, self._deadline - time.monotonic())):
            try:
                hello = self._conn.recv()
            except EOFError:
                pass
        if not (isinstance(hello, dict) and hello.get("ready")):
            forked = self._forked
            self._kill()
            if forked:
                log.debug("forked worker failed to start (%s); spawning one", hello)
                self._start()
                return self._wait_ready()
            detail = hello["error"] if isinstance(hello, dict) else "it exited or did not answer"
            raise WorkerError(f"the tuning worker failed to start: {detail}")
        self._ready = True
        log.debug("worker %d ready", self._proc.pid)

    def _kill(self) -> None:
        # Forgotten first: a second Ctrl-C inside the join below may land after os.waitpid reaped the child and
        # before multiprocessing recorded it, which then takes the child for running forever and refuses to close it.
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._ready = False
        if proc is not None:
            try:
                # A start interrupted (Ctrl-C) or failed (EAGAIN) left a process that never started: nothing to join.
                if proc.pid is not None:
                    if proc.is_alive():
                        proc.kill()
                    proc.join()
                proc.close()
            finally:
                conn.close()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _serve(conn, parent: int, level: int = logging.WARNING, parents_end=None, cuda_up=None) -> None:
    """The child's loop: one task in, one result dict out, until the parent hangs up."""
    if parents_end is not None:  # a fork
        parents_end.close()
        # A fork inherits torch's CPU thread pool (OpenMP) as the parent left it: where the parent
        # had run a parallel CPU op, the child's first one waits forever on threads it does not
        # have (a trial then timed out after 120 s). With one thread torch never enters the pool.
        import torch

        torch.set_num_threads(1)
    # Ctrl-C, and a kill of the job, reach the whole process group; the parent decides, and closes
    # the pipe. Dying first, this child would have its trial recorded as a fault, never measured again.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Watching from the start: a child started ahead of its first trial can outlive a parent
    # killed while it still imports.
    threading.Thread(target=leave_with_parent, args=(parent,), daemon=True).start()
    log_to_stderr(level)
    try:
        from tilegen.families import register
        from tilegen.tuning.measure import Compare, compare, measure

        inject = json.loads(os.environ.get(INJECT_ENV) or "{}")
        _start_cuda()
    except Exception as e:  # reported to the parent, which cannot tune without a worker
        _answer(conn, {"error": f"{type(e).__name__}: {e}"[:_REASON_CHARS]})
        return
    finally:
        if cuda_up is not None:
            cuda_up.value = 1
    if not _answer(conn, {"ready": True}):
        return
    log.debug("worker process ready")
    _warm_up()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            # The parent hung up: closed its end, or died with our "ready" unread (a reset).
            # Nothing is left to save, and tearing down torch and Triton takes most of a
            # second, which the parent's close would wait for.
            exit_now()
        if isinstance(task, Compare):
            # Configs each measured correct once already: no injection, only timing.
            family, problem, config, seed, failure = task.family, task.problem, None, task.seed, None
        else:
            family, problem, config, seed = task
            failure = inject.get(str(config)) or inject.get(config.to_json())
        if failure == "crash":
            os._exit(1)
        if failure == "hang":
            time.sleep(1e9)
        if failure and failure.startswith("sleep:"):
            time.sleep(float(failure.removeprefix("sleep:")))
        broken = False
        try:
            if failure == "compile_error":
                raise RuntimeError("PassManager::run failed (injected)")
            register(family)
            if config is None:
                result = compare(problem, task.configs, seed, task.rounds)
            else:
                result = measure(problem, config, seed, perturb=failure == "wrong")
        except Exception as e:
            # Triton raises many types while compiling (OutOfResources, CompilationError,
            # RuntimeError from the pass manager); unless CUDA itself broke, they only rule this config out.
            broken = _cuda_broken()
            result = {"status": "fault" if broken else "compile_error", "time_ms": None, "max_error": None,
                      "reason": f"{type(e).__name__}: {e}"[:_REASON_CHARS]}
        conn.send(result)
        if broken:
            return  # this context cannot launch again; the parent starts a new worker


def _answer(conn, message: dict) -> bool:
    """Send ``message``; ``False`` when the parent has hung up (it closed the tune before this child was ready)."""
    try:
        conn.send(message)
    except OSError:
        return False
    return True


def _start_cuda() -> None:
    """Create the CUDA context now, while the parent sets up, rather than in the first trial."""
    import torch

    from tilegen import env

    if not env.interpreting() and torch.cuda.is_available():
        torch.empty(1, device="cuda")


def _warm_up() -> None:
    """Pay the one-time costs a first trial adds to its own kernel's compile (cuBLAS and the
    random generator for the inputs and the reference, Triton's first compile and module load)
    while the tune process still opens its studies, whose first trial comes 0.6-2 s later."""
    import torch

    from tilegen import env

    if env.interpreting() or not torch.cuda.is_available():
        return
    start = time.perf_counter()
    try:
        a = torch.randn(64, 64, device="cuda")
        (a @ a).sum().item()
        first_compile(torch.empty(16, device="cuda"))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - only a head start: the first trial pays it instead
        log.debug("worker warm-up failed: %s: %s", type(e).__name__, e)
        return
    log.debug("worker warmed up in %.2f s", time.perf_counter() - start)


def _cuda_broken() -> bool:
    """Whether the CUDA context is unusable (a sticky error such as an illegal address)."""
    import torch

    if not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize()
    except Exception:
        return True
    return False
