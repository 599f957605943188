"""Tuning on several GPUs against a PostgreSQL server: wall time, speedup, same winners, no trial lost.

    python -m tilegen.bench.scaleout --out DIR            # 2 GPUs, then 1, mha-d128-causal, 7 buckets
    python -m tilegen.bench.scaleout --preset mha-d128-causal,mha-d64-causal --out DIR   # two variants, one command
    TRITON_INTERPRET=1 python -m tilegen.bench.scaleout --smoke --out DIR   # CPU, interpreter, tiny sizes
    python -m tilegen.bench.scaleout --bytecode --out DIR   # the packages' bytecode compiled first

Starts PostgreSQL from the ``pgserver`` package in a temporary folder, then runs a full grid
tune (``--sampler grid``) of the preset over buckets 512..32768 with ``--gpus 0,1`` into one
database on it, and the same command as one plain process on GPU 0 into a fresh database.
Each run starts with empty kernel caches (its own ``TRITON_CACHE_DIR`` and
``TILEGEN_CACHE_DIR``), so neither compiles less because the other ran first. One process
imports what a tune imports, and creates a CUDA context, before either run: on a fresh
machine the first import of torch reads its libraries from disk, and without this the
first run would pay that alone.

It reports, and writes to ``DIR/scaleout.json``: both wall times and the speedup; each
bucket's winner in both runs and the ratio of their recorded times; where the winners differ,
both timed again back to back in one process on the first GPU (``retimed_ratio``: the grids
are the same, so the two winners should be within 2% of each other); per bucket, the configs
measured to the end against the grid's size (a lost trial shows as fewer, a doubled one in
``doubled``), and Optuna trials left RUNNING; and where each run's time went, from the tuner's debug log (``phases``): seconds
from the command's start to the first trial, each measuring process's first trial, the
trials' own time and the gaps between them, the buckets whose winner was confirmed (timed
again with its rivals) and the seconds that took, and the seconds from the last result to the
command's exit. ``--bytecode`` first compiles the installed packages' bytecode into a folder
that both runs read (``PYTHONPYCACHEPREFIX``): a machine that sets ``PYTHONDONTWRITEBYTECODE``
and ships torch without bytecode compiles torch's sources in every run's first process, seconds
a usual install does not spend. ``--smoke`` runs two interpreter workers (``--workers 2``) against one, on a d16
spec at size 16; its times say nothing about GPUs, and winners are not compared. With several
presets, buckets are named ``preset/bucket``.
Exit status 1 when a trial was lost or doubled, or (on GPUs) the retimed winners differ by over 2%.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

PRESET = "mha-d128-causal"
SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
SMOKE_SPEC = ["--head-dim", "16"]
SMOKE_SIZES = (16,)
#: One run's limit in seconds per variant: a full tune on one H200 takes about 110 s, two GPUs about 60.
RUN_TIMEOUT_S = 240
WINNER_TOLERANCE = 0.02
#: Alternating rounds in which the two runs' different winners for a bucket are timed back to back.
RETIME_ROUNDS = 5
#: ``tilegen`` with the tuner's debug lines on stderr (its processes pass the level on to theirs).
_LOGGED_CLI = (
    "import logging, sys\n"
    "handler = logging.StreamHandler()\n"
    "handler.setFormatter(logging.Formatter('%(created).3f %(process)d %(name)s: %(message)s'))\n"
    "logger = logging.getLogger('tilegen.tuning')\n"
    "logger.addHandler(handler)\n"
    "logger.setLevel(logging.DEBUG)\n"
    "from tilegen.cli import run\n"
    "sys.argv[0] = 'tilegen'\n"
    "run()\n"
)
_LOG_LINE = re.compile(r"^(\d+\.\d+) (\d+) tilegen\.tuning[.\w]*: (.*)$", re.MULTILINE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Folder for scaleout.json and the runs' logs.")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes: checks the machinery.")
    parser.add_argument("--gpus", default="0,1", help="GPUs of the parallel run (default 0,1); the other uses the first.")
    parser.add_argument("--preset", help=f"Preset(s) both runs tune in one command, comma-separated (default "
                                         f"{PRESET}; with --smoke, a d16 spec).")
    parser.add_argument("--bytecode", action="store_true",
                        help="First compile the installed packages' bytecode into a folder of the benchmark's own "
                             "(PYTHONPYCACHEPREFIX), which both runs then read: what pip install leaves, and a "
                             "machine that sets PYTHONDONTWRITEBYTECODE or ships packages without it lacks.")
    args = parser.parse_args(argv)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        # This process times differing winners again itself, and `import tilegen` has imported Triton.
        parser.error("--smoke runs on the interpreter: TRITON_INTERPRET=1 python -m tilegen.bench.scaleout --smoke ...")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import pgserver  # here: the module is usable without it, to read its doc
    from sqlalchemy.engine import make_url

    folder = Path(tempfile.mkdtemp(prefix="tgbench"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = pgserver.get_server(str(folder / "pg"), cleanup_mode="delete")
    try:
        urls = {}
        for name in ("parallel", "single"):
            server.psql(f"CREATE DATABASE tg_{name};")
            urls[name] = make_url(server.get_uri()).set(drivername="postgresql+psycopg", database=f"tg_{name}")
        if args.smoke:
            spec_args, sizes = (["--preset", args.preset] if args.preset else SMOKE_SPEC), SMOKE_SIZES
            modes = {"parallel": ["--workers", "2"], "single": []}
        else:
            spec_args, sizes = ["--preset", args.preset or PRESET], SIZES
            first = args.gpus.split(",")[0]
            modes = {"parallel": ["--gpus", args.gpus], "single": []}
        variants = len(_specs(spec_args))
        report: dict = {"smoke": args.smoke, "spec": spec_args, "sizes": list(sizes), "sampler": "grid"}
        if args.bytecode:
            report["bytecode_s"] = _bytecode(folder / "pycache")
            print(f"bytecode compiled in {report['bytecode_s']} s", flush=True)
        report["warm_up_s"] = _warm_up()
        print(f"warm-up (imports and a CUDA context, for the OS's file cache): {report['warm_up_s']} s", flush=True)
        for name in ("parallel", "single"):
            env = {**os.environ, "TRITON_CACHE_DIR": str(folder / name / "triton"),
                   "TILEGEN_CACHE_DIR": str(folder / name / "tilegen")}
            env.pop("TILEGEN_TUNE_INJECT", None)
            if name == "single" and not args.smoke:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[int(first)] if visible else first
            url = urls[name].render_as_string(hide_password=False)
            command = [sys.executable, "-c", _LOGGED_CLI, "tune", *spec_args, "--seqlens", ",".join(map(str, sizes)),
                       "--sampler", "grid", "--db", url, *modes[name]]
            shown = urls[name].render_as_string(hide_password=True)
            print(f"{name}: tilegen {' '.join(command[3:]).replace(url, shown)}", flush=True)
            started = time.time()
            start = time.perf_counter()
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S * variants)
            wall = time.perf_counter() - start
            (out / f"scaleout-{name}.log").write_text(run.stdout + run.stderr)
            if run.returncode != 0:
                print(run.stdout + run.stderr, file=sys.stderr)
                raise SystemExit(f"the {name} run failed (exit {run.returncode}); log in {out}/scaleout-{name}.log")
            report[name] = {"wall_s": round(wall, 2), "gpus": modes[name], **_outcome(url, spec_args),
                            "phases": _phases(run.stderr, started, wall)}
            print(f"  {wall:.1f} s", flush=True)
        report["grid_size"] = report["parallel"].pop("grid_size")
        report["single"].pop("grid_size")
        report["speedup"] = round(report["single"]["wall_s"] / report["parallel"]["wall_s"], 3)
        after = [report[n]["phases"].get("after_fork_s") for n in ("parallel", "single")]
        report["speedup_after_fork"] = round(after[1] / after[0], 3) if all(after) else None
        report["winners"] = _winners(report)
        _retime(spec_args, report["winners"])
        report["winners_within_2pct"] = all(abs(w["retimed_ratio"] - 1) <= WINNER_TOLERANCE
                                            for w in report["winners"].values())
    finally:
        server.cleanup()
        shutil.rmtree(folder, ignore_errors=True)

    (out / "scaleout.json").write_text(json.dumps(report, indent=1) + "\n")
    _print(report)
    bad = any(report[n]["trials_lost"] or report[n]["doubled"] or report[n]["running"] for n in ("parallel", "single"))
    if not args.smoke:
        bad |= not report["winners_within_2pct"]
    return 1 if bad else 0


def _bytecode(prefix: Path) -> float:
    """Compile the bytecode of every package a tune imports into ``prefix`` and point this process
    (and so both runs) at it; the seconds that took."""
    import site

    import tilegen

    roots = {Path(p) for p in (*site.getsitepackages(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)) if p}
    roots.add(Path(tilegen.__file__).parent)
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *map(str, sorted(r for r in roots
                                                                                        if r.is_dir()))],
                   check=False, stdout=subprocess.DEVNULL, timeout=RUN_TIMEOUT_S)
    return round(time.perf_counter() - start, 2)


def _warm_up() -> float:
    """Seconds a throwaway process takes to import what a tune imports and start CUDA: it
    leaves the libraries in the OS's file cache for both runs."""
    code = ("import torch, triton, optuna, sqlalchemy, tilegen.cli, tilegen.tuning.tuner\n"
            "if torch.cuda.is_available():\n    torch.cuda.init()\n")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=RUN_TIMEOUT_S)
    return round(time.perf_counter() - start, 2)


def _specs(spec_args: list[str]) -> list:
    from tilegen.cli.spec_args import resolve_specs

    return resolve_specs(spec=None, preset=spec_args[1] if spec_args[0] == "--preset" else None,
                         head_dim=int(spec_args[1]) if spec_args[0] == "--head-dim" else None)


def _bucket_name(spec, bucket: int, several: bool) -> str:
    """How the report names a bucket: the bucket alone for one variant, else ``name/bucket``."""
    return f"{spec.name}/{bucket}" if several else str(bucket)


def _outcome(url: str, spec_args: list[str]) -> dict:
    """What one run left in its database: winners, finished configs per bucket against the grid, stuck trials."""
    import optuna

    from tilegen.db import TuningDB
    from tilegen.device import device_info
    from tilegen.families import family_of

    specs = {spec.hash: spec for spec in _specs(spec_args)}
    device = device_info()
    grids = {h: len(family_of(spec).candidates(spec, device)) for h, spec in specs.items()}
    with TuningDB(url) as db:
        tuned = [r for r in db.list_tuned() if r.spec_hash in specs and r.gpu_key == device.key]
        trials = [t for h in specs for t in db.trials_for(h) if t.gpu_key == device.key]

    def name(row) -> str:
        return _bucket_name(specs[row.spec_hash], row.bucket, len(specs) > 1)

    finished: dict[str, set] = {}
    rows: dict[str, int] = {}
    grid: dict[str, int] = {}
    for trial in trials:
        grid[name(trial)] = grids[trial.spec_hash]
        if trial.status != "infeasible":
            finished.setdefault(name(trial), set()).add(json.dumps(trial.config, sort_keys=True))
            rows[name(trial)] = rows.get(name(trial), 0) + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = optuna.storages.RDBStorage(url)
        running = sum(len(optuna.load_study(study_name=s.study_name, storage=storage).get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))) for s in optuna.get_all_study_summaries(storage))
    grid.update((name(r), grids[r.spec_hash]) for r in tuned)
    buckets = sorted(grid, key=lambda b: (b.rpartition("/")[0], int(b.rpartition("/")[2])))
    return {
        "winners": {name(r): {"config": r.config, "time_ms": r.time_ms} for r in tuned},
        "finished": {b: len(finished.get(b, ())) for b in buckets},
        "grid_size": {b: grid[b] for b in buckets},
        "trials_lost": sum(grid[b] - len(finished.get(b, ())) for b in buckets),
        "doubled": sum(rows.get(b, 0) - len(finished.get(b, ())) for b in buckets),
        "running": running,
    }


def _phases(log: str, started: float, wall: float) -> dict:
    """Where a run's time went, from the tuner's debug lines (wall-clock stamps, any process)."""
    starts: dict[str, list[float]] = {}
    trial_s: list[float] = []
    gaps: list[float] = []
    running: dict[str, float] = {}
    ended: dict[str, float] = {}
    confirming: dict[str, float] = {}
    confirm_s: list[float] = []
    last = 0.0
    forked: float | None = None  # the first process the tune forks (a tune process, or the worker)
    for stamp, pid, message in _LOG_LINE.findall(log):
        at = float(stamp) - started
        if forked is None and re.fullmatch(r"(tune process|worker) \d+ forked.*", message):
            forked = at
        if re.fullmatch(r"bucket \d+: confirming .*", message):
            confirming[pid] = at
        elif re.fullmatch(r"bucket \d+: confirmed .*", message) and pid in confirming:
            confirm_s.append(at - confirming.pop(pid))
        elif re.fullmatch(r"trial \d+: measuring .*", message):
            starts.setdefault(pid, []).append(at)
            if pid in ended:
                gaps.append(at - ended[pid])
            running[pid] = at
        elif re.fullmatch(r"trial \d+: \w+", message) and pid in running:
            trial_s.append(at - running.pop(pid))
            ended[pid] = at
        if re.fullmatch(r"trial \d+: \w+|bucket \d+: confirmed .*", message):
            last = at
    if not starts:
        return {}
    return {
        # The tune's own work, from its first fork to its last result or confirmation: the run's
        # wall time less the command's start-up (imports) and its exit, which both runs pay.
        "after_fork_s": round(last - forked, 2) if forked is not None else None,
        "first_trial_s": round(min(s[0] for s in starts.values()), 2),
        "first_trial_per_process_s": sorted(round(s[0], 2) for s in starts.values()),
        "trials": len(trial_s),
        "trial_median_s": round(statistics.median(trial_s), 3) if trial_s else None,
        "trial_sum_s": round(sum(trial_s), 2),
        "gap_median_s": round(statistics.median(gaps), 3) if gaps else None,
        "after_last_result_s": round(wall - max(ended.values(), default=0.0), 2),
        "confirmed_buckets": len(confirm_s),
        "confirm_sum_s": round(sum(confirm_s), 2),
    }


def _winners(report: dict) -> dict:
    both = {}
    for bucket, parallel in report["parallel"]["winners"].items():
        single = report["single"]["winners"].get(bucket)
        if single is None:
            continue
        both[bucket] = {"parallel": parallel, "single": single,
                        "time_ratio": round(parallel["time_ms"] / single["time_ms"], 4)}
    return both


def _retime(spec_args: list[str], winners: dict) -> None:
    """Where the two runs chose different configs for a bucket, time both in this process (on the
    first GPU, or the interpreter), back to back for ``RETIME_ROUNDS`` alternating rounds, and add
    the medians' ratio (``retimed_ratio``; 1 where the configs agree).

    Their recorded times come from different GPUs at different moments, between which one config's
    time moves by a few percent; the question is whether the two searches found equally fast configs.
    """
    from tilegen.device import device_info
    from tilegen.families import family_of
    from tilegen.tuning.measure import compare

    specs = {spec.name: spec for spec in _specs(spec_args)}
    on_gpu = not device_info().is_interpreter
    for bucket_name, pair in winners.items():
        if pair["parallel"]["config"] == pair["single"]["config"]:
            pair["retimed_ratio"] = 1.0
            continue
        name, _, bucket = bucket_name.rpartition("/")
        spec = specs[name] if name else next(iter(specs.values()))
        family = family_of(spec)
        configs = tuple(family.config_type.from_dict(pair[run]["config"]) for run in ("parallel", "single"))
        parallel, single = compare(family.problem(spec, int(bucket), on_gpu=on_gpu), configs, 0,
                                   RETIME_ROUNDS)["times_ms"]
        pair["retimed_ms"] = {"parallel": round(parallel, 4), "single": round(single, 4)}
        pair["retimed_ratio"] = round(parallel / single, 4)


def _print(report: dict) -> None:
    print(f"\nparallel {report['parallel']['wall_s']} s, single {report['single']['wall_s']} s: "
          f"speedup {report['speedup']}x")
    if report.get("speedup_after_fork"):
        print(f"after the fork: parallel {report['parallel']['phases']['after_fork_s']} s, single "
              f"{report['single']['phases']['after_fork_s']} s: speedup {report['speedup_after_fork']}x")
    width = max([7, *map(len, report["grid_size"])])
    print(f"{'bucket':>{width}} {'grid':>5} {'done 2':>7} {'done 1':>7} {'ms 2':>9} {'ms 1':>9} {'ratio':>7} {'same':>5} "
          f"{'retimed':>8}")
    for bucket, size in report["grid_size"].items():
        winner = report["winners"].get(bucket, {})
        same = winner.get("parallel", {}).get("config") == winner.get("single", {}).get("config", ())
        print(f"{bucket:>{width}} {size:>5} {report['parallel']['finished'].get(bucket, 0):>7} "
              f"{report['single']['finished'].get(bucket, 0):>7} "
              f"{winner.get('parallel', {}).get('time_ms', float('nan')):>9.4f} "
              f"{winner.get('single', {}).get('time_ms', float('nan')):>9.4f} {winner.get('time_ratio', float('nan')):>7.4f} "
              f"{'yes' if same else 'no':>5} {winner.get('retimed_ratio', float('nan')):>8.4f}")
    for name in ("parallel", "single"):
        r = report[name]
        print(f"{name}: {r['trials_lost']} trials lost, {r['doubled']} doubled, {r['running']} left RUNNING")
    for name in ("parallel", "single"):
        p = report[name].get("phases")
        if p:
            print(f"{name}: first trial at {', '.join(f'{s:.1f}' for s in p['first_trial_per_process_s'])} s; "
                  f"{p['trials']} trials, {p['trial_sum_s']:.1f} s measuring (median {p['trial_median_s']} s, "
                  f"{p['gap_median_s']} s between); {p['confirmed_buckets']} buckets confirmed in "
                  f"{p['confirm_sum_s']:.1f} s; exit {p['after_last_result_s']:.1f} s after the last result")
    print(f"winners within 2%: {report['winners_within_2pct']}")


if __name__ == "__main__":
    sys.exit(main())
