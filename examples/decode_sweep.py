"""Paged decode on a GPU: every config and split count, NHD against HND pages, SDPA in the same run.

    OUT=dir BUDGET=300 python examples/decode_sweep.py

Each shape's keys are stored once in the cache's NHD layout ([pages, page_size, kv_heads, dim])
and, for GQA, once head-major ([pages, kv_heads, page_size, dim], passed transposed: the kernel
reads any strides). Every config of the decode search space (BN x warps x stages) runs at the
split counts the rule gives for 1-8 CTAs per SM, through the generated module's launcher, each
checked against a float32 reference before it is timed. GB/s of K and V read; writes
``$OUT/decode_explore.json``. Without a GPU it runs one tiny case under the interpreter.
"""
import itertools, json, math, os, sys, time
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tilegen.codegen.cache import module_for
from tilegen.families.attention_decode.spec import DecodeSpec
from tilegen.families.attention_decode.problem import decode_buffers
from tilegen.families import relative_error

OUT = os.environ.get("OUT", "/tmp")
T0 = time.time()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BUDGET = float(os.environ.get("BUDGET", "330"))


def bench(fn):
    return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))


def splits_for(ctas, batch, hkv, ctx, bn, cap):
    programs = batch * hkv
    return max(1, min(math.ceil(132 * ctas / programs), math.ceil(ctx / bn), cap))


CASES = [  # hq, hkv, d, batch, ctx, page, layouts, split cap
    (32, 8, 128, 64, 4096, 16, ("NHD", "HND"), 64),
    (32, 8, 128, 1, 131072, 16, ("NHD", "HND"), 64),
    (32, 8, 128, 4, 65536, 16, ("NHD", "HND"), 64),
    (32, 8, 128, 256, 1024, 16, ("NHD", "HND"), 64),
    (32, 1, 128, 64, 4096, 16, ("NHD",), 128),
    (32, 1, 128, 1, 131072, 16, ("NHD",), 128),
    (32, 8, 128, 64, 4096, 1, ("NHD",), 64),
]
CONFIGS = [c for c in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)) if not (c[0] == 128 and c[2] == 4)]
if DEV == "cpu":
    CASES = [(8, 2, 128, 2, 64, 16, ("NHD", "HND"), 64)]
    CONFIGS = [(32, 4, 1)]
    bench = lambda fn: (fn(), 1.0)[1]
    triton.testing.do_bench = lambda fn, **kw: (fn(), 1.0)[1]
rows = []
gen = torch.Generator(DEV).manual_seed(0)
for hq, hkv, d, batch, ctx, ps, layouts, cap in CASES:
    k = torch.randn(batch, hkv, ctx, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, 1, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    gb = 2 * batch * hkv * ctx * d * 2 / 1e9
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    peers = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(be if DEV == "cuda" else SDPBackend.MATH):
            peers[name] = gb / float(triton.testing.do_bench(
                lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), warmup=25, rep=100,
                return_mode="median")) * 1e3
    pages_per = ctx // ps
    n = batch * pages_per
    perm = torch.randperm(n, device=DEV, generator=gen).to(torch.int32)
    indptr = torch.arange(0, n + 1, pages_per, device=DEV, dtype=torch.int32)
    last = torch.full((batch,), ps, device=DEV, dtype=torch.int32)
    spec = DecodeSpec(head_dim=d, q_per_kv=hq // hkv, dtype="bf16", page_size=ps)
    mod = module_for(spec)
    out = torch.empty(batch, hq, 1, d, device=DEV, dtype=torch.bfloat16)
    case = {"hq": hq, "hkv": hkv, "batch": batch, "ctx": ctx, "page": ps, "peers": peers, "results": []}
    print(f"== {hq}/{hkv} {batch}x{ctx} page {ps}: flash {peers['flash']:.0f} cudnn {peers['cudnn']:.0f}", flush=True)
    for layout in layouts:
        if layout == "NHD":
            kp = torch.empty(n, ps, hkv, d, device=DEV, dtype=torch.bfloat16); vp = torch.empty_like(kp)
            kp[perm.long()] = k.permute(0, 2, 1, 3).reshape(n, ps, hkv, d)
            vp[perm.long()] = v.permute(0, 2, 1, 3).reshape(n, ps, hkv, d)
        else:
            kh = torch.empty(n, hkv, ps, d, device=DEV, dtype=torch.bfloat16); vh = torch.empty_like(kh)
            kh[perm.long()] = k.view(batch, hkv, pages_per, ps, d).permute(0, 2, 1, 3, 4).reshape(n, hkv, ps, d)
            vh[perm.long()] = v.view(batch, hkv, pages_per, ps, d).permute(0, 2, 1, 3, 4).reshape(n, hkv, ps, d)
            kp, vp = kh.transpose(1, 2), vh.transpose(1, 2)
        best = None
        for bn, w, st in CONFIGS:
            if time.time() - T0 > BUDGET:
                break
            seen = set()
            for ctas in (1, 2, 3, 4, 6, 8):
                s = splits_for(ctas, batch, hkv, ctx, bn, cap)
                if s in seen:
                    continue
                seen.add(s)
                chunk = math.ceil(ctx / s / bn) * bn
                po, pl = decode_buffers(batch, hq, d, s, DEV)

                def run():
                    mod.launch(q, kp, vp, out, out, po, pl, indptr, perm, last, chunk=chunk, num_splits=s,
                               scale=1 / math.sqrt(d), softcap=0.0, window_left=ctx + 1, window_right=ctx + 1,
                               block_n=bn, num_warps=w, num_stages=st)
                try:
                    out.fill_(float("nan"))
                    run()
                    err = relative_error(out.float(), ref)[0]
                    if not err < 1e-2:
                        print("BAD", layout, bn, w, st, s, err, flush=True)
                        continue
                    gbs = gb / bench(run) * 1e3
                except Exception as e:
                    print("FAIL", layout, bn, w, st, s, type(e).__name__, str(e)[:100], flush=True)
                    continue
                r = {"layout": layout, "config": f"BN{bn}-w{w}-s{st}", "ctas": ctas, "splits": s, "gbs": gbs}
                case["results"].append(r)
                if best is None or gbs > best["gbs"]:
                    best = r
        print(f"   {layout}: best {best}", flush=True)
        top = sorted((r for r in case["results"] if r["layout"] == layout), key=lambda r: -r["gbs"])[:5]
        for r in top:
            print("     ", r, flush=True)
        del kp, vp
    rows.append(case)
    json.dump(rows, open(f"{OUT}/decode_explore.json", "w"), indent=1)
    del k, v, q, ref
    torch.cuda.empty_cache()
print("elapsed", time.time() - T0)
