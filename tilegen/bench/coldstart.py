"""Cold start: how long the first ``tilegen.attention`` call of a fresh process takes, and where it goes.

    python -m tilegen.bench.coldstart                 # 5 fresh processes with warm caches, 1 with empty ones
    python -m tilegen.bench.coldstart --runs 10 --json
    python -m tilegen.bench.coldstart --ops attention,varlen,decode   # the serving calls' first calls too

Each run is a new Python process. It times ``import tilegen``, then the parts of a first
call one by one (importing the row reader, reading the rows from the user's and the
shipped database, rendering and importing the generated module, the first launch: Triton's
compile or cache load plus the launcher), then a second call. A separate "as users call
it" process times import plus first call with nothing split out. For comparison it also
times the SQLAlchemy path that dispatch no longer takes (importing the store, opening
the shipped file read-only, one query).

"Warm" runs share one tilegen cache folder and one Triton cache folder, filled by a run
before them; "cold" runs get empty ones. On a GPU the call is bf16 causal d128 at 4096
tokens (the shipped ``mha-d128-causal`` preset, so an H200 reads shipped rows); without
one, TRITON_INTERPRET=1 and a small fp32 call on the CPU, where "compile" is the
interpreter's set-up and the figures say little about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

__all__ = ["main"]

_CHILD = textwrap.dedent(
    r"""
    import json, os, sys, time
    t0 = time.perf_counter()
    split = sys.argv[1] == "split"
    import torch
    t_torch = time.perf_counter()
    import tilegen
    t_import = time.perf_counter()
    op = sys.argv[2]
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    n, d = (4096, 128) if gpu else (64, 32)
    q, k, v = (torch.randn(1, 16 if gpu else 2, n, d, device=device, dtype=dtype) for _ in range(3))
    call = lambda: tilegen.attention(q, k, v, causal=True)
    if op == "varlen":  # 8 sequences of 512 tokens, GQA 32/8 (the shipped varlen-llama rows on an H200)
        lens = [512] * 8 if gpu else [40, 24]
        heads = (32, 8) if gpu else (4, 2)
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=device)
        qr = torch.randn(sum(lens), heads[0], d, device=device, dtype=dtype)
        kr, vr = (torch.randn(sum(lens), heads[1], d, device=device, dtype=dtype) for _ in "kv")
        call = lambda: tilegen.varlen_attention(qr, kr, vr, cu, cu, max(lens), max(lens), causal=True)
    elif op == "decode":  # a step of 64 x 4096 in pages of 16, 32/8 heads: planned and run, as each step is
        batch, context, page = (64, 4096, 16) if gpu else (2, 40, 16)
        heads = (32, 8) if gpu else (4, 2)
        per = -(-context // page)
        pages = [torch.randn(batch * per, page, heads[1], d, device=device, dtype=dtype) for _ in "kv"]
        cache = tilegen.PagedKVCache(
            *pages, torch.arange(batch + 1, dtype=torch.int32, device=device) * per,
            torch.randperm(batch * per, device=device).to(torch.int32),
            torch.full((batch,), context - (per - 1) * page, dtype=torch.int32, device=device))
        qd = torch.randn(batch, heads[0], d, device=device, dtype=dtype)
        decode = tilegen.PagedDecode()
        call = lambda: (decode.plan(cache, heads_q=heads[0], max_seqlen_k=context), decode.run(qd, cache))
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    parts = {"import torch": t_torch - t0, "import tilegen": t_import - t_torch}
    if split:
        from tilegen.device import device_info
        from tilegen.key import TuningKey
        from tilegen.ops.attention import prepare_call
        spec = prepare_call(q, k, v, True, None, None, None, False)[0]
        key = TuningKey.current(spec, device_info())
        t = time.perf_counter()
        from tilegen.db.lookup import tuned_rows
        parts["import row reader"] = time.perf_counter() - t
        t = time.perf_counter()
        rows = tuned_rows(**key.variant_fields())
        parts["read rows"] = time.perf_counter() - t
        t = time.perf_counter()
        from tilegen.codegen import module_for
        module_for(spec)
        parts["generated module"] = time.perf_counter() - t
        parts["tuned buckets"] = len(rows)
    t = time.perf_counter()
    call()
    sync()
    parts["first call" if not split else "first call, rest"] = time.perf_counter() - t
    t = time.perf_counter()
    call()
    sync()
    parts["second call"] = time.perf_counter() - t
    if split:
        from tilegen import env
        t = time.perf_counter()
        from tilegen.db.store import TuningDB
        parts["(old path) import SQLAlchemy store"] = time.perf_counter() - t
        t = time.perf_counter()
        if env.shipped_db_path().exists():
            with TuningDB(env.shipped_db_path(), readonly=True) as db:
                db.best(**key.variant_fields())
        parts["(old path) open + query shipped"] = time.perf_counter() - t
    print(json.dumps(parts))
    """
)


def _run(mode: str, cache: Path, triton_cache: Path, interpret: bool, op: str = "attention") -> dict[str, float]:
    environment = dict(os.environ, TILEGEN_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(triton_cache))
    if interpret:
        environment["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", _CHILD, mode, op], env=environment, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"error: the benchmark process failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per kind of run (default 5)")
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    parser.add_argument("--ops", default="attention",
                        help="comma-separated calls to time first: attention (split into its parts too), varlen "
                             "(varlen_attention, 8 x 512 tokens, 32/8 heads), decode (PagedDecode.plan and run, "
                             "64 x 4096 in pages of 16); default attention")
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    if not ops or any(op not in ("attention", "varlen", "decode") for op in ops):
        parser.error(f"--ops: expected names among attention, varlen, decode; got {args.ops!r}")
    if args.runs < 1:
        parser.error(f"--runs: expected a positive integer, got {args.runs}")

    import torch

    interpret = not torch.cuda.is_available()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tilegen-coldstart-") as tmp:
        root = Path(tmp)
        for op in ops:
            # Only tilegen.attention's first call is split into its parts; the others are timed whole.
            mode = "split" if op == "attention" else "plain"
            where = root / op
            cold = [_run(mode, where / f"cold{i}" / "tilegen", where / f"cold{i}" / "triton", interpret, op)
                    for i in range(max(1, args.runs // 5))]
            warm_cache, warm_triton = where / "warm" / "tilegen", where / "warm" / "triton"
            _run(mode, warm_cache, warm_triton, interpret, op)  # fills the caches
            runs = [_run(mode, warm_cache, warm_triton, interpret, op) for _ in range(args.runs)]
            name = "" if op == "attention" else f"{op}: "
            results[f"{name}empty caches{', split' if mode == 'split' else ''}"] = _median(cold)
            results[f"{name}warm caches{', split' if mode == 'split' else ''}"] = _median(runs)
            if mode == "split":
                plain = [_run("plain", warm_cache, warm_triton, interpret, op) for _ in range(args.runs)]
                results[f"{name}warm caches, as users call it"] = _median(plain)

    if args.json:
        print(json.dumps(results, indent=1))
        return
    where = "CPU, Triton interpreter" if interpret else torch.cuda.get_device_name()
    print(f"first call of a fresh process on {where}; medians of {args.runs} processes (seconds)")
    for title, parts in results.items():
        print(f"\n{title}")
        for name, value in parts.items():
            print(f"  {name:40s} {value:9.4f}" if name != "tuned buckets" else f"  {name:40s} {value:9.0f}")


if __name__ == "__main__":
    main()
