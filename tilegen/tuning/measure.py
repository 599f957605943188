"""One trial's measurement, for any family: fresh inputs from its Problem, a correctness gate, then timing.

Trials launch through the spec's ``Launcher`` (``tilegen.dispatch.launcher_for``), the one the
ops replay, by its direct path: the kernels a tune times are launched as the ops launch them.

This runs inside the tuning worker process (``tilegen.tuning.worker``), which turns
any exception raised here into a trial status.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton.testing

from tilegen.dispatch import launcher_for
from tilegen.families import Config, Family, Problem

__all__ = ["Compare", "compare", "measure", "replayable", "time_ms"]

_CPU_TIMING_RUNS = 3


def measure(problem: Problem, config: Config, seed: int, *, perturb: bool = False) -> dict:
    """Check ``config`` against the family's reference on fresh inputs; time it when correct.

    Returns ``{"status": "ok" | "wrong", "time_ms", "max_error", "reason"}``.
    ``perturb`` spoils the output after the kernel (the tests' "wrong" injection).
    """
    # The launcher the ops replay (its direct path): what is tuned is what runs.
    launcher = launcher_for(problem.spec)
    inputs = problem.inputs(seed)
    outputs = problem.outputs(inputs)  # NaN poison: an element the kernel fails to write fails the check

    def launch():
        problem.launch(launcher, config, inputs, outputs)

    launch()
    if perturb:
        outputs[0].add_(0.5)
    error, max_error = problem.check(inputs, outputs)
    if not error <= problem.tolerance:  # NaN compares false: it never passes
        return {"status": "wrong", "time_ms": None, "max_error": max_error,
                "reason": f"relative error {error:.2e} exceeds {problem.tolerance:.0e}"}
    return {"status": "ok", "time_ms": time_ms(replayable(launch, problem), problem.on_gpu), "max_error": max_error,
            "reason": None}


@dataclass(frozen=True)
class Compare:
    """A worker task: time configs that were each measured once (and found correct) again,
    alternately, on one device and one set of inputs. Their first times come from different
    moments, or different GPUs of one model, between which a kernel's time moves by a few percent."""

    family: Family
    problem: Problem
    configs: tuple[Config, ...]
    seed: int
    rounds: int


def compare(problem: Problem, configs: tuple[Config, ...], seed: int, rounds: int) -> dict:
    """``{"status": "ok", "times_ms": [...]}``: each config's median over ``rounds`` alternating rounds."""
    launcher = launcher_for(problem.spec)
    inputs = problem.inputs(seed)
    outputs = problem.outputs(inputs)
    launches = [functools.partial(problem.launch, launcher, config, inputs, outputs) for config in configs]
    for launch in launches:
        launch()  # compiled, or loaded, before any timing
    launches = [replayable(launch, problem) for launch in launches]
    times: list[list[float]] = [[] for _ in configs]
    for _ in range(rounds):
        for kept, launch in zip(times, launches):
            kept.append(time_ms(launch, problem.on_gpu))
    return {"status": "ok", "times_ms": [statistics.median(kept) for kept in times]}


def replayable(launch: Callable[[], None], problem: Problem) -> Callable[[], None]:
    """``problem``'s ``launch`` captured in a CUDA graph, as its replay, when the problem is on a
    GPU and ``timed_from_graph``; ``launch`` itself otherwise, or when it cannot be captured (it
    synchronizes, say). ``launch`` must have run once already, so that its kernels are compiled
    and loaded.

    A trial then times its kernels, not the host's way to them: ``do_bench`` starts the clock
    after its L2 flush, and a launch whose Python outlasts that flush on the GPU is timed partly
    as host time. On the H200 a decode trial's launch (its split buffers, Triton's JIT entry
    point twice) outlasted 36-52 us MQA kernels: at 1 x 131072 four configs read 412-1104 GB/s
    of KV timed eagerly, 1285-1856 replayed, ranked differently."""
    if not (problem.on_gpu and problem.timed_from_graph):
        return launch
    captured = torch.cuda.CUDAGraph()
    try:
        # thread_local: a capture error in this thread is not one for another thread's CUDA calls.
        with torch.cuda.graph(captured, capture_error_mode="thread_local"):
            launch()
    except Exception:  # noqa: BLE001 - whatever stops the capture, the eager launch still times the config
        torch.cuda.synchronize()
        return launch
    return captured.replay


def time_ms(launch, on_gpu: bool) -> float:
    """Median time of one ``launch()``: ``do_bench`` on a GPU, wall clock under the interpreter."""
    if on_gpu:
        return float(triton.testing.do_bench(launch, return_mode="median"))
    # The interpreter is not a GPU: wall-clock only ranks configs against each other on this machine.
    runs = []
    for _ in range(_CPU_TIMING_RUNS):
        start = time.perf_counter()
        launch()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)
