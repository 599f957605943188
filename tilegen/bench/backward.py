"""Attention-training benchmark: forward+backward and backward alone, tilegen against SDPA (flash, cuDNN) and FlexAttention, in one run.

    python -m tilegen.bench.backward                      # the issue's grid (or: tilegen bench backward)
    python -m tilegen.bench.backward --out results/       # also backward.md, backward.json and backward.png there
    python -m tilegen.bench.backward --dims 128 --heads 32/8 --masks causal --seqlens 4096 --peers tilegen,cudnn
    python -m tilegen.bench.backward --rounds 3           # each figure the median of 3 rounds, peers taking turns
    python -m tilegen.bench.backward --memory             # peak memory of one forward+backward at 64k tokens
    python -m tilegen.bench.backward --smoke              # tiny shapes, fp32, the interpreter without a GPU

Peers, each on the same inputs: ``tilegen`` (``tilegen.attention``), ``fa2`` (SDPA's flash
backend, FlashAttention-2), ``cudnn`` (SDPA's cuDNN backend) and ``flex`` (compiled
FlexAttention, a causal block mask for causal); GQA through ``enable_gqa``. Default grid: head
dim 64 and 128, heads 32/32 and 32/8, causal and full, N 1024, 4096, 16384 at 16k tokens per call
(batch 16384 // N), bf16. Forward+backward times ``autograd.grad`` of a fresh forward; backward
alone times ``autograd.grad(out, (q, k, v), dout, retain_graph=True)`` after one forward, for
every peer alike; figures are ``triton.testing.do_bench`` medians. FLOPs: 4*B*Hq*N*N*D for the
forward (halved for causal), 2.5 times that for the backward, 3.5 times for both. Before timing,
tilegen's output and gradients are checked against SDPA's math backend in fp32 on the same
inputs (relative Frobenius error below 1e-2); a cell that fails is marked failed and the exit
status is 1. A peer that does not run here (no cuDNN backend, flex failing to compile, out of
memory) is reported as n/a. ``--memory`` reports instead each peer's peak memory of one
forward+backward above its inputs (``max_memory_allocated`` after ``reset_peak_memory_stats``).
``--smoke`` (the default without a GPU) runs B=1, 2 query heads, N=33, D=16 in fp32 against SDPA's
math backend alone, each figure one ``time.perf_counter`` call: it checks that the script runs,
not speed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

import tilegen
from tilegen.bench import pyplot, take_turns, whole_numbers
from tilegen.bench.attention import _error, _rel_err, peers
from tilegen.device import device_info
from tilegen.env import interpreting
from tilegen.families import family_of
from tilegen.families.attention_bwd import AttentionBwdSpec
from tilegen.families.attention_fwd.spec import SUPPORTED_HEAD_DIMS

__all__ = ["main", "plot"]

TOKENS = 16384
TOLERANCE = 1e-2
PEERS = ("tilegen", "fa2", "cudnn", "flex", "math")
GPU_PEERS = ("tilegen", "fa2", "cudnn", "flex")
SMOKE_PEERS = ("tilegen", "math")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The math reference holds a few fp32 [heads, N, N] matrices: heads go through it this many scores at a time.
REFERENCE_SCORES = 1 << 28


@dataclass(frozen=True)
class Cell:
    seqlen: int
    head_dim: int
    heads_q: int
    heads_kv: int
    causal: bool
    dtype: str = "bf16"
    batch: int = 0  # 0: TOKENS // seqlen (at least 1)

    @property
    def b(self) -> int:
        return self.batch or max(1, TOKENS // self.seqlen)

    @property
    def forward_flops(self) -> float:
        flops = 4 * self.b * self.heads_q * self.seqlen * self.seqlen * self.head_dim
        return flops / 2 if self.causal else flops

    def __str__(self) -> str:
        dtype = "" if self.dtype == "bf16" else f" {self.dtype}"
        return (f"N={self.seqlen} d={self.head_dim} {self.heads_q}/{self.heads_kv} "
                f"{'causal' if self.causal else 'full'}{dtype}")


def _inputs(cell: Cell, device, seed: int = 0):
    """q, k, v (requiring grad) and dout, drawn in fp32 and rounded to the cell's dtype."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[cell.dtype]

    def draw(heads):
        shape = (cell.b, heads, cell.seqlen, cell.head_dim)
        return torch.randn(shape, device=device, generator=g).to(dtype)

    q, k, v = (draw(h).requires_grad_() for h in (cell.heads_q, cell.heads_kv, cell.heads_kv))
    return q, k, v, draw(cell.heads_q)


def _math(causal: bool, gqa: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return run


def _peers(cell: Cell, names, deterministic: bool) -> dict:
    gqa = cell.heads_kv != cell.heads_q
    kwargs = {"deterministic": True} if deterministic else {}  # passed only when asked: older tilegen lacks it
    fns = {"tilegen": lambda q, k, v: tilegen.attention(q, k, v, causal=cell.causal, **kwargs),
           "math": _math(cell.causal, gqa)}
    if set(names) & {"fa2", "cudnn", "flex"}:
        if "flex" in names:
            # A compiled backward that donates its saved buffers runs once per graph; backward alone is timed
            # by running it again on one forward (retain_graph), as for every peer.
            import torch._functorch.config as functorch_config
            functorch_config.donated_buffer = False
        sdpa = peers(cell.causal, gqa, cell.seqlen)
        fns.update(fa2=sdpa["sdpa-flash"], cudnn=sdpa["sdpa-cudnn"], flex=sdpa["flex"])
    return {name: fns[name] for name in names}


def reference(q, k, v, dout, causal: bool) -> tuple[torch.Tensor, ...]:
    """``(out, dq, dk, dv)`` of SDPA's math backend in fp32, a group of heads at a time (at N=16k one
    fp32 score matrix per head is a gigabyte). K and V are repeated to the query heads and their
    gradients summed back over each group."""
    b, hq, n, _ = q.shape
    group = hq // k.shape[1]
    flat = [t.detach().float().repeat_interleave(r, dim=1).reshape(b * hq, 1, n, -1)
            for t, r in ((q, 1), (k, group), (v, group), (dout, 1))]
    results = [torch.empty_like(t) for t in flat]
    step = max(1, REFERENCE_SCORES // (n * n))
    run = _math(causal, False)
    for s in range(0, b * hq, step):
        qs, ks, vs = (t[s:s + step].clone().requires_grad_() for t in flat[:3])
        out = run(qs, ks, vs)
        grads = torch.autograd.grad(out, (qs, ks, vs), flat[3][s:s + step])
        for result, part in zip(results, (out.detach(), *grads)):
            result[s:s + step] = part
    out, dq, dk, dv = (t.reshape(b, hq, n, -1) for t in results)
    dk, dv = (t.reshape(b, hq // group, group, n, -1).sum(2) for t in (dk, dv))
    return out, dq, dk, dv


def check(fn, q, k, v, dout, ref) -> dict:
    """Relative errors of ``fn``'s output and gradients against ``ref``."""
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return {name: _rel_err(t, r) for name, t, r in zip(("out", "dq", "dk", "dv"), (out, *grads), ref)}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ms(fn, smoke: bool) -> float:
    if smoke:  # the interpreter: one call says the path runs; its time means nothing
        start = time.perf_counter()
        fn()
        _sync()
        return (time.perf_counter() - start) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _times(fn, q, k, v, dout, smoke: bool) -> tuple[float, float]:
    """(forward+backward ms, backward-alone ms)."""
    fn(q, k, v).backward(dout)  # warm-up (compiles flex, tilegen's kernels); a peer missing here fails
    q.grad = k.grad = v.grad = None
    fwd_bwd_ms = _ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), smoke)
    out = fn(q, k, v)
    bwd_ms = _ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), smoke)
    del out
    return fwd_bwd_ms, bwd_ms


def _timed(fn, config, q, k, v, dout, smoke: bool) -> tuple[float, float]:
    from tilegen.bench import forced_config

    try:
        with forced_config("attention_bwd", config) if config is not None else contextlib.nullcontext():
            return _times(fn, q, k, v, dout, smoke)
    finally:
        gc.collect()


def bench_cell(cell: Cell, names, device, smoke: bool = False, deterministic: bool = False, configs=(),
               rounds: int = 1) -> dict:
    """One cell: each peer's times, tilegen's gradients checked first; with ``configs`` (attention_bwd configs),
    tilegen again under each of them as a peer named ``tilegen <config>``, each checked as well. With several
    ``rounds`` the peers take turns (``tilegen.bench.take_turns``); a figure is the median of its rounds."""
    from tilegen.bench import forced_config

    q, k, v, dout = _inputs(cell, device)
    row = {"cell": str(cell), "batch": cell.b}
    fns = _peers(cell, names, deterministic)
    runs = [(name, fn, None) for name, fn in fns.items()]
    runs += [(f"tilegen {c}", _peers(cell, ["tilegen"], deterministic)["tilegen"], c) for c in configs]
    ref = None
    for name, fn, config in runs:
        if name.startswith("tilegen"):
            key = "check" if config is None else f"check {config}"
            try:
                with forced_config("attention_bwd", config) if config is not None else contextlib.nullcontext():
                    ref = reference(q, k, v, dout, cell.causal) if ref is None else ref
                    errors = check(fn, q, k, v, dout, ref)
                row[key] = {"errors": errors, "passed": max(errors.values()) < TOLERANCE}
            except Exception as e:  # e.g. no backward yet: the cell fails, the run goes on
                row[key] = {"error": _error(e), "passed": False}
    fwd, bwd = cell.forward_flops, 2.5 * cell.forward_flops
    timers = {}
    for name, fn, config in runs:
        checked = row.get("check" if config is None else f"check {config}", {}) if name.startswith("tilegen") else {}
        if checked and not checked["passed"]:
            # A config that did not run (out of shared memory, say) is no wrong gradient: say which it was.
            row[name] = {"error": f"did not run: {checked['error']}" if "error" in checked
                         else "failed the gradient check"}
        else:
            timers[name] = functools.partial(_timed, fn, config, q, k, v, dout, smoke)
    found_by_name, failed = take_turns(timers, rounds)
    for name, e in failed.items():
        row[name] = {"error": _error(e)}
    for name, found in found_by_name.items():
        fwd_bwd_ms = statistics.median(f for f, _ in found)
        bwd_ms = statistics.median(b for _, b in found)
        row[name] = {"fwd_bwd_ms": fwd_bwd_ms, "fwd_bwd_tflops": (fwd + bwd) / fwd_bwd_ms * 1e-9,
                     "bwd_ms": bwd_ms, "bwd_tflops": bwd / bwd_ms * 1e-9}
        if rounds > 1:
            row[name]["bwd_ms_rounds"] = [b for _, b in found]
    return row


def ragged_lengths(cell: Cell, seed: int = 0) -> list[int]:
    """Sequence lengths drawn in [N/4, 7N/4] (seeded) that pack the cell's B x N tokens."""
    g = torch.Generator().manual_seed(seed)
    total, lengths = cell.b * cell.seqlen, []
    while total > 0:
        n = int(torch.randint(max(1, cell.seqlen // 4), max(2, 7 * cell.seqlen // 4), (), generator=g))
        lengths.append(min(n, total))
        total -= lengths[-1]
    return lengths


def ragged_cell(cell: Cell, device, smoke: bool = False, deterministic: bool = False, configs=()) -> dict:
    """tilegen's backward over a packed batch of mixed lengths (``varlen_attention``) against its dense
    backward at the same tokens (``attention``, B x N), in one run; TFLOP/s count the pairs each computes. With
    ``configs`` (attention_bwd configs), the ragged backward again under each, its gradients checked against the
    dispatched config's first."""
    from tilegen.bench import forced_config

    lengths = ragged_lengths(cell)
    kwargs = {"deterministic": True} if deterministic else {}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v, dout = _inputs(cell, device)
    # The dense inputs' tokens, packed: [B * N, heads, dim].
    packed = [t.detach().transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (q, k, v, dout)]
    pq, pk, pv = (t.clone().requires_grad_() for t in packed[:3])
    row = {"cell": str(cell), "batch": cell.b, "lengths": lengths}
    # A check: the first sequence's gradients against SDPA's math backend in fp32.
    first = slice(0, lengths[0])

    def forward():
        return tilegen.varlen_attention(pq, pk, pv, cu, cu, max(lengths), max(lengths), causal=cell.causal, **kwargs)

    def backward(out):
        return torch.autograd.grad(out, (pq, pk, pv), packed[3], retain_graph=True)

    out = forward()
    got = backward(out)
    as_dense = lambda t: t[first].transpose(0, 1)[None]  # noqa: E731
    ref = reference(*(as_dense(t).detach().requires_grad_() for t in (pq, pk, pv)), as_dense(packed[3]), cell.causal)
    errors = {name: _rel_err(as_dense(g), r) for name, g, r in zip(("dq", "dk", "dv"), got, ref[1:])}
    row["check"] = {"errors": errors, "passed": max(errors.values()) < TOLERANCE}
    pairs = sum(n * (n + 1) // 2 if cell.causal else n * n for n in lengths)
    bwd_ragged = 2.5 * 4 * cell.heads_q * pairs * cell.head_dim
    ms = _ms(lambda: backward(out), smoke)
    row["ragged"] = {"bwd_ms": ms, "bwd_tflops": bwd_ragged / ms * 1e-9}
    spec = AttentionBwdSpec(head_dim=cell.head_dim, q_per_kv=cell.heads_q // cell.heads_kv,
                            mask="causal" if cell.causal else "none", dtype=cell.dtype, layout="ragged")
    for config in configs:
        # A config the ragged kernels do not run would be timed as the kernels its launch falls to.
        refused = family_of(spec).feasible(spec, config, device_info())
        if refused is not None:
            row[f"ragged {config}"] = {"error": f"infeasible: {refused}"}
            continue
        try:
            with forced_config("attention_bwd", config):
                forced = forward()
                error = max(_rel_err(g, r) for g, r in zip(backward(forced), got))
                if not error < TOLERANCE:
                    row[f"ragged {config}"] = {"error": f"gradients {error:.2e} from the dispatched config's"}
                    continue
                ms = _ms(lambda: backward(forced), smoke)
            row[f"ragged {config}"] = {"bwd_ms": ms, "bwd_tflops": bwd_ragged / ms * 1e-9, "error_vs_dispatched": error}
        except Exception as e:  # out of shared memory, say: reported, the run goes on
            row[f"ragged {config}"] = {"error": _error(e)}
    dense_out = tilegen.attention(q, k, v, causal=cell.causal, **kwargs)
    ms = _ms(lambda: torch.autograd.grad(dense_out, (q, k, v), dout, retain_graph=True), smoke)
    row["dense"] = {"bwd_ms": ms, "bwd_tflops": 2.5 * cell.forward_flops / ms * 1e-9}
    row["ratio"] = row["ragged"]["bwd_tflops"] / row["dense"]["bwd_tflops"]
    return row


def memory_cell(cell: Cell, names, deterministic: bool = False) -> dict:
    """Each peer's peak allocation of one forward+backward above its inputs (and dout), in GB."""
    q, k, v, dout = _inputs(cell, "cuda")
    row = {"cell": str(cell), "batch": cell.b}
    for name, fn in _peers(cell, names, deterministic).items():
        try:
            fn(q, k, v).backward(dout)  # warm-up: compiling must not count
            q.grad = k.grad = v.grad = None
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            grads = torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
            torch.cuda.synchronize()
            row[name] = {"peak_gb": (torch.cuda.max_memory_allocated() - base) / 1e9}
            del grads
        except Exception as e:
            oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
            row[name] = {"error": "out of memory" if oom else _error(e)}
        gc.collect()
        torch.cuda.empty_cache()
    return row


def _fmt(entry: dict | None, key: str, spec: str = ".3g") -> str:
    if entry is None:
        return "-"
    return f"{entry[key]:{spec}}" if key in entry else "n/a"


def _ratio(row: dict, key: str, peer: str = "cudnn") -> str:
    a, b = row.get("tilegen", {}), row.get(peer, {})
    return f"{a[key] / b[key]:.2f}" if key in a and key in b else "-"


def _status(row: dict) -> str:
    check = row.get("check")
    if check is None:
        return "unchecked"
    if "error" in check:
        return f"FAILED ({check['error']})"
    return f"{'ok' if check['passed'] else 'FAILED'} ({max(check['errors'].values()):.1e})"


def markdown(rows: list[dict], names, memory: bool = False) -> str:
    """The results as a markdown table: TFLOP/s (backward alone, forward+backward) per peer, or peak GB."""
    if memory:
        lines = ["| cell | batch | " + " | ".join(f"{n} peak GB" for n in names) + " |",
                 "|" + "---|" * (len(names) + 2)]
        lines += [f"| {r['cell']} | {r['batch']} | " + " | ".join(_fmt(r.get(n), "peak_gb", ".2f") for n in names) + " |"
                  for r in rows]
        return "\n".join(lines)
    ratio = "tilegen" in names and "cudnn" in names
    head = [f"{n} bwd TFLOP/s | {n} fwd+bwd TFLOP/s" for n in names]
    lines = ["| cell | batch | " + " | ".join(head) + (" | tilegen/cudnn bwd | tilegen/cudnn fwd+bwd" if ratio else "")
             + " | tilegen check (worst rel. err) |",
             "|" + "---|" * (2 * len(names) + 3 + 2 * ratio)]
    for r in rows:
        cells = [f"{_fmt(r.get(n), 'bwd_tflops')} | {_fmt(r.get(n), 'fwd_bwd_tflops')}" for n in names]
        ratios = f" | {_ratio(r, 'bwd_tflops')} | {_ratio(r, 'fwd_bwd_tflops')}" if ratio else ""
        lines.append(f"| {r['cell']} | {r['batch']} | " + " | ".join(cells) + ratios + f" | {_status(r)} |")
    return "\n".join(lines)


def short_table(rows: list[dict], names, memory: bool = False) -> str:
    """One line per cell: each peer's backward-alone TFLOP/s (or peak GB) and tilegen over cuDNN."""
    key, spec = ("peak_gb", ".2f") if memory else ("bwd_tflops", ".3g")
    width = max([len("cell")] + [len(r["cell"]) for r in rows])
    lines = [f"{'cell':<{width}} " + " ".join(f"{n:>8}" for n in names) + "  tilegen/cudnn",
             *(f"{r['cell']:<{width}} " + " ".join(f"{_fmt(r.get(n), key, spec):>8}" for n in names)
               + f"  {_ratio(r, key):>13}" + ("" if memory or _status(r).startswith("ok") else f"  {_status(r)}")
               for r in rows)]
    return "\n".join(lines)


def plot(rows: list[dict], names, path: str) -> str | None:
    """Backward-alone TFLOP/s per cell, one bar per peer; the PNG's path, or ``None`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    # About half an inch a cell, within a page's width: the grid is 24 cells.
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 0.55 * len(rows))), 5.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j, r in enumerate(rows) if "bwd_tflops" in r.get(name, {})]
        ys = [r[name]["bwd_tflops"] for r in rows if "bwd_tflops" in r.get(name, {})]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([r["cell"] for r in rows], rotation=60, ha="right", fontsize="small")
    ax.set_ylabel("backward TFLOP/s")
    ax.set_title("Attention backward alone (2.5x the forward's FLOPs)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def _ints(parser, flag: str, value: str) -> list[int]:
    values = whole_numbers(value)
    if values is None:
        parser.error(f"{flag}: expected comma-separated positive whole numbers, got {value!r}")
    return values


def _heads(parser, value: str) -> list[tuple[int, int]]:
    pairs = []
    for item in value.split(","):
        q, _, kv = item.partition("/")
        if not (q.isdigit() and kv.isdigit()) or int(kv) < 1 or int(q) % int(kv):
            parser.error(f"--heads: expected QUERY/KV pairs with the KV heads dividing the query heads "
                         f"(e.g. 32/32,32/8), got {value!r}")
        pairs.append((int(q), int(kv)))
    return pairs


def _choices(parser, flag: str, value: str, known) -> list[str]:
    chosen = value.split(",")
    unknown = [c for c in chosen if c not in known]
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; known: {', '.join(known)}")
    return list(dict.fromkeys(chosen))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", help="head dims (default 64,128; --memory 128; --smoke 16)")
    parser.add_argument("--heads", help="QUERY/KV head pairs (default 32/32,32/8; --memory 32/8; --smoke 2/2,2/1)")
    parser.add_argument("--seqlens", help="sequence lengths, batch 16384 // N (default 1024,4096,16384; "
                        "--memory 65536; --smoke 33)")
    parser.add_argument("--masks", help="causal and/or full (default both; --memory causal)")
    parser.add_argument("--peers", help=f"subset of {', '.join(PEERS)} (default {','.join(GPU_PEERS)}; "
                        f"--smoke {','.join(SMOKE_PEERS)})")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="default bf16 (--smoke fp32)")
    parser.add_argument("--deterministic", action="store_true", help="tilegen's deterministic backward "
                        "(tilegen.attention(..., deterministic=True)); the peers run as they are")
    parser.add_argument("--memory", action="store_true", help="peak memory of one forward+backward instead of time")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes under the interpreter (the default without "
                        "a GPU): checks that the script runs")
    parser.add_argument("--ragged", action="store_true", help="tilegen's backward over packed sequences of mixed "
                        "lengths (N/4 to 7N/4, B x N tokens) against its dense backward at B x N, instead of the peers")
    parser.add_argument("--out", metavar="DIR", help="write backward.md, backward.json and backward.png here")
    parser.add_argument("--configs", default=None,
                        help="also time tilegen under each of these attention_bwd configs, a JSON list of knob "
                             "objects ([{\"block_m1\": 64, \"block_n1\": 128, ..., \"wgmma\": 2}, ...]): each a peer "
                             "of its own, its gradients checked first (with --ragged, the ragged backward under each)")
    parser.add_argument("--rounds", type=int, default=1, help="time the peers of a cell in this many rounds, taking "
                        "turns in a rotating order; each figure the median of its rounds (default 1)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.ragged and args.memory:
        parser.error("--ragged: times the backward; leave out --memory")
    on_gpu = torch.cuda.is_available()
    smoke = args.smoke or not on_gpu
    if args.memory and smoke:
        parser.error("--memory: measures the CUDA allocator's peaks; run it on a GPU, without --smoke")
    defaults = ({"dims": "16", "heads": "2/2,2/1", "seqlens": "33", "masks": "causal,full"} if smoke else
                {"dims": "128", "heads": "32/8", "seqlens": "65536", "masks": "causal"} if args.memory else
                {"dims": "64,128", "heads": "32/32,32/8", "seqlens": "1024,4096,16384", "masks": "causal,full"})
    dims = _ints(parser, "--dims", args.dims or defaults["dims"])
    unsupported = [d for d in dims if d not in SUPPORTED_HEAD_DIMS]
    if unsupported:  # else every cell would run and report FAILED for the same reason
        parser.error(f"--dims: {unsupported[0]} is no head dim the kernels take (multiples of 8 from 16 to 256)")
    heads = _heads(parser, args.heads or defaults["heads"])
    seqlens = _ints(parser, "--seqlens", args.seqlens or defaults["seqlens"])
    masks = _choices(parser, "--masks", args.masks or defaults["masks"], ("causal", "full"))
    names = _choices(parser, "--peers", args.peers or ",".join(SMOKE_PEERS if smoke else GPU_PEERS), PEERS)
    if smoke and not set(names) <= set(SMOKE_PEERS):
        parser.error(f"--peers: without a GPU (--smoke) only {', '.join(SMOKE_PEERS)} run")
    dtype = args.dtype or ("fp32" if smoke else "bf16")
    configs = []
    if args.configs is not None:
        from tilegen.families import registry

        try:  # a ConfigError is a ValueError, as is bad JSON
            configs = [registry.get("attention_bwd").config_type.from_dict(c) for c in json.loads(args.configs)]
        except ValueError as e:
            parser.error(f"--configs: expected a JSON list of attention_bwd knob objects: {e}")
        if args.memory:
            parser.error("--configs times the backward: not with --memory")
    shown = list(names) + [f"tilegen {c}" for c in configs]
    if smoke and not on_gpu and not interpreting():
        # Triton picks the interpreter when it is imported, which `import tilegen` already did.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.run([sys.executable, "-m", "tilegen.bench.backward", *argv], env=env, check=False).returncode
    device = "cuda" if on_gpu else "cpu"
    cells = [Cell(n, d, hq, hkv, m == "causal", dtype, batch=1 if smoke else 0)
             for (hq, hkv) in heads for d in dims for m in masks for n in seqlens]
    where = torch.cuda.get_device_name() if on_gpu else "CPU (Triton interpreter, --smoke: times mean nothing)"
    print(f"# {where}, torch {torch.__version__}, triton {triton.__version__}, tilegen {tilegen.__version__}"
          + (", tilegen deterministic" if args.deterministic else ""), flush=True)
    rows = []
    for cell in cells:
        if args.ragged:
            rows.append(ragged_cell(cell, device, smoke, args.deterministic, configs))
        else:
            rows.append(memory_cell(cell, names, args.deterministic) if args.memory
                        else bench_cell(cell, names, device, smoke, args.deterministic, configs, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
        if on_gpu:
            torch.cuda.empty_cache()
    if args.ragged:
        print("\nbackward-alone TFLOP/s, ragged against dense at the same tokens")
        for row in rows:
            print(f"{row['cell']:28} ragged {row['ragged']['bwd_tflops']:8.3g} ({row['ragged']['bwd_ms']:.3g} ms)  "
                  f"dense {row['dense']['bwd_tflops']:8.3g} ({row['dense']['bwd_ms']:.3g} ms)  ratio {row['ratio']:.2f}"
                  f"  check {'ok' if row['check']['passed'] else 'FAILED'}")
            for config in configs:
                found = row[f"ragged {config}"]
                timed = "bwd_ms" in found
                shown = f"{found['bwd_tflops']:8.3g} ({found['bwd_ms']:.3g} ms)" if timed else found["error"]
                print(f"{'':28} ragged {shown}  {config}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "backward_ragged.json"), "w") as f:
                json.dump({"device": where, "dtype": dtype, "rows": rows}, f, indent=1)
        return 1 if any(not r["check"]["passed"] for r in rows) else 0
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, "backward_memory" if args.memory else "backward")
        with open(stem + ".json", "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "triton": triton.__version__,
                       "dtype": dtype, "deterministic": args.deterministic, "rows": rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(f"{where}, {dtype}\n\n{markdown(rows, shown, args.memory)}\n")
        if not args.memory:
            written = plot(rows, shown, stem + ".png")
            print(f"plot: {written}" if written else "plot: matplotlib is not installed; no plot")
    print("\npeak GB above the inputs, one forward+backward" if args.memory
          else "\nbackward-alone TFLOP/s (forward+backward and per-cell checks: --out)")
    print(short_table(rows, shown, args.memory))
    failed = [r for r in rows if any(not c["passed"] for key, c in r.items() if key.startswith("check"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
