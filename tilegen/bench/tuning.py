"""Tuning benchmark: TPE against an exhaustive grid, a full tune's wall time, dispatch overhead,
and Triton's own ``@triton.autotune`` over the same configs.

    python -m tilegen.bench.tuning                            # every part
    python -m tilegen.bench.tuning --parts grid-vs-tpe,replay --tpe-seeds 0,1
    python -m tilegen.bench.tuning --parts dispatch,autotune

The parts: grid-vs-tpe (per length, an exhaustive grid, then TPE bare, cold and warm: how
many trials it needs to come within 3% of the grid's best), replay (TPE run many times
against that grid's recorded timings, on the machine that measured it), full-tune (``tilegen tune``'s
defaults over 7 length buckets, into a fresh database), dispatch (host time per call of
``tilegen.attention`` against the generated launcher with the same config) and autotune
(Triton's autotuner over our feasible configs: its choice and time against our grid's).

Targets on the H200 (dense forward, head dim 128, causal, bf16 by default): TPE within 3%
of the grid's best in at most 25% of the grid's trials; a 7-bucket tune in at most
10 minutes; ``tilegen.attention`` at most 5 us per call above the direct launch. On the
H200 grid-vs-tpe with two seeds takes about 5 minutes and each other part 1 to 3, so split
them across commands of 10 minutes; ``--bucket-timeout`` caps each tuned bucket. Tunes
write to fresh databases under ``--workdir`` (a new temporary folder by default), never
the user's. Prints a markdown table per part and writes ``bench_tuning.json`` under
``$OUT`` when it is set.

Under ``TRITON_INTERPRET=1`` (no GPU) it runs at the interpreter's tiny lengths to check
the script itself; its numbers mean nothing then, and the autotune part is skipped.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna
import torch
import triton

import tilegen
from tilegen.bench import whole_numbers
from tilegen.cli.spec_args import presets
from tilegen.codegen import module_for
from tilegen.db import TuningDB
from tilegen.device import device_info
from tilegen.dispatch import launcher_for
from tilegen.env import interpreting
from tilegen.families import family_of
from tilegen.ops.attention import prepare_call, run_with_config
from tilegen.tuning import Reporter, Tuner
from tilegen.tuning.measure import time_ms

__all__ = ["main"]

PARTS = ("grid-vs-tpe", "replay", "full-tune", "dispatch", "autotune")
#: TPE has found the grid's best when its best is within this factor of it (timing noise is ~1%).
WITHIN = 1.03


class _Recorder(Reporter):
    """Keeps every measured result per bucket, in order (infeasible proposals cost nothing: left out)."""

    def __init__(self):
        self.results = collections.defaultdict(list)

    def trial(self, key, result, best) -> None:
        if result.status != "infeasible":
            self.results[key.bucket].append(result)


def grid_vs_tpe(spec, device, seqlens, seeds, tpe_trials, workdir: Path, bucket_timeout) -> list[dict]:
    """For each length: the grid's best, then how many trials TPE needs to come within 3% of it.

    TPE runs three ways per seed: "bare", one database per length and no warm start, which
    measures the sampler alone; "cold", one database per length, seeded only by the heuristic
    default for the length; and "warm", the lengths tuned in ascending order into one database,
    as ``tilegen tune`` does, so each also starts from the best configs of the lengths before it.
    The grid's trials stay in ``workdir/grid.sqlite`` for the replay part.
    """
    grid_size = len(family_of(spec).candidates(spec, device))
    trials = tpe_trials or math.ceil(grid_size / 2)
    grid = _tune_lengths(spec, device, seqlens, workdir / "grid.sqlite", sampler="grid", timeout=bucket_timeout)
    rows = []

    def report(start, seed, n, run):
        tpe, measured, _ = run
        exhaustive, _, grid_wall = grid[n]
        if exhaustive.best is None:
            rows.append({"seqlen": n, "grid_configs": grid_size, "error": "no correct config in the grid"})
        else:
            needed = _trials_to_reach(measured, exhaustive.best.time_ms * WITHIN)
            rows.append({
                "seqlen": n, "start": start, "seed": seed, "grid_configs": grid_size,
                "grid_best": str(exhaustive.best.config), "grid_ms": exhaustive.best.time_ms,
                "grid_tflops": exhaustive.tflops, "grid_wall_s": grid_wall, "tpe_trials": len(measured),
                "tpe_best": str(tpe.best.config) if tpe.best else None,
                "tpe_ms": tpe.best.time_ms if tpe.best else None,
                "trials_to_3pct": needed, "fraction_of_grid": needed / grid_size if needed else None,
            })
        print(json.dumps(rows[-1]), flush=True)  # a run cut short by a timeout keeps the rows before it

    for seed in seeds:
        for n in seqlens:
            for start, warm_start in (("bare", False), ("cold", True)):
                run = _tune_lengths(spec, device, [n], workdir / f"tpe-{start}-n{n}-seed{seed}.sqlite",
                                    trials=trials, seed=seed, timeout=bucket_timeout, warm_start=warm_start)
                report(start, seed, n, run[n])
        warm = _tune_lengths(spec, device, seqlens, workdir / f"tpe-warm-seed{seed}.sqlite",
                             trials=trials, seed=seed, timeout=bucket_timeout)
        for n in seqlens:
            report("warm", seed, n, warm[n])
    return rows


class _Replay:
    """A worker that answers from a measured grid (with 1% noise) instead of running kernels."""

    def __init__(self, times: dict[str, float], seed: int):
        self.times = times
        self.rng = random.Random(seed)

    def measure(self, task, timeout) -> dict:
        config = task[2].to_json()  # (family, problem, config, seed)
        if config not in self.times:
            return {"status": "compile_error", "time_ms": None, "max_error": None, "reason": "not in the grid"}
        return {"status": "ok", "time_ms": self.times[config] * (1 + self.rng.gauss(0, 0.01)),
                "max_error": 0.0, "reason": None}

    def close(self) -> None:
        pass


def replay(spec, device, grid_db: Path, seeds: int, tpe_trials, workdir: Path) -> list[dict]:
    """TPE replayed many times against one measured grid: no kernel runs, so seeds are cheap.

    ``grid_db`` is a database holding a grid of ``spec`` (``grid.sqlite`` of grid-vs-tpe, or a
    ``tilegen tune --sampler grid`` database). Each seed tunes each grid length in a fresh
    database, bare and cold, as grid-vs-tpe does, with every measurement answered from the grid.
    """
    with TuningDB(grid_db, readonly=True) as db:
        trials_by_bucket = collections.defaultdict(dict)
        for row in db.trials_for(spec.hash):
            if row.status == "ok" and row.gpu_key == device.key:
                config = family_of(spec).config_type.from_dict(row.config)
                trials_by_bucket[row.bucket][config.to_json()] = row.time_ms
    if not trials_by_bucket:
        # The search space depends on the device's limits: replay where the grid was measured.
        raise SystemExit(f"replay: {grid_db} holds no measured trials of {spec.name} on {device.key}")
    workdir.mkdir(parents=True, exist_ok=True)
    grid_size = len(family_of(spec).candidates(spec, device))
    trials = tpe_trials or math.ceil(grid_size / 2)
    rows = []
    for n, times in sorted(trials_by_bucket.items()):
        if len(times) < grid_size:
            continue  # not a full grid
        best = min(times.values())
        for start, warm_start in (("bare", False), ("cold", True)):
            needed = []
            for seed in range(seeds):
                recorder = _Recorder()
                with TuningDB(workdir / f"replay-{start}-n{n}-seed{seed}.sqlite") as db, \
                        Tuner(db, device, trials=trials, seed=seed, reporter=recorder, warm_start=warm_start) as tuner:
                    tuner._worker.close()
                    tuner._worker = _Replay(times, seed)
                    tuner.tune(spec, n)
                found = next((i for i, r in enumerate(recorder.results[n], 1) if times[r.config.to_json()] <= best * WITHIN),
                             None)
                needed.append(found if found is not None else math.inf)
            within = sum(x <= grid_size / 4 for x in needed)
            rows.append({"seqlen": n, "start": start, "seeds": seeds, "grid_configs": grid_size,
                         "median_trials": _finite(statistics.median(needed)), "within_25pct": within,
                         "never": sum(x == math.inf for x in needed)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x  # JSON has no infinity


def _tune_lengths(spec, device, seqlens, db_path: Path, **settings) -> dict[int, tuple]:
    """Tune each length in order into one database: ``{n: (BucketResult, measured results, wall s)}``."""
    recorder = _Recorder()
    out = {}
    with TuningDB(db_path) as db, Tuner(db, device, reporter=recorder, **settings) as tuner:
        for n in seqlens:
            start = time.perf_counter()
            result = tuner.tune(spec, n)
            out[n] = (result, recorder.results[n], time.perf_counter() - start)
    return out


def _trials_to_reach(results, target_ms: float) -> int | None:
    for i, result in enumerate(results, 1):
        if result.status == "ok" and result.time_ms <= target_ms:
            return i
    return None


def full_tune(spec, device, seqlens, trials, workdir: Path, bucket_timeout) -> list[dict]:
    """Wall time of ``tilegen tune`` over every bucket, into a fresh database (as a first tune on a machine is)."""
    tuned = _tune_lengths(spec, device, seqlens, workdir / "full.sqlite", trials=trials, timeout=bucket_timeout)
    rows, total = [], 0.0
    for n, (result, measured, wall) in tuned.items():
        total += wall
        rows.append({
            "seqlen": n, "best": str(result.best.config) if result.best else None,
            "ms": result.best.time_ms if result.best else None, "tflops": result.tflops,
            "measured": len(measured), "wall_s": wall, "total_wall_s": total,
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def dispatch_overhead(spec, device, calls: int, repeats: int) -> dict:
    """Host time per call of ``tilegen.attention`` and of the generated launcher with the same config.

    The shapes are tiny so that launching, not the kernel, bounds a back-to-back loop. Two
    pairs: the op given ``out=`` against the launcher into a preallocated output (dispatch
    alone), and the op allocating its output against the launcher allocating one per call.
    """
    on_gpu = not device.is_interpreter
    problem = family_of(spec).problem(spec, 128 if on_gpu else 16, on_gpu=on_gpu, batch=1, heads_q=spec.q_per_kv)
    q, k, v = problem.inputs(seed=0)
    kwargs = _op_kwargs(problem)
    config = tilegen.explain(q, k, v, **kwargs).config
    call_spec, left, right, scale, softcap = prepare_call(q, k, v, scale=None, **kwargs)
    launch = launcher_for(call_spec).jit  # through the JIT, with the compile options every launch passes
    out = torch.empty((*q.shape[:3], call_spec.dv), device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if call_spec.return_lse else out
    launch_args = {"scale": scale, "softcap": softcap, "window_left": left, "window_right": right,
                   **config.to_dict()}

    def direct():
        launch(q, k, v, out, lse, **launch_args)

    def direct_alloc():
        fresh = torch.empty_like(out)
        launch(q, k, v, fresh, lse if call_spec.return_lse else fresh, **launch_args)

    def op_out():
        tilegen.attention(q, k, v, out=out, **kwargs)

    def op():
        tilegen.attention(q, k, v, **kwargs)

    def per_call_us(fn) -> float:
        _sync(problem.on_gpu)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(problem.on_gpu)
        return (time.perf_counter() - start) / calls * 1e6

    variants = {"direct": direct, "op_out": op_out, "direct_alloc": direct_alloc, "op": op}
    for fn in variants.values():
        for _ in range(min(calls, 50)):
            fn()  # compile and warm every cache first
    # Interleaved rounds, each variant's fastest: the host's noise (other processes, clock
    # changes) only ever adds time, and it drifts between rounds by more than dispatch costs.
    rounds = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            rounds[name].append(per_call_us(fn))
    us = {name: min(values) for name, values in rounds.items()}
    row = {"config": str(config), "calls": calls, "launch_us": us["direct"], "attention_out_us": us["op_out"],
           "launch_alloc_us": us["direct_alloc"], "attention_us": us["op"],
           "dispatch_out_us": us["op_out"] - us["direct"], "dispatch_us": us["op"] - us["direct_alloc"],
           "overhead_us": us["op"] - us["direct"]}
    print(json.dumps(row), flush=True)
    return row


def _op_kwargs(problem) -> dict:
    """The ``tilegen.attention`` arguments that select the problem's spec at its length."""
    spec = problem.spec
    return {"causal": spec.mask == "causal", "window": problem.bounds if spec.mask == "window" else None,
            "softcap": problem.softcap, "return_lse": spec.return_lse}


def _sync(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


def triton_autotune(spec, device, seqlens, workdir: Path, bucket_timeout) -> list[dict]:
    """Triton's ``@triton.autotune`` over our feasible configs, against our grid's choice, timed alike."""
    configs = family_of(spec).candidates(spec, device)
    kernel = getattr(module_for(spec), f"_{spec.name}_kernel")
    rows = []
    # The grid database of grid-vs-tpe when that part ran first: the study is then finished and instant.
    with TuningDB(workdir / "grid.sqlite") as db, Tuner(db, device, sampler="grid", timeout=bucket_timeout) as tuner:
        for n in seqlens:
            start = time.perf_counter()
            ours = tuner.tune(spec, n)
            ours_wall = time.perf_counter() - start
            problem = family_of(spec).problem(spec, n, on_gpu=True)
            q, k, v = problem.inputs(seed=0)
            call_spec, left, right, scale, softcap = prepare_call(q, k, v, scale=None, **_op_kwargs(problem))
            autotuned = _autotuned(kernel, configs, left, right, scale, softcap)
            start = time.perf_counter()
            autotuned(q, k, v)  # the first call tunes
            torch.cuda.synchronize()
            theirs_wall = time.perf_counter() - start
            row = {"seqlen": n, "triton_config": str(autotuned.best_config()), "triton_tune_s": theirs_wall,
                   "triton_ms": time_ms(lambda: autotuned(q, k, v), True)}
            if ours.best is not None:
                row.update(ours_config=str(ours.best.config), ours_tune_s=ours_wall, ours_ms=time_ms(
                    lambda: run_with_config(call_spec, ours.best.config, q, k, v, scale, softcap, left, right), True))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _autotuned(kernel, configs, left, right, scale, softcap):
    """Wrap the generated kernel in ``triton.autotune``; the call mirrors the template's ``launch``."""
    log2e = 1.4426950408889634
    tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in configs
        ],
        key=["n_q", "n_k"],
    )(kernel)
    qk_scale, softcap_scale = (2.0 * scale / softcap, softcap * log2e) if softcap else (scale * log2e, 1.0)

    def run(q, k, v):
        batch, heads, n_q, _ = q.shape
        n_k = k.shape[2]
        out = torch.empty((batch, heads, n_q, v.shape[3]), device=q.device, dtype=q.dtype)
        tuned[lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), batch * heads)](
            q, k, v, out, out,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            heads, n_q, n_k, n_k - n_q, left, right, qk_scale, softcap_scale,
        )
        return out

    run.best_config = lambda: _config_name(tuned.best_config)
    return run


def _config_name(config: triton.Config) -> str:
    return f"BM{config.kwargs['BLOCK_M']}-BN{config.kwargs['BLOCK_N']}-w{config.num_warps}-s{config.num_stages}"


def _tables(results: dict) -> str:
    out = []
    if "grid-vs-tpe" in results:
        out += ["| N | grid configs | grid best | grid ms | grid TFLOP/s | TPE start | seed | TPE trials to within 3% "
                "| % of grid (target <= 25) | TPE best |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(results["grid-vs-tpe"], key=lambda r: (r["seqlen"], r.get("start", ""), r.get("seed", 0))):
            if "error" in r:
                out.append(f"| {r['seqlen']} | {r['grid_configs']} | {r['error']} | | | | | | | |")
                continue
            needed = r["trials_to_3pct"]
            reached = (str(needed), f"{100 * r['fraction_of_grid']:.0f}%") if needed else (f"> {r['tpe_trials']}", "-")
            out.append(
                f"| {r['seqlen']} | {r['grid_configs']} | {r['grid_best']} | {r['grid_ms']:.4g} "
                f"| {r['grid_tflops']:.4g} "
                f"| {r['start']} | {r['seed']} | {reached[0]} | {reached[1]} | {r['tpe_best']} |"
            )
        out.append("")
    if "replay" in results:
        out += ["| N | TPE start | seeds | median trials to within 3% | runs within 25% of the grid | runs never within |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['seqlen']} | {r['start']} | {r['seeds']} | {r['median_trials'] or 'never'} "
                f"| {r['within_25pct']}/{r['seeds']} | {r['never']} |" for r in results["replay"]]
        out.append("")
    if "full-tune" in results:
        rows = results["full-tune"]
        out += ["| N | best | ms | TFLOP/s | configs measured | wall s |", "|---|---|---|---|---|---|"]
        out += [f"| {r['seqlen']} | {r['best']} | {r['ms'] or float('nan'):.4g} | {r['tflops'] or float('nan'):.4g} "
                f"| {r['measured']} | {r['wall_s']:.0f} |" for r in rows]
        if rows:
            out.append(f"\nfull tune over {len(rows)} buckets: {rows[-1]['total_wall_s'] / 60:.1f} min (target <= 10)")
        out.append("")
    if "dispatch" in results:
        r = results["dispatch"]
        out += ["| output | direct launch us/call | tilegen.attention us/call | dispatch overhead (target <= 5) |",
                "|---|---|---|---|",
                f"| preallocated (`out=`) | {r['launch_us']:.2f} | {r['attention_out_us']:.2f} "
                f"| {r['dispatch_out_us']:.2f} |",
                f"| allocated per call | {r['launch_alloc_us']:.2f} | {r['attention_us']:.2f} | {r['dispatch_us']:.2f} |",
                f"\nconfig {r['config']}; the op allocating against the launcher into a preallocated output: "
                f"{r['overhead_us']:.2f} us", ""]
    if "autotune" in results:
        out += ["| N | triton.autotune config | ms | tune s | tilegen config | ms | tune s |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['seqlen']} | {r['triton_config']} | {r['triton_ms']:.4g} | {r['triton_tune_s']:.1f} "
                f"| {r.get('ours_config', '-')} | {r.get('ours_ms', math.nan):.4g} "
                f"| {r.get('ours_tune_s', math.nan):.1f} |" for r in results["autotune"]]
    return "\n".join(out)


def _ints(parser: argparse.ArgumentParser, flag: str, text: str, least: int = 1) -> list[int]:
    values = whole_numbers(text, least, skip_empty=True)
    if values is None:
        parser.error(f"{flag}: expected comma-separated whole numbers of at least {least}, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--preset", default="mha-d128-causal", choices=list(presets()), help="the variant to tune")
    parser.add_argument("--seqlens", default="1024,4096,16384", help="lengths of grid-vs-tpe and autotune")
    parser.add_argument("--tpe-seeds", default="0", help="TPE seeds per length (comma list)")
    parser.add_argument("--tpe-trials", type=int, default=None, help="TPE trials per run (default: half the grid)")
    parser.add_argument("--full-seqlens", default="512,1024,2048,4096,8192,16384,32768", help="buckets of full-tune")
    parser.add_argument("--full-trials", type=int, default=30, help="trials per bucket of full-tune (tune's default)")
    parser.add_argument("--bucket-timeout", type=float, default=None, help="seconds per tuned bucket")
    parser.add_argument("--calls", type=int, default=1000, help="back-to-back calls per dispatch sample")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved samples per dispatch variant")
    parser.add_argument("--replay-grid", type=Path, default=None,
                        help="replay: a database holding a grid (default: grid-vs-tpe's grid.sqlite in --workdir)")
    parser.add_argument("--replay-seeds", type=int, default=20, help="replay: TPE runs per length and start")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the tuning databases go (default: a new temporary folder)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown part {unknown[0]!r}; known: {', '.join(PARTS)}")
    # Checked before any part runs: a part's minutes of tuning would otherwise end in a traceback.
    seqlens, full_seqlens = _ints(parser, "--seqlens", args.seqlens), _ints(parser, "--full-seqlens", args.full_seqlens)
    tpe_seeds = _ints(parser, "--tpe-seeds", args.tpe_seeds, least=0)
    for flag, value in (("--tpe-trials", args.tpe_trials), ("--full-trials", args.full_trials),
                        ("--calls", args.calls), ("--rounds", args.rounds)):
        if value is not None and value < 1:
            parser.error(f"{flag}: expected a positive number, got {value}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    if not torch.cuda.is_available() and not interpreting():
        # Triton reads it when imported, which ``python -m`` has done before this line runs.
        print("tilegen.bench.tuning needs a CUDA GPU, or TRITON_INTERPRET=1 to check the script", file=sys.stderr)
        return 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the per-part rows say what its INFO lines would
    device = device_info()
    spec = presets()[args.preset]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tilegen-bench-tuning-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ["TILEGEN_DB"] = str(workdir / "grid.sqlite")  # dispatch reads the grid's rows, not the user's
    if device.is_interpreter:
        print("# no GPU: interpreter lengths and wall-clock timing; these numbers only check the script")
        seqlens, full_seqlens = [16, 32], [16, 32]
    print(f"# {device.name}, torch {torch.__version__}, triton {triton.__version__}, tilegen {tilegen.__version__}, "
          f"{spec.name}, databases in {workdir}", flush=True)

    results: dict = {}
    if "grid-vs-tpe" in parts:
        results["grid-vs-tpe"] = grid_vs_tpe(spec, device, seqlens, tpe_seeds, args.tpe_trials, workdir,
                                             args.bucket_timeout)
    if "replay" in parts:
        grid_db = args.replay_grid or workdir / "grid.sqlite"
        if not grid_db.is_file():
            parser.error(f"--replay-grid: {grid_db} does not exist; run grid-vs-tpe first or name a grid database")
        results["replay"] = replay(spec, device, grid_db, args.replay_seeds, args.tpe_trials, workdir / "replay")
    if "full-tune" in parts:
        results["full-tune"] = full_tune(spec, device, full_seqlens, args.full_trials, workdir, args.bucket_timeout)
    if "dispatch" in parts:
        results["dispatch"] = dispatch_overhead(spec, device, args.calls if not device.is_interpreter else 3,
                                                repeats=args.rounds if not device.is_interpreter else 2)
    if "autotune" in parts:
        if device.is_interpreter:
            print("# autotune: skipped, triton.autotune times kernels on a GPU", file=sys.stderr)
        else:
            results["autotune"] = triton_autotune(spec, device, seqlens, workdir, args.bucket_timeout)
    if out_dir:
        with open(os.path.join(out_dir, "bench_tuning.json"), "w") as f:
            json.dump({"device": device.key, "spec": spec.to_json(), "results": results}, f, indent=1)
    print(_tables(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
