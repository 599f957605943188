"""One trial's measurement: fresh inputs for a bucket, a correctness gate, then timing.

This runs inside the tuning worker process (``tilegen.tuning.worker``), which turns
any exception raised here into a trial status.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import triton.testing

from tilegen.codegen.attention_fwd import Config
from tilegen.ir import AttentionSpec
from tilegen.ops.attention import prepare_call, run_with_config
from tilegen.reference import attention_reference

__all__ = ["Problem", "measure", "time_ms", "TOLERANCE"]

_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
#: Largest relative Frobenius error a config may show against the reference.
TOLERANCE = {"fp16": 1e-2, "bf16": 1e-2, "fp32": 1e-4}
#: A GPU bucket is timed on this many tokens (batch x seq) and query heads: enough
#: work to fill an H200, so the timing ranks configs as a real prefill would.
_GPU_TOKENS = 16384
_GPU_HEADS = 16
#: Under the interpreter every element costs microseconds: one tiny head pair keeps a trial under a second.
_CPU_HEADS = 2
_CPU_MAX_SEQ = 64
#: Score elements the reference may materialize (1 GiB in fp32); past it only the last rows are checked.
_REFERENCE_BUDGET = 1 << 28
#: Softcap value used when the spec has one: small enough that tanh actually bends the logits.
_SOFTCAP = 10.0
_CPU_TIMING_RUNS = 3


@dataclass(frozen=True)
class Problem:
    """The shapes and launch values one bucket is measured with on one kind of device."""

    batch: int
    heads_kv: int
    q_per_kv: int
    seq: int
    on_gpu: bool

    @classmethod
    def for_bucket(cls, spec: AttentionSpec, bucket: int, *, on_gpu: bool) -> Problem:
        heads = _GPU_HEADS if on_gpu else _CPU_HEADS
        seq = bucket if on_gpu else min(bucket, _CPU_MAX_SEQ)
        batch = max(1, _GPU_TOKENS // seq) if on_gpu else 1
        return cls(batch, max(1, heads // spec.q_per_kv), spec.q_per_kv, seq, on_gpu)

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.q_per_kv

    def inputs(self, spec: AttentionSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fresh standard-normal ``q, k, v`` (never zeros, so a kernel that skips work shows)."""
        device = "cuda" if self.on_gpu else "cpu"
        dtype = _TORCH_DTYPES[spec.dtype]
        gen = torch.Generator(device).manual_seed(seed)
        shapes = (
            (self.batch, self.heads_q, self.seq, spec.head_dim),
            (self.batch, self.heads_kv, self.seq, spec.head_dim),
            (self.batch, self.heads_kv, self.seq, spec.dv),
        )
        q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for shape in shapes)
        return q, k, v

    def call_kwargs(self, spec: AttentionSpec) -> dict[str, Any]:
        """The ``tilegen.attention`` keyword arguments that select ``spec`` at this length."""
        return {
            "causal": spec.mask == "causal",
            # A window narrower than the sequence, so both of its edges cut through tiles.
            "window": (self.seq // 4, self.seq // 16) if spec.mask == "window" else None,
            "softcap": _SOFTCAP if spec.softcap else None,
            "return_lse": spec.return_lse,
        }

    def visible_pairs(self, spec: AttentionSpec) -> int:
        """(query, key) pairs the mask lets through, per head: the work a kernel cannot skip."""
        kwargs = self.call_kwargs(spec)
        n = self.seq
        if kwargs["causal"]:
            return n * (n + 1) // 2
        if kwargs["window"] is None:
            return n * n
        left, right = kwargs["window"]
        rows = torch.arange(n)
        first = (rows - left).clamp(min=0)
        last = (rows + right).clamp(max=n - 1)
        return int((last - first + 1).clamp(min=0).sum())

    def flops(self, spec: AttentionSpec) -> float:
        """2 FLOPs per multiply-add in QK^T and in PV, over the visible pairs only."""
        return 2.0 * self.batch * self.heads_q * self.visible_pairs(spec) * (spec.head_dim + spec.dv)

    def bytes_moved(self, spec: AttentionSpec) -> float:
        """Q, K and V read once and the output written once: the least traffic any kernel needs."""
        elt = _TORCH_DTYPES[spec.dtype].itemsize
        per_token = self.heads_q * (spec.head_dim + spec.dv) + self.heads_kv * (spec.head_dim + spec.dv)
        return float(self.batch * self.seq * per_token * elt)


def measure(spec: AttentionSpec, config: Config, problem: Problem, seed: int, *, perturb: bool = False) -> dict:
    """Check ``config`` against the reference on fresh inputs; time it when correct.

    Returns ``{"status": "ok" | "wrong", "time_ms", "max_error", "reason"}``.
    ``perturb`` spoils the output after the kernel (the tests' "wrong" injection).
    """
    q, k, v = problem.inputs(spec, seed)
    kwargs = problem.call_kwargs(spec)
    call_spec, left, right, scale, softcap = prepare_call(q, k, v, scale=None, **kwargs)
    if call_spec != spec:
        raise AssertionError(f"inputs built for {spec.name} select {call_spec.name}")
    # NaN poison: any output element the kernel fails to write fails the check.
    out = torch.full((*q.shape[:3], spec.dv), float("nan"), device=q.device, dtype=q.dtype)

    def launch():
        return run_with_config(spec, config, q, k, v, scale, softcap, left, right, out=out)

    _, lse = launch()
    if perturb:
        out.add_(0.5)
    error, max_error = _check(spec, q, k, v, out, lse, kwargs, scale)
    if error > TOLERANCE[spec.dtype]:
        return {"status": "wrong", "time_ms": None, "max_error": max_error,
                "reason": f"relative error {error:.2e} exceeds {TOLERANCE[spec.dtype]:.0e}"}
    return {"status": "ok", "time_ms": time_ms(launch, problem.on_gpu), "max_error": max_error, "reason": None}


def _check(spec, q, k, v, out, lse, kwargs, scale) -> tuple[float, float]:
    """Relative Frobenius error (``inf`` on any NaN) and max abs error, against the reference.

    Heads are independent, so the reference covers as many leading KV groups of batch 0
    as the budget allows; past one group it keeps only the last rows, which see the
    same keys as in the full problem because the diagonal is bottom-right aligned.
    """
    if torch.isnan(out).any():
        return float("inf"), float("inf")
    n, g = q.shape[2], spec.q_per_kv
    groups = max(1, min(k.shape[1], _REFERENCE_BUDGET // (g * n * n)))
    rows = min(n, max(1, _REFERENCE_BUDGET // (g * n)))
    compute = torch.float32 if q.is_cuda else torch.float64  # float64 is slow on GPUs; float32 is ample at 1e-2
    ref, ref_lse = attention_reference(
        q[:1, : groups * g, n - rows :], k[:1, :groups], v[:1, :groups],
        causal=kwargs["causal"], window=kwargs["window"], softcap=kwargs["softcap"], scale=scale,
        compute_dtype=compute,
    )
    diff = out[:1, : groups * g, n - rows :].to(compute) - ref
    error = float(diff.norm() / ref.norm().clamp_min(1e-30))
    max_error = float(diff.abs().max())
    if spec.return_lse:
        got = lse[:1, : groups * g, n - rows :].to(compute)
        seen = torch.isfinite(ref_lse)
        if not torch.equal(torch.isfinite(got), seen):
            return float("inf"), float("inf")
        lse_error = float((got[seen] - ref_lse[seen]).norm() / ref_lse[seen].norm().clamp_min(1e-30))
        error = max(error, lse_error)
    return error, max_error


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
