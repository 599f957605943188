"""Host time per call on launch-bound shapes: tilegen's ops against SDPA's flash and cuDNN backends.

    python -m tilegen.bench.hosttime --out hosttime.json     # on a GPU, well under a minute
    TRITON_INTERPRET=1 python -m tilegen.bench.hosttime      # no GPU: checks the script, times nothing real
    TRITON_INTERPRET=1 python -m tilegen.bench.hosttime --no-launch --rounds 20 --calls 2000
                                                             # no GPU: times the Python of tilegen's calls

Shapes (bf16): the dense op on 1 x 8 heads x 16 tokens x 64; decode of one sequence of
16 tokens in one page of 16, 32 query and 8 KV heads of 128 (``PagedDecode.run``; the dense
op and SDPA take the same token as a [1, 32, 1, 128] query against [1, 8, 16, 128] K and V);
and a short prefill, 1 x 8 x 512 x 64, whose config on Hopper asks for TMA descriptors: the
launcher keeps pointers below its size floor (``TMA_MIN_WORK``), where descriptors' host cost
would outlast the kernel.
Each tilegen row is measured twice in the same run: as shipped, compiled kernels launched
directly (``tilegen.triton_internals.launch``), and ``(JIT launch)``, every launch through Triton's
``JITFunction.run`` as before direct launches.

Host time per call: after a synchronize, the wall time to issue ``--calls`` back-to-back
calls, stopped before the closing synchronize, divided by the calls. The calls are few enough
(at most two launches each) that the launch queue never fills, so the GPU never holds the host
back; the synchronized time per call, also shown, is the pace of a loop of such calls when the
GPU is slower. Rounds of all rows are interleaved, so drifts of the host's speed reach every
row alike; the table gives each row's median round and its fastest.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import tilegen
import tilegen.ops.attention as attention_op
import tilegen.ops.decode as decode_op
from tilegen import dispatch
from tilegen.triton_internals import launch
from tilegen.codegen import module_for
from tilegen.env import interpreting

__all__ = ["main"]

DTYPE = torch.bfloat16
DENSE, DECODE, PREFILL = "dense 1x8x16x64", "decode 1x32/8x16x128", "prefill 1x8x512x64"

_jit_plans = dispatch.plan_cache()
_jit_launcher = functools.cache(lambda spec: launch.Launcher(module_for(spec), direct=False))


@contextlib.contextmanager
def _jit_launches():
    """The ops as they were before direct launches: plans of their own, whose launchers go through the JIT."""
    saved = attention_op._plans, attention_op.launcher_for, decode_op.launcher_for
    attention_op._plans, attention_op.launcher_for, decode_op.launcher_for = _jit_plans, _jit_launcher, _jit_launcher
    try:
        yield
    finally:
        attention_op._plans, attention_op.launcher_for, decode_op.launcher_for = saved


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return functools.partial(sdpa_kernel, getattr(SDPBackend, name))


def _rows(device: str) -> list[dict]:
    """Each row: shape, provider, a zero-argument call, and the context (a factory) its calls run in."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=DTYPE)

    q, k, v = rand(1, 8, 16, 64), rand(1, 8, 16, 64), rand(1, 8, 16, 64)
    out = torch.empty_like(q)
    qd, kd, vd = rand(1, 32, 1, 128), rand(1, 8, 16, 128), rand(1, 8, 16, 128)
    # The same 16 keys in one page: slot s of page 0 holds key s of every KV head.
    cache = tilegen.PagedKVCache(
        kd[0].transpose(0, 1).unsqueeze(0).contiguous(), vd[0].transpose(0, 1).unsqueeze(0).contiguous(),
        torch.tensor([0, 1], dtype=torch.int32, device=device), torch.tensor([0], dtype=torch.int32, device=device),
        torch.tensor([16], dtype=torch.int32, device=device))
    qp, kp, vp = rand(1, 8, 512, 64), rand(1, 8, 512, 64), rand(1, 8, 512, 64)
    q_run = qd[:, :, 0].contiguous()
    out_run = torch.empty_like(q_run)

    rows = []
    for tag, context in (("", contextlib.nullcontext), (" (JIT launch)", _jit_launches)):
        decoder = tilegen.PagedDecode()
        with context():
            decoder.plan(cache, heads_q=32, max_seqlen_k=16)
        rows += [
            {"shape": DENSE, "provider": f"tilegen.attention{tag}", "call": lambda: tilegen.attention(q, k, v),
             "context": context},
            {"shape": DENSE, "provider": f"tilegen.attention out={tag}",
             "call": lambda: tilegen.attention(q, k, v, out=out), "context": context},
            {"shape": DECODE, "provider": f"tilegen.attention{tag}", "call": lambda: tilegen.attention(qd, kd, vd),
             "context": context},
            # The [batch, heads, head_dim] query as PagedDecode takes it, no reshaping in the timed call.
            {"shape": DECODE, "provider": f"PagedDecode.run{tag}",
             "call": lambda decoder=decoder: decoder.run(q_run, cache), "context": context, "token_dim": False},
            {"shape": DECODE, "provider": f"PagedDecode.run out={tag}",
             "call": lambda decoder=decoder: decoder.run(q_run, cache, out=out_run), "context": context,
             "token_dim": False},
            {"shape": PREFILL, "provider": f"tilegen.attention{tag}", "call": lambda: tilegen.attention(qp, kp, vp),
             "context": context},
        ]
    rows += _mask_rows(rand, device, q, k, v)
    if device == "cuda":
        for backend, name in (("FLASH_ATTENTION", "SDPA flash"), ("CUDNN_ATTENTION", "SDPA cuDNN")):
            rows.append({"shape": DENSE, "provider": name, "call": lambda: F.scaled_dot_product_attention(q, k, v),
                         "context": _sdpa_backend(backend)})
            rows.append({"shape": DECODE, "provider": name,
                         "call": lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True),
                         "context": _sdpa_backend(backend)})
            rows.append({"shape": PREFILL, "provider": name, "call": lambda: F.scaled_dot_product_attention(qp, kp, vp),
                         "context": _sdpa_backend(backend)})
    references = {DENSE: F.scaled_dot_product_attention(q.float(), k.float(), v.float()),
                  DECODE: F.scaled_dot_product_attention(qd.float(), kd.float(), vd.float(), enable_gqa=True),
                  PREFILL: F.scaled_dot_product_attention(qp.float(), kp.float(), vp.float())}
    for row in rows:
        reference = references.get(row["shape"])
        row.setdefault("reference", reference if row.pop("token_dim", True) else reference[:, :, 0])
    return rows


def _mask_rows(rand, device: str, q, k, v) -> list[dict]:
    """Every other call a model makes, on the dense shape: each mask and option, GQA, a ragged batch and a
    paged prefill of the same 16 tokens (two sequences, 7 and 9), each beside SDPA flash with that mask
    (causal where SDPA has no such mask: its host cost does not depend on the mask)."""
    n = q.shape[2]
    keep = torch.ones(n, n, dtype=torch.bool, device=device)
    causal_mask, window_mask = keep.tril(), keep.tril() & keep.triu(-8)
    kg, vg = rand(1, 2, n, 64), rand(1, 2, n, 64)
    cu = torch.tensor([0, 7, 16], dtype=torch.int32, device=device)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, kg, vg)]  # [tokens, heads, dim]
    pages = [t.view(1, n, 2, 64) for t in packed[1:]]  # both sequences' keys in one page of 16
    cache = tilegen.PagedKVCache(*pages, torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
                                 torch.tensor([0, 0], dtype=torch.int32, device=device),
                                 torch.tensor([7, 16], dtype=torch.int32, device=device))
    # Both sequences' page tables point at that page: sequence 0 keeps keys 0..6, sequence 1 all 16, its 9
    # queries aligned bottom-right (a chunk appended after 7 cached tokens).
    prefill = tilegen.PagedAttention()
    prefill.plan(cu, cache, heads_q=8, causal=True, max_seqlen_q=9, max_seqlen_k=16)

    def softcapped(qf, kf, vf, cap=30.0):
        s = qf @ kf.transpose(-1, -2) / qf.shape[-1] ** 0.5
        return (cap * torch.tanh(s / cap)).softmax(-1) @ vf

    qf, kf, vf, kgf, vgf = (t.float() for t in (q, k, v, kg, vg))
    ragged_ref = torch.cat([F.scaled_dot_product_attention(
        qf[:, :, a:b], kgf[:, :, a:b], vgf[:, :, a:b], is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        for a, b in ((0, 7), (7, 16))])
    paged_keys = ((0, 7), (0, 16))
    paged_ref = torch.cat([F.scaled_dot_product_attention(
        qf[:, :, a:b], kgf[:, :, ka:kb], vgf[:, :, ka:kb], is_causal=False, enable_gqa=True,
        attn_mask=torch.ones(b - a, kb - ka, dtype=torch.bool, device=device).tril(kb - ka - (b - a)))[0].transpose(0, 1)
        for (a, b), (ka, kb) in zip(((0, 7), (7, 16)), paged_keys)])
    q_packed, k_packed, v_packed = packed
    dense = f"dense 1x8x{n}x64"
    rows = [
        {"shape": f"{dense} causal", "provider": "tilegen.attention",
         "call": lambda: tilegen.attention(q, k, v, causal=True),
         "reference": F.scaled_dot_product_attention(qf, kf, vf, attn_mask=causal_mask)},
        {"shape": f"{dense} window (8, 0)", "provider": "tilegen.attention",
         "call": lambda: tilegen.attention(q, k, v, window=(8, 0)),
         "reference": F.scaled_dot_product_attention(qf, kf, vf, attn_mask=window_mask)},
        {"shape": f"{dense} softcap 30", "provider": "tilegen.attention",
         "call": lambda: tilegen.attention(q, k, v, softcap=30.0), "reference": softcapped(qf, kf, vf)},
        {"shape": f"{dense} causal, LSE", "provider": "tilegen.attention",
         "call": lambda: tilegen.attention(q, k, v, causal=True, return_lse=True)[0],
         "reference": F.scaled_dot_product_attention(qf, kf, vf, attn_mask=causal_mask)},
        {"shape": f"{dense} GQA 8/2 causal", "provider": "tilegen.attention",
         "call": lambda: tilegen.attention(q, kg, vg, causal=True),
         "reference": F.scaled_dot_product_attention(qf, kgf, vgf, attn_mask=causal_mask, enable_gqa=True)},
        {"shape": "ragged 7+9 tokens, 8/2 heads causal", "provider": "tilegen.varlen_attention",
         "call": lambda: tilegen.varlen_attention(q_packed, k_packed, v_packed, cu, cu, 9, 9, causal=True),
         "reference": ragged_ref},
        {"shape": "ragged 7+9 tokens, 8/2 heads causal", "provider": "PagedAttention.run",
         "call": lambda: prefill.run(q_packed, cache), "reference": paged_ref},
    ]
    # What a transformers model's attention call costs through the integration (its AttentionInterface
    # function, no mask: the causal prefill), beside the op it calls on the same tensors: q, k and v as
    # transformers makes them, transposed views of [batch, n, heads, head_dim] projections.
    from tilegen.integrations.transformers import attention_forward

    module = torch.nn.Module()
    module.is_causal = True
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, kg, vg))
    layout = f"{dense} GQA 8/2 causal, q/k/v transposed views"
    gqa = rows[4]["reference"]
    rows += [
        {"shape": layout, "provider": "tilegen.attention", "call": lambda: tilegen.attention(qt, kt, vt, causal=True),
         "reference": gqa},
        {"shape": layout, "provider": "tilegen via transformers' AttentionInterface",
         "call": lambda: attention_forward(module, qt, kt, vt, None)[0], "reference": gqa.transpose(1, 2)},
    ]
    # The ragged batch as a padded one, transformers' way: [2, heads, 9, dim] views, the first sequence right-padded,
    # and a 2-d padding mask, the same object at every call (as every layer of one forward gets it: the first
    # builds the ragged layout, the rest reuse it).
    padding = torch.zeros(2, 9, dtype=torch.bool, device=device)
    padding[0, :7] = padding[1] = True

    def padded(t):
        rows = t.new_zeros(2, 9, *t.shape[1:])
        rows[0, :7], rows[1] = t[:7], t[7:]
        return rows.transpose(1, 2)

    qp, kp, vp = (padded(t) for t in packed)
    rows.append({"shape": "ragged 7+9 tokens, 8/2 heads causal", "provider": "tilegen via transformers' "
                 "AttentionInterface, padded 2 x 9", "call": lambda: attention_forward(module, qp, kp, vp, padding)[0],
                 "reference": padded(ragged_ref).transpose(1, 2)})
    # The op that call runs, on the same tensors and the offsets the integration makes of the mask: the integration's
    # own host time is the difference.
    from tilegen.integrations import transformers as integration
    from tilegen.ops.varlen import varlen_attention_padded

    runs = integration._padding_layout(padding, 9, 9, True)
    rows.append({"shape": "ragged 7+9 tokens, 8/2 heads causal", "provider": "varlen_attention_padded, padded 2 x 9 "
                 "(the op the integration runs)",
                 "call": lambda: varlen_attention_padded(qp, kp, vp, runs.cu_q, runs.cu_k, runs.max_q, runs.max_k,
                                                         causal=True),
                 "reference": padded(ragged_ref).transpose(1, 2)})
    # A decoding step of the same two sequences, left-padded as transformers' generate pads them: one query each
    # against 9 cached keys in a cache's [batch, kv_heads, n, head_dim] layout, the first row's 2 keys padding.
    left = torch.ones(2, 9, dtype=torch.bool, device=device)
    left[0, :2] = False
    q_step = q[:, :, 6:8].transpose(0, 2).transpose(1, 2).contiguous().transpose(1, 2)  # [2, 8, 1, 64]
    k_cache, v_cache = (t[0, :, 7:16].expand(2, -1, -1, -1).contiguous() for t in (kg, vg))  # [2, 2, 9, 64]
    step_mask = left[:, None, None, :]
    step_ref = F.scaled_dot_product_attention(q_step.float(), k_cache.float(), v_cache.float(), attn_mask=step_mask,
                                              enable_gqa=True).transpose(1, 2)
    rows.append({"shape": "decode step, 2 x 1 query over 7 and 9 keys, 8/2 heads", "provider": "tilegen via "
                 "transformers' AttentionInterface, left-padded 2 x 9",
                 "call": lambda: attention_forward(module, q_step, k_cache, v_cache, left)[0], "reference": step_ref})
    # PagedDecode.run on that cache seen as the integration sees it (pages of one slot, its page table): the op.
    k_slots, slots_a_row = integration._slots(k_cache, 9)
    slot_cache = tilegen.PagedKVCache(k_slots, integration._slots(v_cache, 9)[0],
                                      *integration._slot_table(left, 1, 9, (slots_a_row, None)).pages)
    step_decode = tilegen.PagedDecode()
    step_decode.plan(slot_cache, heads_q=8, max_seqlen_k=9, q_dtype=DTYPE)
    q_token = q_step.select(2, 0)
    rows.append({"shape": "decode step, 2 x 1 query over 7 and 9 keys, 8/2 heads", "provider": "PagedDecode.run on "
                 "the one-slot pages (the op the integration runs)", "call": lambda: step_decode.run(q_token, slot_cache),
                 "reference": step_ref[:, 0]})
    for row in rows:
        row["context"] = contextlib.nullcontext
    if device == "cuda":
        flash = _sdpa_backend("FLASH_ATTENTION")
        for shape, call in (
            (f"{dense} causal", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
            (f"{dense} GQA 8/2 causal", lambda: F.scaled_dot_product_attention(q, kg, vg, is_causal=True,
                                                                               enable_gqa=True)),
        ):
            rows.append({"shape": shape, "provider": "SDPA flash", "call": call, "context": flash,
                         "reference": next(r["reference"] for r in rows if r["shape"] == shape)})
        # The LSE call's own peer: FlashAttention's op, which SDPA flash calls and which returns the LSE too, through
        # its direct binding (SDPA's public call returns no LSE).
        shape = f"{dense} causal, LSE"
        rows.append({"shape": shape, "provider": "torch._scaled_dot_product_flash_attention (out, LSE)",
                     "call": lambda: torch._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0],
                     "context": contextlib.nullcontext,
                     "reference": next(r["reference"] for r in rows if r["shape"] == shape)})
        varlen = _varlen_peer(q_packed, k_packed, v_packed, cu, 9)
        if varlen is not None:
            rows.append({"shape": "ragged 7+9 tokens, 8/2 heads causal", "provider": "torch varlen_attn",
                         "call": varlen, "context": contextlib.nullcontext, "reference": ragged_ref})
    return rows


def _varlen_peer(q, k, v, cu, longest: int):
    """A causal call of torch's own varlen attention (FlashAttention's kernel; torch 2.10 and later) on the
    packed batch, if this torch has it. Its keywords changed between releases: causal is ``is_causal`` in
    2.10, ``window_size=(-1, 0)`` later; GQA (``enable_gqa``) came in 2.12, before which K and V are repeated."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        causal["enable_gqa"] = True
    else:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    return lambda: varlen_attn(q, k, v, cu, cu, longest, longest, **causal)


def _no_launch(replay, key, *args) -> None:
    """``Replay.__call__`` under ``--no-launch``."""


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _round(call, calls: int, device: str) -> tuple[float, float]:
    """(host us per call, synchronized us per call) of one round."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    issued = time.perf_counter()
    _sync(device)
    return (issued - start) / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--calls", type=int, default=200, help="calls per round (few: the launch queue never fills)")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--no-launch", action="store_true",
                        help="after the checks, tilegen's launches do nothing: each tilegen row times the Python of "
                             "its call alone, the host cost tilegen's own code adds (on a CPU too, under the "
                             "interpreter); the peers' rows are unchanged")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if not interpreting():
            sys.exit("no GPU: run under TRITON_INTERPRET=1, which only checks the script")
        if not args.no_launch:  # the interpreter's launches take milliseconds: nothing to time
            args.calls, args.rounds = 2, 2

    rows = _rows(device)
    for row in rows:  # checked first; these calls also compile, plan and record every row
        with row["context"]():
            for _ in range(10):
                result = row["call"]().float()
        reference = row["reference"]
        row["rel_err"] = float((result - reference).abs().max() / reference.abs().max())
        assert row["rel_err"] < 2e-2, f"{row['shape']} {row['provider']}: relative error {row['rel_err']:.2e}"
        row["rounds"] = []
    # Every tilegen launch goes through a plan's Replay, the JIT rows' too.
    replay = launch.Replay.__call__
    if args.no_launch:
        launch.Replay.__call__ = _no_launch
    try:
        for _ in range(args.rounds):
            for row in rows:
                with row["context"]():
                    row["rounds"].append(_round(row["call"], args.calls, device))
    finally:
        launch.Replay.__call__ = replay

    results = []
    for row in rows:
        host = [h for h, _ in row["rounds"]]
        results.append({"shape": row["shape"], "provider": row["provider"], "host_us_median": statistics.median(host),
                        "host_us_min": min(host), "synced_us_median": statistics.median(s for _, s in row["rounds"]),
                        "rel_err": row["rel_err"]})
    name = torch.cuda.get_device_name() if device == "cuda" else \
        "cpu (interpreter)" if args.no_launch else "cpu (interpreter: times mean nothing)"
    import triton

    print(f"{name}; torch {torch.__version__}, Triton {triton.__version__}; {args.rounds} rounds of {args.calls} "
          f"calls; direct launches: {launch.support() or 'on'}"
          f"{'; tilegen launches nothing (--no-launch)' if args.no_launch else ''}")
    print("| shape | provider | host us/call (median) | fastest round | synchronized us/call |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['provider']} | {r['host_us_median']:.1f} | {r['host_us_min']:.1f} | "
              f"{r['synced_us_median']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__,
                       "rounds": args.rounds, "calls": args.calls, "no_launch": args.no_launch, "rows": results},
                      f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
