"""One trial's measurement, for any family: fresh inputs from its Problem, a correctness gate, then timing.

This runs inside the tuning worker process (``tilegen.tuning.worker``), which turns
any exception raised here into a trial status.
"""

from __future__ import annotations

import statistics
import time

import triton.testing

from tilegen.codegen import module_for
from tilegen.families import Config, Problem

__all__ = ["measure", "time_ms"]

_CPU_TIMING_RUNS = 3


def measure(problem: Problem, config: Config, seed: int, *, perturb: bool = False) -> dict:
    """Check ``config`` against the family's reference on fresh inputs; time it when correct.

    Returns ``{"status": "ok" | "wrong", "time_ms", "max_error", "reason"}``.
    ``perturb`` spoils the output after the kernel (the tests' "wrong" injection).
    """
    module = module_for(problem.spec)
    inputs = problem.inputs(seed)
    outputs = problem.outputs(inputs)  # NaN poison: an element the kernel fails to write fails the check

    def launch():
        problem.launch(module, config, inputs, outputs)

    launch()
    if perturb:
        outputs[0].add_(0.5)
    error, max_error = problem.check(inputs, outputs)
    if not error <= problem.tolerance:  # NaN compares false: it never passes
        return {"status": "wrong", "time_ms": None, "max_error": max_error,
                "reason": f"relative error {error:.2e} exceeds {problem.tolerance:.0e}"}
    return {"status": "ok", "time_ms": time_ms(launch, problem.on_gpu), "max_error": max_error, "reason": None}


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
