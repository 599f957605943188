"""The process candidates run in, so a faulting kernel cannot take the tune down.

A CUDA fault (an illegal address, say) poisons the CUDA context of its process:
every later launch there fails too. So configs are measured in a long-lived child
process started with "spawn" (a forked child would share the parent's CUDA state).
When the child dies, hangs, or reports a broken context, the trial is recorded as
"fault" or "timeout" and a fresh child takes the next trial.

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
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import wait

__all__ = ["Worker", "WorkerError", "INJECT_ENV"]

INJECT_ENV = "TILEGEN_TUNE_INJECT"
_REASON_CHARS = 2000


class WorkerError(RuntimeError):
    """The worker could not start at all (so no trial can run)."""


class Worker:
    """Measures one config at a time in a child process; replaces the child when it fails."""

    def __init__(self, start_timeout: float = 300.0):
        self._start_timeout = start_timeout  # importing torch and Triton, and CUDA start-up
        self._proc = None
        self._conn = None

    def measure(self, task: tuple, timeout: float) -> dict:
        """Measure ``task = (family, problem, config, seed)`` in the child; ``timeout`` in seconds.

        The family travels with the task, so the child knows families registered at run time
        (a project's own, or a test's), not only tilegen's built-in ones.
        """
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send(task)
        ready = wait([self._conn, self._proc.sentinel], timeout)
        if self._conn in ready:
            try:
                result = self._conn.recv()
            except EOFError:
                pass  # the child died before answering
            else:
                if result["status"] == "fault":
                    self._kill()  # it is exiting (its CUDA context broke); the next trial gets a new one
                return result
        if not ready:
            self._kill()
            return {"status": "timeout", "reason": f"no result after {timeout:g} s; worker replaced"}
        self._proc.join(5)
        code = self._proc.exitcode
        self._kill()
        return {"status": "fault", "reason": f"worker died ({_describe_exit(code)}); worker replaced"}

    def close(self) -> None:
        if self._proc is None:
            return
        self._conn.close()  # the child reads EOF and exits on its own
        self._proc.join(10)
        self._kill()

    def _start(self) -> None:
        self._kill()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child_conn,), name="tilegen-tune-worker", daemon=True)
        self._proc.start()
        child_conn.close()
        hello = None
        if wait([self._conn, self._proc.sentinel], self._start_timeout):
            try:
                hello = self._conn.recv()
            except EOFError:
                pass
        if not (isinstance(hello, dict) and hello.get("ready")):
            self._kill()
            detail = hello["error"] if isinstance(hello, dict) else "it exited or did not answer"
            raise WorkerError(f"the tuning worker failed to start: {detail}")

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join()
            self._proc.close()
            self._conn.close()
        self._proc = self._conn = None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _serve(conn) -> None:
    """The child's loop: one task in, one result dict out, until the parent hangs up."""
    try:
        from tilegen.families import register
        from tilegen.tuning.measure import measure

        inject = json.loads(os.environ.get(INJECT_ENV) or "{}")
    except Exception as e:  # reported to the parent, which cannot tune without a worker
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    # Ctrl-C reaches the whole process group; the parent decides, and closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_leave_with_parent, args=(os.getppid(),), daemon=True).start()
    conn.send({"ready": True})
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
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


def _leave_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


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
