"""Batch decode on a GPU: ``tilegen.PagedDecode`` against SDPA (flash, cuDNN) on contiguous KV.

    python -m tilegen.bench.decode --out decode.json
    python -m tilegen.bench.decode --q-tokens 2,4,8 --out speculative.json
    python -m tilegen.bench.decode --kv-dtype fp8 --out decode_fp8.json
    python -m tilegen.bench.decode --kv-dtype fp8 --rounds 3   # providers take turns, medians of 3 rounds

bf16, 32 query / 8 KV heads, head dim 128, one query token per sequence, every context
full. Figure of merit: GB/s of K and V read (2 x batch x 8 x context x 128 x 2 bytes) per
``do_bench`` median. The paged cache holds the same keys as the contiguous tensors, in
shuffled pages; the paged output is checked against SDPA's before timing. ``tilegen-dense``
is ``tilegen.attention`` with one query row on the contiguous tensors, which dispatch routes
to the decode family's dense layout.

``--padded`` measures instead a padded decoding step through the transformers integration
(``tilegen.integrations.transformers.attention_forward``), on transformers' layouts: the cache
``[batch, 8, context, 128]`` as its dynamic cache concatenates it, the query ``[batch, 32, 1, 128]``
a transposed view, rows left-padded by 0 to a quarter of the context. ``integration`` is the call as
it runs (``PagedDecode`` over the cache in place, each key a one-slot page); ``integration-ragged``
the ragged path it took before (K and V flattened, a copy, then ``varlen_attention``);
``sdpa-masked`` SDPA with the padding as a ``[batch, 1, 1, context]`` mask, as transformers' sdpa
attention calls it; ``tilegen-dense`` the same cache unpadded (every key read). GB/s of the real
keys' K and V. The padding layout is made by the first call and reused, as a model's layers reuse it.

``--kv-dtype fp8`` (``fp8e4m3``; ``fp8e5m2`` too) adds, beside each bf16 row, the same decode
over FP8 pages of the same K and V (quantized with a scale per KV head, amax / the format's
largest value): ``tilegen-paged-fp8e4m3`` is its GB/s of the FP8 bytes actually read
(2 x batch x 8 x context x 128 x 1 byte, plus nothing for the scales' few bytes), and its
error is against SDPA on the dequantized K and V.

``--rounds N`` (one query token, bf16 and FP8 pages): the providers of a case are timed in N rounds, taking turns
in a rotating order (``tilegen.bench.take_turns``), each figure the median of its rounds, so that a drift of the
GPU's clocks within a case weighs on every provider alike (FP8's ratio to bf16 included). The speculative and
padded cases time each provider once, in order.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

import tilegen
from tilegen.families import relative_error
from tilegen.dtypes import FP8_MAX, KV_DTYPES
from tilegen.families.attention_decode.spec import MAX_Q_TOKENS
from tilegen.bench import require_gpu, take_turns

HQ, HKV, D = 32, 8, 128
CASES = [(64, 4096, 16), (256, 1024, 16), (1, 131072, 16), (4, 65536, 16), (64, 4096, 1)]


def _bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _sdpa_runs(q, k, v) -> tuple[dict[str, Callable], dict[str, str]]:
    """SDPA's flash and cuDNN backends on the same tensors, unmasked (each query row sees every key): a call of each
    that ran once, and why each other one did not run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    runs, failed = {}, {}
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            run()
            runs[name] = run
        except Exception as e:  # a backend missing on this GPU/torch is reported, not fatal
            failed[name] = f"{type(e).__name__}: {str(e)[:80]}"
    return runs, failed


def _sdpa(q, k, v, gb: float) -> dict:
    """GB/s of SDPA's flash and cuDNN backends, each timed once, or why a backend did not run."""
    runs, rates = _sdpa_runs(q, k, v)
    rates.update({name: gb / _bench(run) * 1e3 for name, run in runs.items()})
    return rates


def _rates(row: dict, timers: dict[str, tuple[Callable, float]], rounds: int) -> None:
    """``row[name]``: GB/s of each ``(call, GB read)`` at the median of its ``rounds`` turns (``take_turns``);
    with several rounds, each round's too; one that raised while timed, its error."""
    found, failed = take_turns({name: (lambda run=run: _bench(run)) for name, (run, _) in timers.items()}, rounds)
    for name, times in found.items():
        gb = timers[name][1]
        row[name] = gb / statistics.median(times) * 1e3
        if rounds > 1:
            row[f"{name} rounds"] = [gb / t * 1e3 for t in times]
    for name, error in failed.items():
        row[name] = f"{type(error).__name__}: {str(error)[:80]}"


def case(batch: int, ctx: int, page_size: int, kv_dtypes: tuple[str, ...] = (), rounds: int = 1,
         device: str = "cuda") -> dict:
    gen = torch.Generator(device).manual_seed(0)
    k = torch.randn(batch, HKV, ctx, D, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, HKV, ctx, D, device=device, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, HQ, 1, D, device=device, dtype=torch.bfloat16, generator=gen)
    pages_per = ctx // page_size
    n_pages = batch * pages_per
    perm = torch.randperm(n_pages, device=device, generator=gen).to(torch.int32)
    k_pages = torch.empty(n_pages, page_size, HKV, D, device=device, dtype=torch.bfloat16)
    v_pages = torch.empty_like(k_pages)
    k_pages[perm.long()] = k.permute(0, 2, 1, 3).reshape(n_pages, page_size, HKV, D)
    v_pages[perm.long()] = v.permute(0, 2, 1, 3).reshape(n_pages, page_size, HKV, D)
    cache = tilegen.PagedKVCache.from_block_table(k_pages, v_pages, perm.view(batch, pages_per),
                                                  torch.full((batch,), ctx, device=device))
    decode = tilegen.PagedDecode()
    choice = decode.plan(cache, heads_q=HQ, max_seqlen_k=ctx)
    q_step = q[:, :, 0].contiguous()
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[:, :, 0]
    error = relative_error(decode.run(q_step, cache).float(), ref.float())[0]
    gb = 2 * batch * HKV * ctx * D * 2 / 1e9
    row = {"batch": batch, "context": ctx, "page_size": page_size, "config": str(choice.config),
           "source": choice.source, "splits": decode.num_splits, "rel_err": error}
    timers = {"tilegen-paged": (lambda: decode.run(q_step, cache), gb)}
    sdpa, failed = _sdpa_runs(q, k, v)
    row.update(failed)
    timers.update({name: (run, gb) for name, run in sdpa.items()})
    for kv_dtype in kv_dtypes:
        fields, run, fp8_gb = _fp8_decode(q, k, v, cache, kv_dtype)
        row.update(fields)
        timers[f"tilegen-paged-{kv_dtype}"] = (run, fp8_gb)
    row["dense_rel_err"] = relative_error(tilegen.attention(q, k, v)[:, :, 0].float(), ref.float())[0]
    row["dense_config"] = str(tilegen.explain(q, k, v).config)
    timers["tilegen-dense"] = (lambda: tilegen.attention(q, k, v), gb)
    _rates(row, timers, rounds)
    return row


def _fp8_decode(q, k, v, cache, kv_dtype: str) -> tuple[dict, Callable, float]:
    """The bf16 case's decode over FP8 copies of its pages (same page table), scaled per KV head: its row's fields
    (config, error against SDPA on the dequantized K and V), a call of it, and the GB of FP8 pages it reads."""
    dtype, limit = KV_DTYPES[kv_dtype], FP8_MAX[kv_dtype]
    batch, ctx = k.shape[0], k.shape[2]
    scales, pages, dequantized = [], [], []
    for full, paged in ((k, cache.k_pages), (v, cache.v_pages)):
        scale = (full.float().abs().amax(dim=(0, 2, 3)) / limit).clamp_min(1e-12).contiguous()
        pages.append((paged.float() / scale[None, None, :, None]).clamp(-limit, limit).to(dtype))
        scales.append(scale)
        dequantized.append(((full.float() / scale[None, :, None, None]).clamp(-limit, limit).to(dtype).float()
                            * scale[None, :, None, None]).to(torch.bfloat16))
    fp8 = tilegen.PagedKVCache(pages[0], pages[1], cache.indptr, cache.indices, cache.last_page_len,
                               scales[0], scales[1])
    decode = tilegen.PagedDecode()
    choice = decode.plan(fp8, heads_q=HQ, max_seqlen_k=ctx, q_dtype=torch.bfloat16)
    q_step = q[:, :, 0].contiguous()
    ref = F.scaled_dot_product_attention(q, *dequantized, enable_gqa=True)[:, :, 0]
    error = relative_error(decode.run(q_step, fp8).float(), ref.float())[0]
    gb = 2 * batch * HKV * ctx * D * dtype.itemsize / 1e9
    fields = {f"{kv_dtype}_config": str(choice.config), f"{kv_dtype}_source": choice.source,
              f"{kv_dtype}_splits": decode.num_splits, f"{kv_dtype}_rel_err": error}
    return fields, lambda: decode.run(q_step, fp8), gb


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


def padded_case(batch: int, ctx: int, device: str = "cuda") -> dict:
    """A left-padded decoding step through the transformers integration (see the module docstring)."""
    import types

    from tilegen.integrations import transformers as tilegen_hf

    gen = torch.Generator(device).manual_seed(2)
    k = torch.randn(batch, HKV, ctx, D, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, HKV, ctx, D, device=device, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, 1, HQ, D, device=device, dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    lead = torch.randint(0, max(ctx // 4, 1), (batch,), device=device, generator=gen)
    lead[0] = 0
    mask = torch.arange(ctx, device=device)[None, :] >= lead[:, None]
    module = types.SimpleNamespace(is_causal=True)
    gb = 2 * HKV * int(mask.sum()) * D * 2 / 1e9

    def integration():
        return tilegen_hf.attention_forward(module, q, k, v, mask)[0]

    def ragged():
        decode, tilegen_hf._decode = tilegen_hf._decode, lambda *args: None
        try:
            return integration()
        finally:
            tilegen_hf._decode = decode

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)

    ref = sdpa().transpose(1, 2)
    row = {"batch": batch, "context": ctx, "real_keys": int(mask.sum()),
           "rel_err": relative_error(integration().float(), ref.float())[0],
           "ragged_rel_err": relative_error(ragged().float(), ref.float())[0]}
    for name, fn in (("integration", integration), ("integration-ragged", ragged), ("sdpa-masked", sdpa),
                     ("tilegen-dense", lambda: tilegen.attention(q, k, v, causal=True))):
        row[name] = gb / _bench(fn) * 1e3
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--q-tokens", default="1",
                        help="comma-separated query tokens per sequence; above 1, tilegen.attention on contiguous KV "
                             "(speculative decoding) against SDPA, at the same batch x context shapes (default: 1)")
    parser.add_argument("--kv-dtype", default="bf16",
                        help="comma-separated page dtypes among bf16, fp8 (= fp8e4m3) and fp8e5m2: each FP8 one adds "
                             "its decode's GB/s of FP8 bytes beside bf16's, on the same shapes (default: bf16)")
    parser.add_argument("--padded", action="store_true",
                        help="a left-padded decoding step through the transformers integration instead (see above)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="one query token: time the providers of a case in this many rounds, taking turns in a "
                             "rotating order; each figure the median of its rounds (default 1)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    kv_dtypes = []
    for name in args.kv_dtype.split(","):
        name = {"fp8": "fp8e4m3"}.get(name.strip(), name.strip())
        if name not in ("bf16", *KV_DTYPES):
            parser.error(f"--kv-dtype: expected bf16, fp8, fp8e4m3 or fp8e5m2, got {name!r}")
        if name != "bf16" and name not in kv_dtypes:
            kv_dtypes.append(name)
    try:
        tokens = [int(t) for t in args.q_tokens.split(",")]
    except ValueError:
        parser.error(f"--q-tokens: expected comma-separated whole numbers, got {args.q_tokens!r}")
    if any(not 1 <= t <= MAX_Q_TOKENS for t in tokens):
        parser.error(f"--q-tokens: each must be 1 to {MAX_Q_TOKENS} (the decode family's), got {args.q_tokens!r}")
    if args.padded and (kv_dtypes or tokens != [1]):
        parser.error("--padded: a bf16 decoding step of one query token; --q-tokens and --kv-dtype do not apply")
    if kv_dtypes and tokens != [1]:
        parser.error("--kv-dtype: FP8 pages are measured on the paged decode of one query token (--q-tokens 1)")
    if args.rounds > 1 and (args.padded or tokens != [1]):
        parser.error("--rounds: the paged decode of one query token takes turns; --padded and --q-tokens above 1 "
                     "time each provider once")
    require_gpu("tilegen.bench.decode")
    contiguous = list(dict.fromkeys((batch, ctx, None) for batch, ctx, _ in CASES))
    if args.padded:
        runs = [functools.partial(padded_case, batch, ctx) for batch, ctx, _ in contiguous]
    else:
        runs = [functools.partial(case, batch, ctx, page_size, tuple(kv_dtypes), args.rounds) if n_q == 1
                else functools.partial(speculative_case, batch, ctx, n_q)
                for n_q in tokens for batch, ctx, page_size in (CASES if n_q == 1 else contiguous)]
    rows = []
    for run in runs:
        rows.append(run())
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
