"""Shared-prefix decode on a GPU: ``tilegen.CascadeAttention`` against ``tilegen.PagedDecode``.

    python -m tilegen.bench.cascade --out cascade.json
    python -m tilegen.bench.cascade --cases 64x32768+1024 --configs M64-N64-w4-s3-c3/N64-w2-s2-c3,...
    python -m tilegen.bench.cascade --rounds 3     # each figure the median of 3 rounds, providers taking turns

bf16, 32 query / 8 KV heads, head dim 128, page 16, one query token per request (decode). Each
case is ``batch x shared prefix + own tokens``: every request's page table starts with the same
prefix pages and ends with pages of its own. Timed, ``do_bench`` medians:

- ``decode-shared``: ``PagedDecode`` over those page tables (it reads the prefix once per request,
  part of it from L2);
- ``decode-unshared``: ``PagedDecode`` over the same lengths in pages of their own (no L2 help): its
  bandwidth is the case's ``GB/s`` ceiling, and the unique bytes (prefix once, the suffixes) at that
  bandwidth are the ``ideal`` column;
- ``cascade``: ``CascadeAttention`` over ``cascade_levels(cache)``, the levels derived from the
  shared page tables (planned once, outside the timing).

A last case shares nothing (``--unshared``): cascade against ``PagedDecode`` on the same cache. The
cascade output is checked against ``PagedDecode``'s before timing. With ``--rounds N`` the providers of a case
are timed in N rounds, taking turns in a rotating order (``tilegen.bench.take_turns``), each figure the median
of its rounds: a drift of the GPU's clocks within a case then weighs on every provider alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
from collections.abc import Callable

import torch
import triton

import tilegen
from tilegen import dispatch
from tilegen.families import relative_error
from tilegen.bench import require_gpu, take_turns

HQ, HKV, D, PAGE = 32, 8, 128, 16
CASES = [(64, 32768, 1024), (8, 32768, 1024), (64, 4096, 256)]
UNSHARED = [(64, 4096), (8, 16384)]
DEVICE = "cuda"


def _bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3  # us


def _cache(batch: int, prefix: int, own: int, shared: bool, gen) -> tilegen.PagedKVCache:
    """``batch`` sequences of ``prefix + own`` tokens; the prefix pages shared when ``shared``."""
    prefix_pages, own_pages = prefix // PAGE, math.ceil(own / PAGE)
    per = (1 if shared else batch) * prefix_pages
    n_pages = per + batch * own_pages
    k = torch.randn(n_pages, PAGE, HKV, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(n_pages, PAGE, HKV, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(n_pages, device=DEVICE, generator=gen).to(torch.int32)
    rows = []
    for b in range(batch):
        head = perm[:prefix_pages] if shared else perm[b * prefix_pages:(b + 1) * prefix_pages]
        rows.append(torch.cat([head, perm[per + b * own_pages:per + (b + 1) * own_pages]]))
    indices = torch.cat(rows)
    indptr = torch.arange(0, batch + 1, device=DEVICE, dtype=torch.int32) * (prefix_pages + own_pages)
    last = torch.full((batch,), own - (own_pages - 1) * PAGE, device=DEVICE, dtype=torch.int32)
    return tilegen.PagedKVCache(k, v, indptr, indices, last)


def _decode(cache, q):
    """``PagedDecode``'s output over ``cache`` and a call of its run (planned outside the timing)."""
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=HQ)
    return decode.run(q, cache), lambda: decode.run(q, cache)


def _cascade(cache, q, levels, config=None) -> tuple[torch.Tensor, Callable, str, int, dict]:
    """Plan (outside the timing): the output, a call of ``run``, the config, the work items and the kernels' times;
    ``config`` replaces the dispatched one."""
    cascade = tilegen.CascadeAttention()
    table = dispatch.table_on(_spec(), q.device)
    if config is None:
        choice = cascade.plan(cache, levels, heads_q=HQ)
    else:
        dispatched = table.choose
        table.choose = lambda size: dataclasses.replace(dispatched(size), config=config, tuned_bucket=None)
        try:
            choice = cascade.plan(cache, levels, heads_q=HQ)
        finally:
            del table.choose  # the instance attribute goes, the method shows again
    out = cascade.run(q, cache)
    run = lambda: cascade.run(q, cache)  # noqa: E731
    return out, run, str(choice.config), cascade.work_items, _kernels(run)


def _kernels(fn, calls: int = 20) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel ``fn`` launches (the shared launch, the last
    level's, the merge), from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count:
            name = "merge" if event.key.endswith("_merge") else event.key[-40:]
            times[name] = round(getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0)) / calls, 1)
    return times


def _spec():
    from tilegen.families.attention_cascade import CascadeSpec

    return CascadeSpec(head_dim=D, q_per_kv=HQ // HKV, dtype="bf16", page_size=PAGE, mask="causal")


def _parse_config(text: str):
    from tilegen.families.attention_cascade import CascadeConfig

    values = [int("".join(c for c in p if c.isdigit())) for p in text.replace("/", "-").split("-")]
    return CascadeConfig(*values)


def _timed(row: dict, runs: dict[str, Callable], rounds: int) -> None:
    """``row[f"{name} us"]``: each run's median over ``rounds`` turns (``take_turns``); one that raised, its error."""
    found, failed = take_turns({name: (lambda run=run: _bench(run)) for name, run in runs.items()}, rounds)
    for name, times in found.items():
        row[f"{name} us"] = statistics.median(times)
        if rounds > 1:
            row[f"{name} us rounds"] = times
    for name, error in failed.items():
        row[f"{name} us"] = f"{type(error).__name__}: {str(error)[:160]}"


def case(batch: int, prefix: int, own: int, configs, rounds: int = 1) -> dict:
    gen = torch.Generator(DEVICE).manual_seed(0)
    shared = _cache(batch, prefix, own, True, gen)
    q = torch.randn(batch, HQ, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    levels = tilegen.cascade_levels(shared)
    expected, decode_shared = _decode(shared, q)
    row = {"batch": batch, "prefix": prefix, "own": own, "levels": len(levels)}
    unshared = _cache(batch, prefix, own, False, gen)
    _, decode_unshared = _decode(unshared, q)
    runs = {"decode-shared": decode_shared, "decode-unshared": decode_unshared}
    for config in [None, *configs]:
        out, run, label, items, kernels = _cascade(shared, q, levels, config)
        error = relative_error(out.float(), expected.float())[0]
        name = "cascade" if config is None else f"cascade {label}"
        row[f"{name} config"] = label
        row[f"{name} items"] = items
        row[f"{name} kernels us"] = kernels
        row[f"{name} error vs decode"] = error
        if error < 1e-2:
            runs[name] = run
        else:
            row[f"{name} us"] = f"wrong: relative error {error:.2e} against PagedDecode"
    # Both caches stay alive through the turns: the unshared one costs batch x (prefix + own) tokens of memory.
    _timed(row, runs, rounds)
    t_unshared = row["decode-unshared us"]
    if isinstance(t_unshared, float):
        all_bytes = batch * (prefix + own) * HKV * D * 2 * 2
        unique = (prefix + batch * own) * HKV * D * 2 * 2
        rate = all_bytes / t_unshared / 1e3  # GB/s
        row.update({"unshared GB/s": rate, "ideal us": unique / rate / 1e3})
    return row


def unshared_case(batch: int, context: int, rounds: int = 1) -> dict:
    gen = torch.Generator(DEVICE).manual_seed(1)
    cache = _cache(batch, 0, context, True, gen)
    q = torch.randn(batch, HQ, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    expected, decode = _decode(cache, q)
    out, run, label, items, kernels = _cascade(cache, q, tilegen.cascade_levels(cache))
    error = relative_error(out.float(), expected.float())[0]
    row = {"batch": batch, "prefix": 0, "own": context, "cascade config": label, "cascade items": items,
           "cascade kernels us": kernels}
    runs = {"decode-unshared": decode}
    if error < 1e-2:
        runs["cascade"] = run
    else:
        row["cascade us"] = f"wrong: {error:.2e}"
    _timed(row, runs, rounds)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(f"{b}x{p}+{o}" for b, p, o in CASES),
                        help="batch x shared prefix + own tokens, comma-separated")
    parser.add_argument("--configs", default="", help="cascade configs to time beside the dispatched one")
    parser.add_argument("--no-unshared", action="store_true", help="skip the batches that share nothing")
    parser.add_argument("--rounds", type=int, default=1, help="time the providers of a case in this many rounds, "
                        "taking turns in a rotating order; each figure the median of its rounds (default 1)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    cases = [re.fullmatch(r"(\d+)x(\d+)\+(\d+)", text) for text in args.cases.split(",")]
    if not all(cases) or any(int(m[1]) < 1 for m in cases):
        parser.error(f"--cases: expected comma-separated BATCHxPREFIX+OWN (whole numbers, a batch of 1 or more, "
                     f"e.g. 64x32768+1024), got {args.cases!r}")
    try:
        configs = [_parse_config(c) for c in args.configs.split(",") if c]
    except (ValueError, TypeError) as e:
        parser.error(f"--configs: expected cascade configs such as M64-N64-w4-s3-c3/N64-w2-s2-c3: {e}")
    require_gpu("tilegen.bench.cascade")
    rows = []
    for m in cases:
        rows.append(case(int(m[1]), int(m[2]), int(m[3]), configs, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
    if not args.no_unshared:
        for batch, context in UNSHARED:
            rows.append(unshared_case(batch, context, args.rounds))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{'case':>18} {'decode shared':>13} {'unshared':>9} {'ideal':>7} {'cascade':>8}  vs ideal")
    for r in rows:
        t, ideal = r.get("cascade us"), r.get("ideal us")
        ratio = f"{t / ideal:.2f}x" if isinstance(t, float) and ideal else ""
        print(f"{r['batch']:>5} x {r['prefix']:>6}+{r['own']:<5} {_shown(r.get('decode-shared us')):>13} "
              f"{_shown(r.get('decode-unshared us')):>9} {_shown(ideal):>7} {_shown(t):>8}  {ratio}")


def _shown(value) -> str:
    """A time rounded to 0.1 us; a failure's text cut to fit; '-' for none."""
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)[:24]


if __name__ == "__main__":
    main()
