"""Score and mask mods on a GPU: ``tilegen.attention(score_mod=..., mask_mod=...)`` against compiled
FlexAttention with the same mod, and against tilegen's built-in variant where one exists.

    python -m tilegen.bench.mods --out mods.json
    python -m tilegen.bench.mods --backward --out mods.json --plot mods.png
    python -m tilegen.bench.mods --mods alibi,alibi+causal --seqlen 16384
    python -m tilegen.bench.mods --mods window-1024 --backward --head-dim 64
    python -m tilegen.bench.mods --backward --rounds 3   # each figure the median of 3 rounds, providers taking turns
    python -m tilegen.bench.mods --mods alibi --configs '[{"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "tma": 1, "wgmma": 2}]'

bf16, batch x 4096 tokens (16k tokens per call), 32 query / 8 KV heads, head dim 128 (``--head-dim``); the forward,
and with ``--backward`` the backward alone too (``torch.autograd.grad(out, (q, k, v), dout)`` after one
forward, for every provider; 2.5 times the forward's FLOPs), each provider's gradients checked against
FlexAttention's first. Each mod of ``tilegen.mods`` (ALiBi, T5 relative bias,
document mask, prefix-LM, sliding window with global tokens, softcap, causal) is timed as
tilegen runs it, as FlexAttention runs it (``torch.compile(flex_attention)``, its block mask made
once outside the timing, as a user would), and, for causal, window and softcap, as tilegen's
built-in mask or softcap. ``do_bench`` medians; TFLOP/s count the score pairs the mask keeps
(4 x pairs x head dim x heads). Each output is checked against FlexAttention's before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

import tilegen
from tilegen.families import relative_error
from tilegen.bench import forced_config, pyplot, require_gpu, take_turns
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.mods import library

B, HQ, HKV, N, D = 4, 32, 8, 4096, 128


def _bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _slopes(heads: int, device) -> torch.Tensor:
    return torch.exp2(-8.0 * torch.arange(1, heads + 1, device=device) / heads)


def _doc_ids(n: int, device) -> torch.Tensor:
    """Four packed documents over ``n`` positions, in the proportions 1500 : 700 : 1200 : 696 (their lengths at
    4096)."""
    cuts = [n * c // 4096 for c in (1500, 2200, 3400)]
    lengths = torch.tensor([cuts[0], cuts[1] - cuts[0], cuts[2] - cuts[1], n - cuts[2]], device=device)
    return torch.repeat_interleave(torch.arange(4, device=device), lengths).to(torch.int32)


def _prefixes(batch: int, n: int, device) -> torch.Tensor:
    """Per sequence, a prefix of 512, 1024, 2048 or 100 positions (at 4096; in proportion otherwise)."""
    return torch.tensor([n * (512, 1024, 2048, 100)[i % 4] // 4096 for i in range(batch)], device=device,
                        dtype=torch.int32)


NAMES = ("alibi", "alibi+causal", "relative-bias", "document", "prefix-lm", "window-1024", "window-1024+64-global",
         "softcap-30", "causal")


def _mods(gen, device="cuda"):
    """name -> (score_mod, mask_mod, tilegen built-in kwargs or None), one for each of ``NAMES``."""
    slopes = _slopes(HQ, device)
    table = torch.randn(HQ, 32, device=device, generator=gen)
    return {
        "alibi": (library.alibi(slopes), None, None),
        "alibi+causal": (library.alibi(slopes), library.causal(), None),
        "relative-bias": (library.relative_bias(table), None, None),
        "document": (None, library.document_mask(_doc_ids(N, device)), None),
        "prefix-lm": (None, library.prefix_lm(_prefixes(B, N, device)), None),
        "window-1024": (None, library.sliding_window(1024), {"window": (1024, 0)}),
        "window-1024+64-global": (None, library.sliding_window(1024, 64), None),
        "softcap-30": (library.softcap(30.0), None, {"softcap": 30.0}),
        "causal": (None, library.causal(), {"causal": True}),
    }


# The benchmark's mods as factories for `tilegen tune --score-mod/--mask-mod tilegen.bench.mods:tune_...`
# (tilegen.mods.sources): each builds the mod for a tuned problem's shape, its captured tensors of the dtypes and
# ranks of the benchmark's, so that the rows it stores serve the benchmark's calls (and a model's with the same mod).
def tune_alibi(*, batch, heads, n_q, n_k, device):
    return library.alibi(_slopes(heads, device))


def tune_relative_bias(*, batch, heads, n_q, n_k, device):
    return library.relative_bias(torch.randn(heads, 32, device=device))


def tune_document(*, batch, heads, n_q, n_k, device):
    return library.document_mask(_doc_ids(n_k, device))


def tune_prefix_lm(*, batch, heads, n_q, n_k, device):
    return library.prefix_lm(_prefixes(batch, n_k, device))


def tune_window_global(*, batch, heads, n_q, n_k, device):
    return library.sliding_window(1024, 64)


def _pairs(mask_mod, device="cuda") -> float:
    if mask_mod is None:
        return float(B * N * N)
    b, q, k = (torch.arange(n, device=device) for n in (B, N, N))
    keep = mask_mod(b[:, None, None], torch.zeros((), dtype=torch.long, device=device), q[None, :, None],
                    k[None, None, :])
    return float(keep.expand(B, N, N).sum())


def _backward(fn, q, k, v, dout):
    """The backward alone of ``fn(q, k, v)``: its gradients, and a function of no argument that times one more
    (the median, ms) on the same graph."""
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, dout, retain_graph=True)
    return grads, lambda: _bench(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True))


def _turns(row: dict, timers: dict, rounds: int, column: str) -> None:
    """``row[f"{name} {column}"]``: each timer's median over ``rounds`` rounds, the providers taking turns
    (``tilegen.bench.take_turns``), in µs; the exception of one that raised."""
    found, failed = take_turns(timers, rounds)
    for name, e in failed.items():
        row[f"{name} {column}"] = f"{type(e).__name__}: {str(e)[:160]}"
    for name, times in found.items():
        row[f"{name} {column}"] = statistics.median(times) * 1e3


def _backward_row(row, flops, flex, tilegen_fn, builtin_fn, q, k, v, rounds: int = 1) -> None:
    """The backward columns of ``row``: each provider's time, once its gradients agree with Flex's."""
    dout = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=torch.Generator(q.device).manual_seed(1))
    try:
        expected, timer = _backward(flex, q, k, v, dout)
    except Exception as e:  # reported; the others are then not checked
        row["flex bwd us"] = f"{type(e).__name__}: {str(e)[:300]}"
        return
    timers = {"flex": timer}
    for key, fn in (("tilegen", tilegen_fn), ("builtin", builtin_fn)):
        if fn is None:
            continue
        try:
            grads, timer = _backward(fn, q, k, v, dout)
        except Exception as e:  # a mod that fails is reported, the others still run
            row[f"{key} bwd us"] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        error = max(relative_error(g.float(), e.float())[0] for g, e in zip(grads, expected))
        row[f"{key} bwd error vs flex"] = error
        if error < 2e-2:
            timers[key] = timer
        else:
            row[f"{key} bwd us"] = f"wrong: relative error {error:.2e} against FlexAttention"
    _turns(row, timers, rounds, "bwd us")
    for key in ("flex", "tilegen", "builtin"):
        t = row.get(f"{key} bwd us")
        if isinstance(t, float):
            row[f"{key} bwd TFLOP/s"] = 2.5 * flops / t / 1e6
    t = row.get("tilegen bwd us")
    if isinstance(t, float) and isinstance(row.get("flex bwd us"), float):
        row["flex / tilegen bwd"] = row["flex bwd us"] / t
        if isinstance(row.get("builtin bwd us"), float):
            row["builtin / tilegen bwd"] = row["builtin bwd us"] / t


def sweep(name, score_mod, mask_mod, q, k, v, configs: list[dict], backward: bool) -> list[dict]:
    """The mod's forward (or backward alone) under each config (``attention_fwd``'s or ``attention_bwd``'s
    knobs), each checked against the family's own default config first (within 2e-2)."""
    from tilegen.families import registry

    family = registry.get("attention_bwd" if backward else "attention_fwd")
    dout = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=torch.Generator(q.device).manual_seed(1))

    def run():
        fn = lambda q, k, v: tilegen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)  # noqa: E731
        if backward:
            grads, timer = _backward(fn, q, k, v, dout)
            return grads, timer()
        out = fn(q, k, v)
        return (out,), _bench(lambda: fn(q, k, v))

    expected, _ = run()  # the default config, as a call without a tuned row runs it
    flops = 4.0 * _pairs(mask_mod, q.device) * D * HQ * (2.5 if backward else 1.0)
    rows = []
    for knobs in configs:
        config = family.config_type(**knobs)
        row = {"mod": name, "pass": "backward" if backward else "forward", "config": str(config)}
        try:
            with forced_config(family.name, config):
                got, t = run()
            error = max(relative_error(g.float(), e.float())[0] for g, e in zip(got, expected))
            row["error vs default"] = error
            row["us"] = t * 1e3 if error < 2e-2 else f"wrong: relative error {error:.2e} against the default config"
            if isinstance(row["us"], float):
                row["TFLOP/s"] = flops / row["us"] / 1e6
        except Exception as e:  # a config that does not compile or launch is reported, the others still run
            row["us"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def case(name, score_mod, mask_mod, builtin, q, k, v, backward: bool = False, rounds: int = 1) -> dict:
    """One mod: each provider checked (tilegen and the built-in against Flex), then timed, forward and, with
    ``backward``, backward alone; with several ``rounds`` the providers take turns, each figure the median."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flops = 4.0 * _pairs(mask_mod) * D * HQ
    row = {"mod": name}
    # Compiled afresh per mod, with Dynamo's caches emptied: they are kept per function, not per torch.compile
    # wrapper, so past the recompile limit (8, reached by the fifth mod with its backward) flex ran eagerly.
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    kwargs = {"enable_gqa": True}
    if score_mod is not None:
        kwargs["score_mod"] = score_mod
    if mask_mod is not None:
        kwargs["block_mask"] = create_block_mask(mask_mod, B, None, N, N, device="cuda")
    timers = {}
    try:
        expected = flex(q, k, v, **kwargs)
        timers["flex"] = lambda: _bench(lambda: flex(q, k, v, **kwargs))
    except Exception as e:  # reported; tilegen is then checked against the float32 reference instead
        row["flex us"] = f"{type(e).__name__}: {str(e)[:600]}"
        expected = attention_reference(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                       compute_dtype=torch.float32)[0].to(q.dtype)
    try:
        out = tilegen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        error = relative_error(out.float(), expected.float())[0]
        row["error vs flex"] = error
        if error < 1e-2:
            timers["tilegen"] = lambda: _bench(lambda: tilegen.attention(q, k, v, score_mod=score_mod,
                                                                         mask_mod=mask_mod))
        else:
            row["tilegen us"] = f"wrong: relative error {error:.2e} against FlexAttention"
    except Exception as e:  # a mod that fails is reported, the others still run
        row["tilegen us"] = f"{type(e).__name__}: {str(e)[:160]}"
    if builtin is not None:
        out = tilegen.attention(q, k, v, **builtin)
        row["builtin error vs flex"] = relative_error(out.float(), expected.float())[0]
        timers["builtin"] = lambda: _bench(lambda: tilegen.attention(q, k, v, **builtin))
    _turns(row, timers, rounds, "us")
    for key in ("flex", "tilegen", "builtin"):
        t = row.get(f"{key} us")
        if isinstance(t, float):
            row[f"{key} TFLOP/s"] = flops / t / 1e6
    t = row.get("tilegen us")
    if isinstance(t, float) and isinstance(row["flex us"], float):
        row["flex / tilegen"] = row["flex us"] / t
        if isinstance(row.get("builtin us"), float):
            row["builtin / tilegen"] = row["builtin us"] / t
    if backward:
        _backward_row(row, flops, lambda q, k, v: flex(q, k, v, **kwargs),
                      lambda q, k, v: tilegen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod),
                      None if builtin is None else lambda q, k, v: tilegen.attention(q, k, v, **builtin), q, k, v,
                      rounds)
    return row


def plot(rows: list[dict], path: str) -> str | None:
    """TFLOP/s per mod and provider, the forward (and the backward where measured) side by side; the PNG's
    path, or ``None`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    passes = [("", "forward")] + ([(" bwd", "backward")] if any("flex bwd us" in r for r in rows) else [])
    fig, axes = plt.subplots(len(passes), 1, figsize=(max(6.0, 0.9 * len(rows)), 4.0 * len(passes)), squeeze=False)
    providers = ("flex", "tilegen", "builtin")
    width = 0.8 / len(providers)
    for ax, (suffix, title) in zip(axes[:, 0], passes):
        for i, name in enumerate(providers):
            points = [(j + i * width, r[f"{name}{suffix} TFLOP/s"]) for j, r in enumerate(rows)
                      if isinstance(r.get(f"{name}{suffix} TFLOP/s"), float)]
            if points:
                ax.bar(*zip(*points), width, label={"flex": "FlexAttention (compiled)", "tilegen": "tilegen, mods",
                                                    "builtin": "tilegen, built-in"}[name])
        ax.set_xticks([j + width for j in range(len(rows))])
        ax.set_xticklabels([r["mod"] for r in rows], rotation=30, ha="right", fontsize="small")
        ax.set_ylabel(f"{title} TFLOP/s")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0, 0].set_title(f"Score and mask mods: bf16, {B} x {N} tokens, {HQ}/{HKV} heads of {D}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(argv=None) -> None:
    # Every helper reads the shape from these module globals: one shape a run.
    global B, N, D
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mods", default="", help="comma-separated names (default: every one)")
    parser.add_argument("--backward", action="store_true", help="also time each provider's backward alone")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, help="write a PNG of TFLOP/s per mod and provider here")
    parser.add_argument("--configs", default=None,
                        help="instead of the peers, time tilegen's forward under each of these attention_fwd configs, "
                             "a JSON list of knob objects ([{\"block_m\": 128, \"block_n\": 128, \"num_warps\": 8, "
                             "\"num_stages\": 3, \"tma\": 1, \"wgmma\": 2}, ...]); with --backward, attention_bwd "
                             "configs and the backward alone")
    parser.add_argument("--seqlen", type=int, default=N,
                        help=f"tokens per sequence, the batch {B * N} // seqlen (default {N}; the documents and prefixes "
                             "scale with it)")
    parser.add_argument("--head-dim", type=int, default=D,
                        help=f"head dim of Q, K and V: a multiple of 8 from 16 to 256 (default {D})")
    parser.add_argument("--rounds", type=int, default=1, help="time the providers of a mod in this many rounds, "
                        "taking turns in a rotating order; each figure the median of its rounds (default 1)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    chosen = [m for m in args.mods.split(",") if m] or list(NAMES)
    unknown = [m for m in chosen if m not in NAMES]
    if unknown:
        parser.error(f"--mods: unknown {', '.join(unknown)}; expected names from {', '.join(NAMES)}")
    if args.configs is not None:
        try:
            configs = json.loads(args.configs)
        except json.JSONDecodeError as e:
            parser.error(f"--configs: expected a JSON list of knob objects, got invalid JSON ({e})")
        if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
            parser.error("--configs: expected a JSON list of knob objects ([{\"block_m\": 128, ...}, ...])")
    if args.seqlen < 1 or args.seqlen > B * N:
        parser.error(f"--seqlen: expected 1 to {B * N}, got {args.seqlen}")
    if not 16 <= args.head_dim <= 256 or args.head_dim % 8:
        parser.error(f"--head-dim: expected a multiple of 8 from 16 to 256, got {args.head_dim}")
    require_gpu("tilegen.bench.mods")
    B, N, D = B * N // args.seqlen, args.seqlen, args.head_dim
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(B, HQ, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(B, HKV, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(B, HKV, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    mods = _mods(gen)
    if args.configs is not None:
        rows = [row for name in chosen for row in sweep(name, *mods[name][:2], q, k, v, configs, args.backward)]
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "shape": [B, HQ, HKV, N, D], "sweep": rows}, f,
                          indent=1)
        print(f"\n{'mod':>22} {'config':>44} {'us':>10} {'TFLOP/s':>8}")
        for r in rows:
            us = f"{r['us']:.1f}" if isinstance(r["us"], float) else "error"
            tflops = f"{r['TFLOP/s']:.0f}" if "TFLOP/s" in r else "-"
            print(f"{r['mod']:>22} {r['config']:>44} {us:>10} {tflops:>8}")
        return
    rows = []
    for name in chosen:
        rows.append(case(name, *mods[name], q, k, v, backward=args.backward, rounds=args.rounds))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [B, HQ, HKV, N, D], "rows": rows}, f, indent=1)
    print(f"\n{'mod':>22} {'flex us':>9} {'tilegen us':>11} {'builtin us':>11} {'flex/tilegen':>13} {'builtin/tilegen':>16}")
    for r in rows:
        def show(key, digits=1):
            value = r.get(key)
            return f"{value:.{digits}f}" if isinstance(value, float) else ("-" if value is None else "error")
        print(f"{r['mod']:>22} {show('flex us'):>9} {show('tilegen us'):>11} {show('builtin us'):>11} "
              f"{show('flex / tilegen', 2):>13} {show('builtin / tilegen', 2):>16}")
        if args.backward:
            print(f"{'backward':>22} {show('flex bwd us'):>9} {show('tilegen bwd us'):>11} {show('builtin bwd us'):>11} "
                  f"{show('flex / tilegen bwd', 2):>13} {show('builtin / tilegen bwd', 2):>16}")
    if args.plot:
        print("plot:", plot(rows, args.plot) or "not written (no matplotlib)")


if __name__ == "__main__":
    main()
