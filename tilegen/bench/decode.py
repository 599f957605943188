"""Batch decode on a GPU: ``tilegen.PagedDecode`` against SDPA (flash, cuDNN) on contiguous KV.

    python -m tilegen.bench.decode --out decode.json
    python -m tilegen.bench.decode --q-tokens 2,4,8 --out speculative.json

bf16, 32 query / 8 KV heads, head dim 128, one query token per sequence, every context
full. Figure of merit: GB/s of K and V read (2 x batch x 8 x context x 128 x 2 bytes) per
``do_bench`` median. The paged cache holds the same keys as the contiguous tensors, in
shuffled pages; the paged output is checked against SDPA's before timing. ``tilegen-dense``
is ``tilegen.attention`` with one query row on the contiguous tensors, which dispatch routes
to the decode family's dense layout.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

import tilegen
from tilegen.families import relative_error
from tilegen.families.attention_decode.spec import MAX_Q_TOKENS

HQ, HKV, D = 32, 8, 128
CASES = [(64, 4096, 16), (256, 1024, 16), (1, 131072, 16), (4, 65536, 16), (64, 4096, 1)]


def _bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _sdpa(q, k, v, gb: float) -> dict:
    """GB/s of SDPA's flash and cuDNN backends on the same tensors, unmasked (each query row sees
    every key), or why a backend did not run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rates = {}
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                rates[name] = gb / _bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)) * 1e3
        except Exception as e:  # a backend missing on this GPU/torch is reported, not fatal
            rates[name] = f"{type(e).__name__}: {str(e)[:80]}"
    return rates


def case(batch: int, ctx: int, page_size: int) -> dict:
    gen = torch.Generator("cuda").manual_seed(0)
    k = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    pages_per = ctx // page_size
    n_pages = batch * pages_per
    perm = torch.randperm(n_pages, device="cuda", generator=gen).to(torch.int32)
    k_pages = torch.empty(n_pages, page_size, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_pages = torch.empty_like(k_pages)
    k_pages[perm.long()] = k.permute(0, 2, 1, 3).reshape(n_pages, page_size, HKV, D)
    v_pages[perm.long()] = v.permute(0, 2, 1, 3).reshape(n_pages, page_size, HKV, D)
    cache = tilegen.PagedKVCache.from_block_table(k_pages, v_pages, perm.view(batch, pages_per),
                                                  torch.full((batch,), ctx, device="cuda"))
    decode = tilegen.PagedDecode()
    choice = decode.plan(cache, heads_q=HQ, max_seqlen_k=ctx)
    q_step = q[:, :, 0].contiguous()
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[:, :, 0]
    error = relative_error(decode.run(q_step, cache).float(), ref.float())[0]
    gb = 2 * batch * HKV * ctx * D * 2 / 1e9
    row = {"batch": batch, "context": ctx, "page_size": page_size, "config": str(choice.config),
           "source": choice.source, "splits": decode.num_splits, "rel_err": error,
           "tilegen-paged": gb / _bench(lambda: decode.run(q_step, cache)) * 1e3}
    row.update(_sdpa(q, k, v, gb))
    dense_error = relative_error(tilegen.attention(q, k, v)[:, :, 0].float(), ref.float())[0]
    row["tilegen-dense"] = gb / _bench(lambda: tilegen.attention(q, k, v)) * 1e3
    row["dense_config"] = str(tilegen.explain(q, k, v).config)
    row["dense_rel_err"] = dense_error
    return row


def speculative_case(batch: int, ctx: int, n_q: int) -> dict:
    """``n_q`` new query tokens per sequence (speculative decoding's drafts) on contiguous KV:
    ``tilegen.attention``, which routes them to the decode family, against SDPA. SDPA's causal
    mask is aligned top-left, so every provider is timed without a mask (the drafts see every
    key, n_q - 1 more per row than causal would: nothing, in bytes read); tilegen's causal mask,
    aligned bottom-right, is timed too."""
    gen = torch.Generator("cuda").manual_seed(1)
    k = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, HQ, n_q, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    gb = 2 * batch * HKV * ctx * D * 2 / 1e9
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    row = {"batch": batch, "context": ctx, "q_tokens": n_q, "config": str(tilegen.explain(q, k, v).config),
           "rel_err": relative_error(tilegen.attention(q, k, v).float(), ref.float())[0],
           "tilegen": gb / _bench(lambda: tilegen.attention(q, k, v)) * 1e3,
           "tilegen-causal": gb / _bench(lambda: tilegen.attention(q, k, v, causal=True)) * 1e3}
    row.update(_sdpa(q, k, v, gb))
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--q-tokens", default="1",
                        help="comma-separated query tokens per sequence; above 1, tilegen.attention on contiguous KV "
                             "(speculative decoding) against SDPA, at the same batch x context shapes (default: 1)")
    args = parser.parse_args(argv)
    try:
        tokens = [int(t) for t in args.q_tokens.split(",")]
    except ValueError:
        parser.error(f"--q-tokens: expected comma-separated whole numbers, got {args.q_tokens!r}")
    if any(not 1 <= t <= MAX_Q_TOKENS for t in tokens):
        parser.error(f"--q-tokens: each must be 1 to {MAX_Q_TOKENS} (the decode family's), got {args.q_tokens!r}")
    if not torch.cuda.is_available():
        raise SystemExit("tilegen.bench.decode times CUDA kernels; run it on a GPU")
    contiguous = list(dict.fromkeys((batch, ctx, None) for batch, ctx, _ in CASES))
    rows = []
    for n_q in tokens:
        for batch, ctx, page_size in CASES if n_q == 1 else contiguous:
            rows.append(case(batch, ctx, page_size) if n_q == 1 else speculative_case(batch, ctx, n_q))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
