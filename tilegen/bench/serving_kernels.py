"""Serving kernels benchmark: paged-KV append and merge_states, in GB/s.

    python -m tilegen.bench.serving_kernels --out results.json     # on a GPU
    python -m tilegen.bench.serving_kernels --smoke                # tiny shapes; the interpreter without a GPU

Parts (bf16, 8 KV heads, head dim 128, page size 16):
- append: a decode step of 64 sequences x 1 new token, and a prefill chunk of 8 x 512, onto
  prefixes of 0..2047 tokens in shuffled pages. ``tilegen`` is ``tilegen.append_kv`` as users
  call it (tuned rows, else the heuristic default), ``tilegen-default`` the heuristic default's
  launch alone, ``torch-index-copy`` the torch peer given a precomputed slot mapping (as vLLM's
  scheduler hands its cache kernel one), which is not counted in its time.
- merge: ``tilegen.merge_states`` on [tokens, 32 heads, 128] for a decode batch (64 tokens) and a
  prefill (8192 tokens); peers: the same formula in eager torch and under ``torch.compile``.

Every provider is checked before it is timed: an append into NaN-poisoned pages must write
exactly the new tokens' slots with their values and leave every other element NaN; a merge's output
and LSE are compared with the float64 reference (relative error, the larger of the two). Times are
``triton.testing.do_bench`` medians on a GPU (wall-clock medians under the interpreter: only a smoke test). Append GB/s
count the bytes written into the cache; ``GB/s moved`` adds the bytes read (the new K and V and
the page table); merge GB/s count both parts read and the result written. The H200's
device-to-device copy reaches 4219 GB/s read+write (../shared/gpu/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import torch
import triton

import tilegen
from tilegen.device import device_info
from tilegen.dispatch import launcher_for
from tilegen.env import interpreting
from tilegen.families import family_of
from tilegen.families.kv_append import KVAppendSpec
from tilegen.families.merge_states.problem import check_merge, random_lse
from tilegen.ops.append import explain_append
from tilegen.ops.kv_cache import PagedKVCache
from tilegen.ops.merge import explain_merge
from tilegen.tuning.measure import time_ms

__all__ = ["main"]

DTYPE = torch.bfloat16
KV_HEADS, DIM, PAGE_SIZE, HEADS = 8, 128, 16, 32
APPEND_CASES = [(64, 1), (8, 512)]  # (sequences, new tokens each)
MERGE_TOKENS = [64, 8192]
MAX_PREFIX = 2048
#: --smoke: shapes the interpreter runs in seconds.
SMOKE = {"kv_heads": 2, "dim": 32, "heads": 3, "append": [(5, 1), (2, 7)], "merge": [4, 9], "max_prefix": 40}


def _append_batch(batch, new, *, kv_heads, dim, max_prefix, device, seed=0):
    """A cache whose page table counts the new tokens, the new K and V, cu_seqlens, and the flat slot of
    each new token (page * PAGE_SIZE + slot), all on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, max_prefix, (batch,), generator=gen)
    lens = prefix + new
    pages = (lens + PAGE_SIZE - 1) // PAGE_SIZE
    num_pages = int(pages.sum()) + 1
    indices = torch.randperm(num_pages, generator=gen)[: int(pages.sum())]
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)])
    last = lens - (pages - 1) * PAGE_SIZE
    pos = prefix[:, None] + torch.arange(new)[None, :]  # [batch, new]
    page_of = indices[indptr[:-1, None] + pos // PAGE_SIZE]
    slots = (page_of * PAGE_SIZE + pos % PAGE_SIZE).flatten()
    cu = torch.arange(batch + 1, dtype=torch.int32) * new
    k = torch.randn(batch * new, kv_heads, dim, generator=gen).to(device, DTYPE)
    v = torch.randn(batch * new, kv_heads, dim, generator=gen).to(device, DTYPE)
    k_pages = torch.empty(num_pages, PAGE_SIZE, kv_heads, dim, dtype=DTYPE, device=device)
    v_pages = torch.empty_like(k_pages)
    cache = PagedKVCache(k_pages, v_pages, *(t.to(device, torch.int32) for t in (indptr, indices, last)))
    return cache, k, v, cu.to(device), slots.to(device)


def _append_correct(cache, k, v, slots) -> bool:
    """Exactly the new tokens' slots hold their values; every other element of the pages is still NaN."""
    ok = True
    for pages, new in ((cache.k_pages, k), (cache.v_pages, v)):
        flat = pages.view(-1, *pages.shape[2:])
        ok &= bool(torch.equal(flat[slots], new))
        ok &= int(torch.isnan(pages).sum()) == pages.numel() - new.numel()
    return ok


def append_rows(*, kv_heads, dim, cases, max_prefix, device, on_gpu) -> list[dict]:
    rows = []
    for batch, new in cases:
        cache, k, v, cu, slots = _append_batch(batch, new, kv_heads=kv_heads, dim=dim, max_prefix=max_prefix,
                                               device=device)
        spec = KVAppendSpec(head_dim=dim, page_size=PAGE_SIZE, dtype="bf16")
        family = family_of(spec)
        default = family.default_config(spec, device_info(), family.buckets.of(k.shape[0])).to_dict()
        launch = launcher_for(spec).jit  # through the JIT, with the compile options every launch passes
        args = (k, v, cu, cache.k_pages, cache.v_pages, cache.indptr, cache.indices, cache.last_page_len)
        k_flat = cache.k_pages.view(-1, kv_heads, dim)
        v_flat = cache.v_pages.view(-1, kv_heads, dim)

        def torch_index_copy():
            k_flat.index_copy_(0, slots, k)
            v_flat.index_copy_(0, slots, v)

        providers = {
            "tilegen": lambda: tilegen.append_kv(cache, k, v, cu),
            "tilegen-default": lambda: launch(*args, **default),
            "torch-index-copy": torch_index_copy,
        }
        if on_gpu:
            providers["tilegen-graph"] = _graphed(providers["tilegen"])
        written = 2 * k.numel() * k.element_size()
        pages_written = int(torch.unique(slots // PAGE_SIZE).numel())  # page indices the kernel must read
        moved = 2 * written + 4 * (cache.indptr.numel() + cache.last_page_len.numel() + cu.numel() + pages_written)
        config = explain_append(cache, k, v, cu)
        for name, fn in providers.items():
            row = {"part": "append", "case": f"{batch}x{new}", "provider": name}
            if name == "tilegen":
                row["config"] = f"{config.config} ({config.source})"
            try:
                cache.k_pages.fill_(math.nan)
                cache.v_pages.fill_(math.nan)
                fn()
                row["correct"] = _append_correct(cache, k, v, slots)
                if row["correct"]:
                    ms = time_ms(fn, on_gpu)
                    row.update(ms=ms, gbps=written / ms * 1e-6, gbps_moved=moved / ms * 1e-6)
            except Exception as e:  # a peer that fails here is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
    return rows


def _graphed(fn):
    """``fn`` replayed from a CUDA graph: the kernel's time without the host's per-call work (checks,
    dispatch, Triton's launcher), as a serving loop that captures its decode step sees it. Returns
    what ``fn`` returned at capture (its outputs, which each replay rewrites)."""
    state = {}

    def run():
        if "graph" not in state:
            fn()  # planned and compiled outside the capture
            state["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(state["graph"]):
                state["result"] = fn()
        state["graph"].replay()
        return state["result"]

    return run


def _torch_merge(o_a, lse_a, o_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    empty = torch.isneginf(m)
    m = torch.where(empty, 0.0, m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = torch.where(empty, 1.0, wa + wb)
    o = (o_a.float() * (wa / total)[..., None] + o_b.float() * (wb / total)[..., None]).to(o_a.dtype)
    return o, torch.where(empty, -math.inf, m + torch.log(total))


def merge_rows(*, heads, dim, tokens_list, device, on_gpu) -> list[dict]:
    rows = []
    compiled = torch.compile(_torch_merge, dynamic=False) if on_gpu else None
    for tokens in tokens_list:
        gen = torch.Generator().manual_seed(tokens)
        o_a = torch.randn(tokens, heads, dim, generator=gen).to(device, DTYPE)
        o_b = torch.randn(tokens, heads, dim, generator=gen).to(device, DTYPE)
        lse_a, lse_b = (t.to(device) for t in random_lse((tokens, heads), gen))
        parts = (o_a, lse_a, o_b, lse_b)
        out = torch.empty_like(o_a)
        out_lse = torch.empty_like(lse_a)
        providers = {"tilegen": lambda: tilegen.merge_states(*parts, out=out, out_lse=out_lse),
                     "torch-eager": lambda: _torch_merge(*parts)}
        if compiled is not None:
            providers["torch-compile"] = lambda: compiled(*parts)
        if on_gpu:
            providers["tilegen-graph"] = _graphed(providers["tilegen"])
        moved = 3 * tokens * heads * (dim * o_a.element_size() + 4)
        choice = explain_merge(*parts)
        for name, fn in providers.items():
            row = {"part": "merge", "case": f"{tokens}x{heads}x{dim}", "provider": name}
            if name == "tilegen":
                row["config"] = f"{choice.config} ({choice.source})"
            try:
                out.fill_(math.nan)
                out_lse.fill_(math.nan)
                o, lse = fn()
                # The family's own check: the LSE's values too, not only where it is -inf.
                error = check_merge(*parts, o, lse)[0]
                row["rel_err"] = error
                row["correct"] = bool(error < 1e-2)
                if row["correct"]:
                    ms = time_ms(fn, on_gpu)
                    row.update(ms=ms, gbps=moved / ms * 1e-6)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
    return rows


def _print_table(rows) -> None:
    print(f"\n{'part':7} {'case':16} {'provider':17} {'ms':>9} {'GB/s':>9} {'moved':>9}  config")
    for r in rows:
        head = f"{r['part']:7} {r['case']:16} {r['provider']:17}"
        if "error" in r:
            print(f"{head} {r['error']}")
        elif not r["correct"]:
            print(f"{head} WRONG RESULT" + (f" (relative error {r['rel_err']:.1e})" if "rel_err" in r else ""))
        else:
            moved = f"{r['gbps_moved']:9.1f}" if "gbps_moved" in r else f"{'':9}"
            print(f"{head} {r['ms']:9.4f} {r['gbps']:9.1f} {moved}  {r.get('config', '')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--parts", default="append,merge")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks that the script runs (no GPU needed)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = [part for part in parts if part not in ("append", "merge")]
    if unknown:
        raise SystemExit(f"--parts: unknown part {unknown[0]!r}; known: append, merge")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.smoke:
            raise SystemExit("tilegen.bench.serving_kernels times CUDA kernels; run it on a GPU, or pass --smoke")
        if not interpreting():
            # Triton picks the interpreter when it is imported, which `import tilegen` already did. The flags are
            # checked first: `tilegen bench` turns a refusal of this process's into its one-line error, not the child's.
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            argv = sys.argv[1:] if argv is None else argv
            return subprocess.run([sys.executable, "-m", "tilegen.bench.serving_kernels", *argv], env=env).returncode
    device = "cuda" if on_gpu else "cpu"
    shapes = SMOKE if args.smoke else {"kv_heads": KV_HEADS, "dim": DIM, "heads": HEADS, "append": APPEND_CASES,
                                       "merge": MERGE_TOKENS, "max_prefix": MAX_PREFIX}
    rows = []
    for part in parts:
        if part == "append":
            new = append_rows(kv_heads=shapes["kv_heads"], dim=shapes["dim"], cases=shapes["append"],
                              max_prefix=shapes["max_prefix"], device=device, on_gpu=on_gpu)
        else:
            new = merge_rows(heads=shapes["heads"], dim=shapes["dim"], tokens_list=shapes["merge"], device=device,
                             on_gpu=on_gpu)
        for row in new:
            print(json.dumps(row), flush=True)
        rows += new
    _print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if on_gpu else "cpu-interpreter",
                       "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke,
                       "rows": rows}, f, indent=1)
    wrong = [r for r in rows if r["provider"].startswith("tilegen") and not r.get("correct")]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
