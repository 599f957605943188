"""Attention-forward benchmark: tilegen against SDPA (flash, cuDNN) and FlexAttention, in one run.

    python -m tilegen.bench.attention                    # the BENCHMARKS.md table (or: tilegen bench attention)
    python -m tilegen.bench.attention --plot attention.png   # and TFLOP/s against length, per variant
    python -m tilegen.bench.attention --sweep            # also time every feasible config
    python -m tilegen.bench.attention --rounds 3         # each figure the median of 3 alternating rounds
    python -m tilegen.bench.attention --head-dims 256 --kv-heads 16 --softcap 50 --providers tilegen,flex
                                                         # Gemma 2's softcap (SDPA has none)
    python -m tilegen.bench.attention --seqlens 1024,2048,4096,8192,16384,32768 --kv-heads 32,8 \
        --dtypes bf16,fp16 --providers tilegen,sdpa-cudnn   # the whole grid against cuDNN
    python -m tilegen.bench.attention --window 4096 --kv-heads 8 --providers tilegen,flex
                                                         # Mistral's sliding window (SDPA has none)

``tilegen`` is the op as users call it (tuned rows of the user's and the shipped database,
else the heuristic default); ``tilegen-default`` runs the heuristic default for the length
alone. Every provider is checked against SDPA's flash output (relative error) before
it is timed; timings are ``triton.testing.do_bench`` medians. FLOPs are the family's own
count (the tuner's too): 2 per multiply-add of QK^T and PV over the pairs the mask lets
through, which for causal is within 1/N of the usual 4*B*H*N*N*D/2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

import tilegen
from tilegen import dispatch
from tilegen.bench import parse_head_dims, pyplot, require_gpu, take_turns, whole_numbers
from tilegen.device import device_info
from tilegen.families import family_of
from tilegen.families.attention_fwd.problem import attention_flops
from tilegen.ops.attention import prepare_call, run_with_config

__all__ = ["main", "peers", "plot"]

TOKENS = 16384
HEADS = 32
PROVIDERS = ("tilegen", "tilegen-default", "sdpa-flash", "sdpa-cudnn", "flex")


@dataclass(frozen=True)
class Case:
    seqlen: int
    head_dim: int
    causal: bool
    heads_kv: int = HEADS
    dtype: str = "bf16"
    head_dim_v: int | None = None  # None: the head dim
    softcap: float | None = None  # Gemma 2's tanh softcap on the scores; SDPA has none
    window: int | None = None  # a sliding window: each query sees itself and this many keys before it (not causal)

    @property
    def bounds(self) -> tuple[int | None, int | None] | None:
        """The op's ``window`` argument: the sliding window's, or none (the case's ``causal`` says the rest)."""
        return None if self.window is None else (self.window, 0)

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    def flops(self, spec) -> float:
        if self.window is not None:
            return attention_flops(spec, self.batch, HEADS, self.seqlen, self.seqlen, self.window, 0)
        problem = family_of(spec).problem(spec, self.seqlen, on_gpu=True, batch=self.batch, heads_q=HEADS)
        return problem.flops()

    @property
    def variant(self) -> str:
        """The case without its length: one line of the plot."""
        gqa = f" gqa{HEADS // self.heads_kv}" if self.heads_kv != HEADS else ""
        dtype = "" if self.dtype == "bf16" else f" {self.dtype}"
        dims = f"{self.head_dim}" if self.head_dim_v is None else f"{self.head_dim}v{self.head_dim_v}"
        cap = "" if self.softcap is None else f" softcap {self.softcap:g}"
        mask = f"window {self.window}" if self.window is not None else "causal" if self.causal else "full"
        return f"d={dims} {mask}{gqa}{cap}{dtype}"

    def __str__(self) -> str:
        return f"N={self.seqlen} {self.variant}"


def _inputs(case: Case, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape_q = (case.batch, HEADS, case.seqlen, case.head_dim)
    shape_kv = (case.batch, case.heads_kv, case.seqlen, case.head_dim)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    q = torch.randn(shape_q, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(shape_kv[:3] + (case.dv, ), device="cuda", dtype=dtype, generator=g)
    return q, k, v


def peers(causal: bool, gqa: bool, seqlen: int, softcap: float | None = None, window: int | None = None) -> dict:
    """SDPA's flash and cuDNN backends and compiled FlexAttention, each ``fn(q, k, v)`` as users call it
    (the backward benchmark differentiates through the same calls). Flex's causal block mask is made
    at its first call, so a machine without flex fails that call, not this one. With a ``softcap`` Flex
    takes it as a score mod, and SDPA, which has none, raises at its call; so with a sliding ``window`` (each query
    sees itself and ``window`` keys before it), which Flex takes as its block mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def sdpa(backend):
        def run(q, k, v):
            if softcap is not None or window is not None:
                raise NotImplementedError("SDPA has no softcap" if window is None else "SDPA has no window")
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return run

    # Each case compiles flex afresh: past Dynamo's recompile limit it would silently fall
    # back to eager flex (the materializing path) and time that instead.
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    masks = []
    score_mod = None if softcap is None else (
        lambda score, b, h, q_idx, kv_idx: softcap * torch.tanh(score / softcap))

    def visible(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window) if window is not None else q_idx >= kv_idx

    masked = causal or window is not None

    def run_flex(q, k, v):
        if masked and not masks:
            masks.append(create_block_mask(visible, None, None, seqlen, seqlen, device=q.device))
        return flex(q, k, v, block_mask=masks[0] if masked else None, enable_gqa=gqa, score_mod=score_mod)

    return {"sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "flex": run_flex}


def _providers(case: Case, inputs, configs=()):
    # Decided once, outside the timed call: the op's own column pays for its dispatch, and this
    # one should differ from it only in the config.
    spec, left, right, scale, softcap = prepare_call(*inputs, case.causal, case.bounds, case.softcap, None, False)
    family = family_of(spec)
    device = device_info()

    def with_config(config):
        reason = family.feasible(spec, config, device)

        def run(q, k, v):
            if reason is not None:
                raise ValueError(f"{config} does not run {spec.name}: {reason}")
            return run_with_config(spec, config, q, k, v, scale, softcap, left, right)[0]
        return run

    return {
        "tilegen": lambda q, k, v: tilegen.attention(q, k, v, causal=case.causal, window=case.bounds,
                                                      softcap=case.softcap),
        "tilegen-default": with_config(family.default_config(spec, device, family.buckets.of(case.seqlen))),
        **peers(case.causal, case.heads_kv != HEADS, case.seqlen, case.softcap, case.window),
        **{f"tilegen {config}": with_config(config) for config in configs},
    }


def _reference(case: Case, q, k, v) -> torch.Tensor:
    """What every provider is checked against: SDPA flash, or where it refuses the shapes (a V narrower than Q and
    K, a window's mask) its memory-efficient backend; with a softcap, ``softcap_reference``."""
    if case.softcap is not None:
        return softcap_reference(q, k, v, case.causal, case.softcap, case.window)
    if case.window is not None:
        rows = torch.arange(case.seqlen, device=q.device)
        keep = (rows[None, :] <= rows[:, None]) & (rows[:, None] - rows[None, :] <= case.window)
        k, v = (t.repeat_interleave(HEADS // case.heads_kv, dim=1) for t in (k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    backends = [torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]
    if v.shape[-1] != q.shape[-1] and case.heads_kv != HEADS:
        # The memory-efficient backend takes no GQA: K's and V's heads repeated for each query head instead.
        k, v = (t.repeat_interleave(HEADS // case.heads_kv, dim=1) for t in (k, v))
    with torch.nn.attention.sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=k.shape[1] != HEADS)


def softcap_reference(q, k, v, causal: bool, softcap: float, window: int | None = None) -> torch.Tensor:
    """Softcapped attention in float32, one (batch, head) at a time so that a 16k-token score matrix fits; the
    causal mask aligned bottom-right, as tilegen's (with a sliding ``window``, also at most that many keys back)."""
    out = torch.empty(q.shape[:3] + (v.shape[3], ), device=q.device, dtype=q.dtype)
    group = q.shape[1] // k.shape[1]
    n_q, n_k = q.shape[2], k.shape[2]
    keep = None
    if causal or window is not None:
        back = torch.arange(n_q, device=q.device)[:, None] + n_k - n_q - torch.arange(n_k, device=q.device)[None, :]
        keep = (back >= 0) & (back <= window) if window is not None else back >= 0
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = (q[b, h].float() @ k[b, h // group].float().T) / math.sqrt(q.shape[3])
            s = softcap * torch.tanh(s / softcap)
            if keep is not None:
                s = s.masked_fill(~keep, -math.inf)
            out[b, h] = (torch.softmax(s, -1) @ v[b, h // group].float()).to(out.dtype)
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _error(e: Exception, width: int = 120) -> str:
    """An exception as one line: its type and the start of its message's first line."""
    message = str(e).splitlines()
    return f"{type(e).__name__}: {message[0][:width] if message else ''}"


def _time(fn, q, k, v) -> float:
    return triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")


def bench_case(case: Case, only: set[str] | None = None, rounds: int = 1, configs=()) -> dict:
    """One case: every provider's error against SDPA flash (memory-efficient for a narrower V), then its time;
    ``configs`` (attention_fwd configs) are more providers, ``tilegen <config>``, each the generated kernel under
    that config."""
    q, k, v = _inputs(case)
    providers = _providers(case, (q, k, v), configs)
    if only:
        providers = {name: fn for name, fn in providers.items() if name in only or name.startswith("tilegen ")}
    ref = _reference(case, q, k, v)
    choice = tilegen.explain(q, k, v, causal=case.causal, window=case.bounds, softcap=case.softcap)
    flops = case.flops(prepare_call(q, k, v, case.causal, case.bounds, case.softcap, None, False)[0])
    row = {"case": str(case), "seqlen": case.seqlen, "variant": case.variant, "batch": case.batch,
           "config": str(choice.config),
           "source": "default" if choice.source == "default" else f"tuned {choice.tuned_bucket}"}
    timers = {}
    for name, fn in providers.items():
        try:
            row[name] = {"rel_err": _rel_err(fn(q, k, v), ref)}
            timers[name] = functools.partial(_time, fn, q, k, v)
        except Exception as e:  # a peer missing on this GPU/torch is reported, not fatal
            row[name] = {"error": _error(e)}
    # With several rounds the providers take turns (take_turns); a figure is the median of its rounds.
    times, failed = take_turns(timers, rounds)
    for name, e in failed.items():
        row[name] = {"error": _error(e)}
    for name, rounds_ms in times.items():
        ms = statistics.median(rounds_ms)
        row[name].update(ms=ms, tflops=flops / ms * 1e-9)
        if rounds > 1:
            row[name]["ms_rounds"] = rounds_ms
    return row


def sweep_case(case: Case) -> list[dict]:
    """Time every feasible config of the case's spec (to pick defaults and check the search space)."""
    q, k, v = _inputs(case)
    spec, left, right, scale, softcap = prepare_call(q, k, v, case.causal, case.bounds, case.softcap, None, False)
    ref = _reference(case, q, k, v)
    results = []
    for config in family_of(spec).candidates(spec, device_info()):
        entry = {"case": str(case), "config": str(config)}
        try:
            run = lambda: run_with_config(spec, config, q, k, v, scale, softcap, left, right)[0]  # noqa: E731
            entry["rel_err"] = _rel_err(run(), ref)
            ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
            entry.update(ms=ms, tflops=case.flops(spec) / ms * 1e-9)
        except Exception as e:
            entry["error"] = _error(e, 160)
        results.append(entry)
        print(json.dumps(entry), flush=True)
    return results


def plot(rows: list[dict], path: str) -> str | None:
    """TFLOP/s against sequence length, one panel per variant and a line per provider; the PNG's
    path, or ``None`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cols = min(2, len(variants))
    nrows = math.ceil(len(variants) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4 * nrows), squeeze=False)
    for ax, variant in zip(axes.flat, variants):
        mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seqlen"])
        for name in PROVIDERS:
            points = [(r["seqlen"], r[name]["tflops"]) for r in mine if "tflops" in r.get(name, {})]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (batch x length = 16k tokens)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{variant}, {HEADS} query heads")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(variants):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def _table(rows: list[dict], configs=()) -> str:
    names = [n for n in (*PROVIDERS, *(f"tilegen {c}" for c in configs)) if any(n in r for r in rows)]
    peers = [p for p in ("sdpa-flash", "sdpa-cudnn") if p in names]
    lines = [
        "| case | batch | tilegen config | " + " | ".join(f"{n} TFLOP/s" for n in names)
        + "".join(f" | tilegen / {p.removeprefix('sdpa-')}" for p in peers) + " |",
        "|" + "---|" * (len(names) + 3 + len(peers)),
    ]

    def ratio(r, peer):
        if "tflops" in r.get("tilegen", {}) and "tflops" in r.get(peer, {}):
            return f"{r['tilegen']['tflops'] / r[peer]['tflops']:.2f}"
        return "-"

    for r in rows:
        cells = [f"{r[n]['tflops']:.0f}" if "tflops" in r.get(n, {}) else "err" for n in names]
        lines.append(f"| {r['case']} | {r['batch']} | {r['config']} ({r['source']}) | " + " | ".join(cells)
                     + "".join(f" | {ratio(r, p)}" for p in peers) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--head-dims", default="64,128",
                        help="comma-separated head dims, each D or D/DV for a V of DV columns (DeepSeek's 192/128)")
    parser.add_argument("--masks", default="causal,full")
    parser.add_argument("--window", type=int, default=None, metavar="KEYS",
                        help="a sliding window in place of --masks: each query sees itself and KEYS keys before it "
                             "(Mistral's 4096; tilegen and Flex, SDPA has none)")
    parser.add_argument("--softcap", type=float, default=None,
                        help="Gemma 2's tanh softcap on every case's scores (tilegen and Flex; SDPA has none)")
    parser.add_argument("--kv-heads", default="32", help="KV heads per case (32 query heads): 32 is MHA, 8 GQA 32/8")
    parser.add_argument("--dtypes", default="bf16", help="bf16 and/or fp16")
    parser.add_argument("--providers", default=None,
                        help="comma-separated subset of tilegen, tilegen-default, sdpa-flash, sdpa-cudnn, flex (default all)")
    parser.add_argument("--rounds", type=int, default=1, help="time the providers of a case in this many "
                        "alternating rounds and report each one's median (default 1)")
    parser.add_argument("--configs", default=None,
                        help="also time tilegen under each of these attention_fwd configs, a JSON list of knob "
                             "objects (for example '[{\"block_m\": 128, \"block_n\": 128, \"num_warps\": 8, "
                             "\"num_stages\": 3, \"tma\": 1}]')")
    parser.add_argument("--sweep", action="store_true", help="time every feasible config too")
    parser.add_argument("--sweep-only", action="store_true", help="only the config sweep")
    parser.add_argument("--plot", metavar="PNG", help="write TFLOP/s against sequence length, a panel per "
                        "head dim, mask, head layout and dtype, here (needs matplotlib)")
    args = parser.parse_args(argv)
    known = set(PROVIDERS)
    only = set(args.providers.split(",")) if args.providers else None
    if only and not only <= known:
        parser.error(f"--providers: unknown {sorted(only - known)}; known: {', '.join(sorted(known))}")
    if any(not h.isdigit() or int(h) < 1 or HEADS % int(h) for h in args.kv_heads.split(",")):
        parser.error(f"--kv-heads: expected divisors of {HEADS}, got {args.kv_heads!r}")
    dims = [(item, parse_head_dims(item)) for item in args.head_dims.split(",")]
    for item, parsed in dims:
        if parsed is None:
            parser.error(f"--head-dims: expected comma-separated D or D/DV (positive ints), got {item!r}")
    head_dims = [parsed for _, parsed in dims]
    if args.softcap is not None and not (math.isfinite(args.softcap) and args.softcap > 0):
        parser.error(f"--softcap: expected a positive finite cap, got {args.softcap}")
    if args.window is not None and args.window < 0:
        parser.error(f"--window: expected a count of keys >= 0, got {args.window}")
    if args.rounds < 1:
        parser.error(f"--rounds: expected a positive number of rounds, got {args.rounds}")
    if not set(args.dtypes.split(",")) <= {"bf16", "fp16"}:
        parser.error(f"--dtypes: expected bf16 and/or fp16, got {args.dtypes!r}")
    if whole_numbers(args.seqlens) is None:
        parser.error(f"--seqlens: expected comma-separated positive whole numbers, got {args.seqlens!r}")
    # A mask other than causal ran as full and was reported as full: a typo measured the wrong variant.
    if not set(args.masks.split(",")) <= {"causal", "full"}:
        parser.error(f"--masks: expected causal and/or full, got {args.masks!r}")
    configs = []
    if args.configs is not None:
        from tilegen.families import registry

        try:
            configs = [registry.get("attention_fwd").config_type.from_dict(c) for c in json.loads(args.configs)]
        except (ValueError, TypeError, AttributeError) as e:
            parser.error(f"--configs: expected a JSON list of attention_fwd knob objects: {e}")
    require_gpu("tilegen.bench.attention")
    dispatch.reset()
    masks = args.masks.split(",") if args.window is None else ["window"]
    cases = [
        Case(int(n), d, m == "causal", int(h), dt, dv, args.softcap, args.window)
        for dt in args.dtypes.split(",")
        for h in args.kv_heads.split(",")
        for d, dv in head_dims
        for m in masks
        for n in args.seqlens.split(",")
    ]
    info = device_info()
    print(f"# {info.name}, torch {torch.__version__}, triton {triton.__version__}, tilegen {tilegen.__version__}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)  # now, not after every case has run
    rows, sweeps = [], []
    for case in cases:
        if args.sweep or args.sweep_only:
            sweeps += sweep_case(case)
        if not args.sweep_only:
            rows.append(bench_case(case, only, args.rounds, configs))
            print(json.dumps(rows[-1]), flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "bench_attention.json"), "w") as f:
            json.dump({"device": info.name, "rows": rows, "sweep": sweeps}, f, indent=1)
    if rows:
        print(_table(rows, configs))
    if args.plot and rows:
        written = plot(rows, args.plot)
        print(f"plot: {written}" if written else "plot: matplotlib is not installed; no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
