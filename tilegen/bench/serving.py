"""Ragged and paged prefill against the dense op and the peers, in one run.

    python -m tilegen.bench.serving --out results.json

Parts (bf16, 32 query / 8 KV heads, head dim 128 unless ``--head-dims`` says D/DV, causal):
- ragged: 64 sequences of mixed lengths (128..8192) through ``tilegen.varlen_attention``;
  peers: the dense ``tilegen.attention`` and SDPA (flash, cuDNN) at the same total tokens
  laid out as a uniform batch, and compiled FlexAttention over the packed tokens with a
  document mask built from the same ``cu_seqlens``;
- equal: 8 sequences of 4096 tokens through ``tilegen.varlen_attention``, against the dense
  ``tilegen.attention`` and SDPA cuDNN on the same tokens as an [8, heads, 4096, dim] batch;
- paged: 4096 new tokens onto a 32768-token prefix in pages of 16, through
  ``tilegen.PagedAttention``; peers: the same computation on contiguous KV through the dense
  ``tilegen.attention`` (causal, bottom-right) and FlexAttention with the same mask.
Every provider is checked against a reference before it is timed (relative error); times
are ``triton.testing.do_bench`` medians; FLOPs are the families' own count (pairs the mask
lets through, 2 per multiply-add of QK^T and PV).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton

import tilegen
from tilegen.families import family_of, relative_error
from tilegen.bench import parse_head_dims, require_gpu
from tilegen.ops.kv_cache import PAGE_SIZES

HEADS, KV_HEADS, DIM = 32, 8, 128
DTYPE = torch.bfloat16


def _time(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _row(name, fn, flops, ref=None, out_of=lambda o: o, *, build=None):
    """Check, then time, one provider; ``build`` makes ``fn`` first, inside the same error net."""
    try:
        if build is not None:
            fn = build()
        out = out_of(fn())
        err = relative_error(out.float(), ref.float())[0] if ref is not None else None
        ms = _time(fn)
        return {"provider": name, "ms": ms, "tflops": flops / ms * 1e-9, "rel_err": err}
    except Exception as e:  # a peer missing on this GPU/torch is reported, not fatal
        return {"provider": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}


def _flex_document(q, k, v, doc_q, doc_k, offset_q, offset_k, n_q, n_k):
    """FlexAttention over packed tokens: a query sees keys of its own document, causal bottom-right."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask(b, h, qi, ki):
        return (doc_q[qi] == doc_k[ki]) & (ki - offset_k[ki] <= qi - offset_q[qi] + (n_k[doc_q[qi]] - n_q[doc_q[qi]]))

    # Compiled: the eager builder materializes the whole [n_q, n_k] mask, which does not fit at 100k+ tokens.
    torch._dynamo.reset()  # Dynamo's caches are per function: past its recompile limit flex would run eagerly
    block_mask = create_block_mask(mask, None, None, q.shape[0], k.shape[0], device="cuda", _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    return lambda: flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)


def _spec(dims: tuple[int, int], **layout):
    """The parts' ``attention_varlen`` spec (causal bf16, 32/8 heads) at head dims ``dims``, laid out as ``layout``
    says (``kv_layout``, ``page_size``; none: the fields every layout shares)."""
    return tilegen.spec_from_json({"family": "attention_varlen", "head_dim": dims[0], "head_dim_v": dims[1],
                                   "q_per_kv": HEADS // KV_HEADS, "mask": "causal", "dtype": "bf16", **layout})


def _documents(lengths):
    ids, offsets = [], []
    start = 0
    for i, n in enumerate(lengths):
        ids += [i] * n
        offsets += [start] * n
        start += n
    return (torch.tensor(ids, device="cuda"), torch.tensor(offsets, device="cuda"))


def ragged(seed: int = 0, dims: tuple[int, int] = (DIM, DIM)) -> list[dict]:
    dim, dim_v = dims
    gen = torch.Generator("cuda").manual_seed(seed)
    # 64 lengths spread log-uniformly over 128..8192, none a multiple of a block, in a shuffled order.
    lengths = [int(128 * 64 ** (i / 63)) + 1 for i in range(64)]
    lengths = [lengths[(i * 37) % 64] for i in range(64)]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(total, HEADS, dim, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(total, KV_HEADS, dim, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(total, KV_HEADS, dim_v, device="cuda", dtype=DTYPE, generator=gen)
    spec = _spec(dims, kv_layout="ragged")
    problem = family_of(spec).problem(spec, 8192, on_gpu=True, q_lens=tuple(lengths), k_lens=tuple(lengths),
                                      heads_q=HEADS)
    flops = problem.flops()

    def ours():
        return tilegen.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)

    # Reference: SDPA per sequence (bottom-right equals top-left when n_q == n_k).
    ref = torch.empty(total, HEADS, dim_v, device="cuda", dtype=DTYPE)
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        ref[a:b] = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None],
            is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    rows = [{"part": "ragged", "sequences": len(lengths), "tokens": total, **_row("tilegen-varlen", ours, flops, ref)}]
    doc, offset = _documents(lengths)
    n = torch.tensor(lengths, device="cuda")
    rows.append({"part": "ragged", **_row("flex-document", None, flops, ref, lambda o: o[0].transpose(0, 1),
                                          build=lambda: _flex_document(q, k, v, doc, doc, offset, offset, n, n))})
    # The dense kernel and SDPA at the same total tokens, as a uniform batch of 4096-token sequences.
    seq = 4096
    batch = max(1, total // seq)
    qd = torch.randn(batch, HEADS, seq, dim, device="cuda", dtype=DTYPE, generator=gen)
    kd = torch.randn(batch, KV_HEADS, seq, dim, device="cuda", dtype=DTYPE, generator=gen)
    vd = torch.randn(batch, KV_HEADS, seq, dim_v, device="cuda", dtype=DTYPE, generator=gen)
    dense_spec = tilegen.ops.attention.prepare_call(qd, kd, vd, True, None, None, None, False)[0]
    dense_flops = family_of(dense_spec).problem(dense_spec, seq, on_gpu=True, batch=batch, heads_q=HEADS).flops()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        return run

    dense_ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
    for name, fn in (("tilegen-dense", lambda: tilegen.attention(qd, kd, vd, causal=True)),
                     ("sdpa-flash", sdpa(SDPBackend.FLASH_ATTENTION)), ("sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))):
        rows.append({"part": "ragged", "uniform": f"{batch}x{seq}", **_row(name, fn, dense_flops, dense_ref)})
    return rows


def equal(seed: int = 0, batch: int = 8, seq: int = 4096, dims: tuple[int, int] = (DIM, DIM)) -> list[dict]:
    """Equal lengths: the ragged op against the dense one on the same tokens (the dense layout a view of them)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dim, dim_v = dims
    gen = torch.Generator("cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch * seq, h, d, device="cuda", dtype=DTYPE, generator=gen)
               for h, d in ((HEADS, dim), (KV_HEADS, dim), (KV_HEADS, dim_v)))
    qd, kd, vd = (t.view(batch, seq, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
    cu = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device="cuda")
    spec = tilegen.ops.attention.prepare_call(qd, kd, vd, True, None, None, None, False)[0]
    flops = family_of(spec).problem(spec, seq, on_gpu=True, batch=batch, heads_q=HEADS).flops()

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

    ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
    shape = {"part": "equal", "uniform": f"{batch}x{seq}"}
    return [
        {**shape, **_row("tilegen-varlen", lambda: tilegen.varlen_attention(q, k, v, cu, cu, seq, seq, causal=True),
                         flops, ref, lambda o: o.view(batch, seq, HEADS, dim_v).transpose(1, 2))},
        {**shape, **_row("tilegen-dense", lambda: tilegen.attention(qd, kd, vd, causal=True), flops, ref)},
        {**shape, **_row("sdpa-cudnn", cudnn, flops, ref)},
    ]


def paged(seed: int = 0, prefix: int = 32768, new: int = 4096, page_size: int = 16,
          dims: tuple[int, int] = (DIM, DIM)) -> list[dict]:
    dim, dim_v = dims
    gen = torch.Generator("cuda").manual_seed(seed)
    n_k = prefix + new
    k = torch.randn(n_k, KV_HEADS, dim, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(n_k, KV_HEADS, dim_v, device="cuda", dtype=DTYPE, generator=gen)
    q = torch.randn(new, HEADS, dim, device="cuda", dtype=DTYPE, generator=gen)
    pages = math.ceil(n_k / page_size)
    order = torch.randperm(pages + 16, device="cuda", generator=gen)[:pages].to(torch.int32)
    k_pages, v_pages = (torch.full((pages + 16, page_size, KV_HEADS, d), math.nan, device="cuda", dtype=DTYPE)
                        for d in (dim, dim_v))
    padded = pages * page_size
    k_pages[order] = F.pad(k, (0, 0, 0, 0, 0, padded - n_k)).view(pages, page_size, KV_HEADS, dim)
    v_pages[order] = F.pad(v, (0, 0, 0, 0, 0, padded - n_k)).view(pages, page_size, KV_HEADS, dim_v)
    cache = tilegen.PagedKVCache.from_block_table(k_pages, v_pages, order[None], torch.tensor([n_k], device="cuda"))
    cu_q = torch.tensor([0, new], dtype=torch.int32, device="cuda")
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, cache, heads_q=HEADS, causal=True, max_seqlen_q=new, max_seqlen_k=n_k)
    spec = _spec(dims, kv_layout="paged", page_size=page_size)
    flops = family_of(spec).problem(spec, n_k, on_gpu=True, q_lens=(new,), k_lens=(n_k,), heads_q=HEADS).flops()
    qd, kd, vd = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    dense = tilegen.attention(qd, kd, vd, causal=True)  # bottom-right causal: the reference layout
    ref = dense[0].transpose(0, 1)
    rows = [{"part": "paged", "page_size": page_size, "prefix": prefix, "new": new,
             **_row("tilegen-paged", lambda: attn.run(q, cache), flops, ref)}]
    rows.append({"part": "paged", **_row("tilegen-dense-contiguous", lambda: tilegen.attention(qd, kd, vd, causal=True),
                                         flops, ref, lambda o: o[0].transpose(0, 1))})
    # The paged path's yardstick: the ragged op over the same keys, contiguous.
    cu_k = torch.tensor([0, n_k], dtype=torch.int32, device="cuda")
    rows.append({"part": "paged", **_row("tilegen-varlen-contiguous",
                                         lambda: tilegen.varlen_attention(q, k, v, cu_q, cu_k, new, n_k, causal=True),
                                         flops, ref)})
    zeros = torch.zeros(new, dtype=torch.long, device="cuda")
    n_q_t, n_k_t = torch.tensor([new], device="cuda"), torch.tensor([n_k], device="cuda")
    zeros_k = torch.zeros(n_k, dtype=torch.long, device="cuda")
    rows.append({"part": "paged", **_row(
        "flex-offset-causal", None, flops, ref, lambda o: o[0].transpose(0, 1),
        build=lambda: _flex_document(q, k, v, zeros, zeros_k, zeros, zeros_k, n_q_t, n_k_t))})
    return rows


def sweep_paged(seed: int = 0, prefix: int = 32768, new: int = 4096, page_size: int = 16,
                dims: tuple[int, int] = (DIM, DIM)) -> list[dict]:
    """Every feasible config of the paged kernel on the paged part's data, fastest first (to pick defaults)."""
    from tilegen.device import device_info
    from tilegen.dispatch import launcher_for

    spec = _spec(dims, kv_layout="paged", page_size=page_size)
    family = family_of(spec)
    problem = family.problem(spec, prefix + new, on_gpu=True, q_lens=(new,), k_lens=(prefix + new,), heads_q=HEADS)
    inputs = problem.inputs(seed)
    outputs = problem.outputs(inputs)
    module = launcher_for(spec)  # as the tuner measures: the launcher the op replays
    rows = []
    for config in family.candidates(spec, device_info()):
        try:
            problem.launch(module, config, inputs, outputs)
            error, _ = problem.check(inputs, outputs)
            ms = _time(lambda: problem.launch(module, config, inputs, outputs))
            rows.append({"part": "sweep-paged", "provider": str(config), "ms": ms,
                         "tflops": problem.flops() / ms * 1e-9, "rel_err": error})
        except Exception as e:
            rows.append({"part": "sweep-paged", "provider": str(config), "error": str(e).splitlines()[0][:100]})
    return sorted(rows, key=lambda r: r.get("ms", math.inf))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--parts", default="ragged,equal,paged")
    parser.add_argument("--page-sizes", default="16", help="page sizes of the paged part, comma-separated")
    parser.add_argument("--head-dims", default=str(DIM),
                        help="D or D/DV: Q's and K's head dim, and V's (DeepSeek's 192/128); default 128")
    args = parser.parse_args(argv)
    parsed = parse_head_dims(args.head_dims)
    if parsed is None:
        parser.error(f"--head-dims: expected D or D/DV, positive integers, got {args.head_dims!r}")
    dims = (parsed[0], parsed[1] or parsed[0])
    try:  # the head dims the ragged and paged ops take, before any tensor is made
        _spec(dims)
    except ValueError as e:
        parser.error(f"--head-dims {args.head_dims}: {e}")
    page_sizes = [int(p) if p.isdigit() else None for p in args.page_sizes.split(",")]
    if not set(page_sizes) <= set(PAGE_SIZES):
        parser.error(f"--page-sizes: expected comma-separated sizes among {', '.join(map(str, PAGE_SIZES))}, "
                     f"got {args.page_sizes!r}")
    parts = {
        "ragged": lambda: ragged(dims=dims),
        "equal": lambda: equal(dims=dims),
        "paged": lambda: [r for ps in page_sizes for r in paged(page_size=ps, dims=dims)],
        "sweep-paged": lambda: [r for ps in page_sizes for r in sweep_paged(page_size=ps, dims=dims)],
    }
    chosen = args.parts.split(",")
    if not set(chosen) <= set(parts):
        parser.error(f"--parts: expected parts among {', '.join(parts)}, got {args.parts!r}")
    require_gpu("tilegen.bench.serving")
    rows = []
    for part in chosen:
        for row in parts[part]():
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{'part':8} {'provider':26} {'ms':>9} {'TFLOP/s':>8} {'rel err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['part']:8} {r['provider']:26} {r['error']}")
        else:
            err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
            print(f"{r['part']:8} {r['provider']:26} {r['ms']:9.3f} {r['tflops']:8.1f} {err:>9}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
