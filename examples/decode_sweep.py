"""Paged decode on a GPU: every config and split count, NHD against HND pages, SDPA in the same run.

    OUT=dir BUDGET=300 python examples/decode_sweep.py

Each shape's keys are stored once in the cache's NHD layout ([pages, page_size, kv_heads, dim])
and, for GQA, once head-major ([pages, kv_heads, page_size, dim], passed transposed: the kernel
reads any strides). Every config of the decode search space (BN x warps x stages) runs at the
split counts the rule gives for 1-8 CTAs per SM, through the generated module's launcher, each
checked against a float32 reference before it is timed. GB/s of K and V read; writes
``$OUT/decode_explore.json`` (``OUT`` default /tmp, made if missing); stops starting configs after ``$BUDGET``
seconds (default 330). Without a GPU it runs one tiny case under the interpreter (``TRITON_INTERPRET=1``), timing
nothing: its GB/s are null.
"""

import functools
import itertools
import json
import math
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    # The one tiny case runs under the interpreter, which must be on before Triton loads: without it
    # every launch of CPU tensors failed, one error line per config.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from tilegen.codegen.cache import module_for  # noqa: E402
from tilegen.device import device_info  # noqa: E402
from tilegen.families import relative_error  # noqa: E402
from tilegen.families.attention_decode.config import DecodeConfig, split_count  # noqa: E402
from tilegen.families.attention_decode.problem import decode_buffers  # noqa: E402
from tilegen.families.attention_decode.spec import DecodeSpec  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
#: hq, hkv, head dim, batch, context, page size, layouts, split cap
CASES = [
    (32, 8, 128, 64, 4096, 16, ("NHD", "HND"), 64),
    (32, 8, 128, 1, 131072, 16, ("NHD", "HND"), 64),
    (32, 8, 128, 4, 65536, 16, ("NHD", "HND"), 64),
    (32, 8, 128, 256, 1024, 16, ("NHD", "HND"), 64),
    (32, 1, 128, 64, 4096, 16, ("NHD",), 128),
    (32, 1, 128, 1, 131072, 16, ("NHD",), 128),
    (32, 8, 128, 64, 4096, 1, ("NHD",), 64),
] if ON_GPU else [(8, 2, 128, 2, 64, 16, ("NHD", "HND"), 64)]
CONFIGS = [c for c in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
           if not (c[0] == 128 and c[2] == 4)] if ON_GPU else [(32, 4, 1)]


def gbs_of(fn, gb, warmup=5, rep=25) -> float | None:
    """GB/s of ``gb`` read in ``do_bench``'s median; under the interpreter one call and None (it times nothing)."""
    if not ON_GPU:
        fn()
        return None
    return gb / float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")) * 1e3


def shown(gbs: float | None) -> str:
    return "-" if gbs is None else f"{gbs:.0f}"


def pages_of(k, v, perm, layout, ps):
    """K and V of ``[batch, hkv, ctx, d]`` in shuffled pages, as the kernel's [pages, page_size, hkv, d] view."""
    batch, hkv, ctx, d = k.shape
    n = batch * (ctx // ps)
    if layout == "NHD":
        kp, vp = torch.empty(n, ps, hkv, d, device=DEV, dtype=k.dtype), torch.empty(n, ps, hkv, d, device=DEV,
                                                                                      dtype=k.dtype)
        kp[perm.long()] = k.permute(0, 2, 1, 3).reshape(n, ps, hkv, d)
        vp[perm.long()] = v.permute(0, 2, 1, 3).reshape(n, ps, hkv, d)
        return kp, vp
    kh, vh = torch.empty(n, hkv, ps, d, device=DEV, dtype=k.dtype), torch.empty(n, hkv, ps, d, device=DEV,
                                                                                 dtype=k.dtype)
    kh[perm.long()] = k.view(batch, hkv, ctx // ps, ps, d).permute(0, 2, 1, 3, 4).reshape(n, hkv, ps, d)
    vh[perm.long()] = v.view(batch, hkv, ctx // ps, ps, d).permute(0, 2, 1, 3, 4).reshape(n, hkv, ps, d)
    return kh.transpose(1, 2), vh.transpose(1, 2)


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp")
    try:
        budget = float(os.environ.get("BUDGET", "330"))
    except ValueError:
        sys.exit(f"error: BUDGET: expected a number of seconds, got {os.environ['BUDGET']!r}")
    # Made up front: a missing folder would otherwise fail the first write, after the first case's work.
    os.makedirs(out_dir, exist_ok=True)
    device = device_info()
    start = time.time()
    rows = []
    gen = torch.Generator(DEV).manual_seed(0)
    for hq, hkv, d, batch, ctx, ps, layouts, cap in CASES:
        k = torch.randn(batch, hkv, ctx, d, device=DEV, dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        q = torch.randn(batch, hq, 1, d, device=DEV, dtype=torch.bfloat16, generator=gen)
        gb = 2 * batch * hkv * ctx * d * 2 / 1e9
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        peers = {}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel(backend if ON_GPU else SDPBackend.MATH):
                sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True)
                peers[name] = gbs_of(sdpa, gb, warmup=25, rep=100)
        n = batch * (ctx // ps)
        perm = torch.randperm(n, device=DEV, generator=gen).to(torch.int32)
        indptr = torch.arange(0, n + 1, ctx // ps, device=DEV, dtype=torch.int32)
        last = torch.full((batch,), ps, device=DEV, dtype=torch.int32)
        module = module_for(DecodeSpec(head_dim=d, q_per_kv=hq // hkv, dtype="bf16", page_size=ps))
        out = torch.empty(batch, hq, 1, d, device=DEV, dtype=torch.bfloat16)
        case = {"hq": hq, "hkv": hkv, "batch": batch, "ctx": ctx, "page": ps, "peers": peers, "results": []}
        print(f"== {hq}/{hkv} {batch}x{ctx} page {ps}: flash {shown(peers['flash'])} cudnn {shown(peers['cudnn'])}",
              flush=True)
        for layout in layouts:
            kp, vp = pages_of(k, v, perm, layout, ps)
            for bn, warps, stages in CONFIGS:
                if time.time() - start > budget:
                    break
                # The split rule's counts for 1-8 CTAs per SM, capped per case: 64 splits for GQA, 128 for MQA.
                counts = (min(cap, split_count(DecodeConfig(bn, warps, stages, ctas), device, batch, hkv, ctx))
                          for ctas in (1, 2, 3, 4, 6, 8))
                for s in dict.fromkeys(counts):
                    run = functools.partial(
                        module.launch, q, kp, vp, out, out, *decode_buffers(batch, hq, d, s, DEV), indptr, perm, last,
                        chunk=math.ceil(ctx / s / bn) * bn, num_splits=s, scale=1 / math.sqrt(d), softcap=0.0,
                        window_left=ctx + 1, window_right=ctx + 1, block_n=bn, num_warps=warps, num_stages=stages)
                    try:
                        out.fill_(float("nan"))
                        run()
                        error = relative_error(out.float(), ref)[0]
                        if not error < 1e-2:
                            print("wrong:", layout, bn, warps, stages, s, error, flush=True)
                            continue
                        gbs = gbs_of(run, gb)
                    except Exception as e:  # noqa: BLE001 - a config the compiler rejects is reported
                        print("failed:", layout, bn, warps, stages, s, type(e).__name__, str(e)[:100], flush=True)
                        continue
                    case["results"].append({"layout": layout, "config": f"BN{bn}-w{warps}-s{stages}", "splits": s,
                                            "gbs": gbs})
            top = sorted((r for r in case["results"] if r["layout"] == layout), key=lambda r: -(r["gbs"] or 0))[:5]
            print(f"   {layout}: best {top[:1]}", flush=True)
            for r in top[1:]:
                print("     ", r, flush=True)
        rows.append(case)
        with open(f"{out_dir}/decode_explore.json", "w") as f:
            json.dump(rows, f, indent=1)
        del k, v, q, ref
        if ON_GPU:
            torch.cuda.empty_cache()
    print(f"elapsed {time.time() - start:.0f} s")
    if not any(case["results"] for case in rows):
        sys.exit("error: no config ran correctly (see the lines above); nothing to compare")


if __name__ == "__main__":
    main()
