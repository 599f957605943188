"""Decode on a GPU for other head layouts (MQA 32/1, MHA 32/32, head dim 64), and a CUDA graph.

    python examples/decode_layouts.py out.json

PagedDecode (page 16) and the dense route of tilegen.attention against SDPA flash and cuDNN,
in one run, GB/s of K and V read; then 32 layers of PagedDecode.run at 64 x 4096 captured in
one CUDA graph, its time per layer on replay against one eager launch's.
"""
import json, sys, time
import torch, triton
import torch.nn.functional as F
import tilegen
from tilegen.families import relative_error
from torch.nn.attention import SDPBackend, sdpa_kernel

def bench(fn):
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

def make(batch, hq, hkv, ctx, d, ps, gen):
    k = torch.randn(batch, hkv, ctx, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    pages_per = ctx // ps
    n = batch * pages_per
    perm = torch.randperm(n, device="cuda", generator=gen).to(torch.int32)
    kp = torch.empty(n, ps, hkv, d, device="cuda", dtype=torch.bfloat16); vp = torch.empty_like(kp)
    kp[perm.long()] = k.permute(0, 2, 1, 3).reshape(n, ps, hkv, d)
    vp[perm.long()] = v.permute(0, 2, 1, 3).reshape(n, ps, hkv, d)
    cache = tilegen.PagedKVCache.from_block_table(kp, vp, perm.view(batch, pages_per), torch.full((batch,), ctx, device="cuda"))
    return q, k, v, cache

rows = []
gen = torch.Generator("cuda").manual_seed(0)
for name, hq, hkv, d in (("mqa 32/1 d128", 32, 1, 128), ("mha 32/32 d128", 32, 32, 128), ("gqa 32/8 d64", 32, 8, 64)):
    for batch, ctx in ((64, 4096), (1, 131072)):
        q, k, v, cache = make(batch, hq, hkv, ctx, d, 16, gen)
        dec = tilegen.PagedDecode(); ch = dec.plan(cache, heads_q=hq, max_seqlen_k=ctx)
        qs = q[:, :, 0].contiguous()
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[:, :, 0]
        gb = 2 * batch * hkv * ctx * d * 2 / 1e9
        row = {"case": name, "batch": batch, "ctx": ctx, "splits": dec.num_splits, "config": str(ch.config),
               "err": relative_error(dec.run(qs, cache).float(), ref.float())[0],
               "paged": gb / bench(lambda: dec.run(qs, cache)) * 1e3,
               "dense": gb / bench(lambda: tilegen.attention(q, k, v)) * 1e3,
               "dense_err": relative_error(tilegen.attention(q, k, v)[:, :, 0].float(), ref.float())[0]}
        for bn, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    row[bn] = gb / bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)) * 1e3
            except Exception as e:
                row[bn] = str(e)[:60]
        print(json.dumps(row), flush=True); rows.append(row)
        del q, k, v, cache; torch.cuda.empty_cache()

# 32 layers of 64 x 4096, page 16: graph replay vs eager per-layer kernel time.
L, batch, ctx = 32, 64, 4096
caches, qs = [], []
for _ in range(L):
    q, k, v, cache = make(batch, 32, 8, ctx, 128, 16, gen)
    caches.append(cache); qs.append(q[:, :, 0].contiguous()); del k, v
dec = tilegen.PagedDecode(); dec.plan(caches[0], heads_q=32, max_seqlen_k=ctx)
outs = [torch.empty_like(x) for x in qs]
def step():
    for l in range(L):
        dec.run(qs[l], caches[l], out=outs[l])
eager_one = bench(lambda: dec.run(qs[0], caches[0], out=outs[0]))
eager_all = bench(step)
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    step()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    step()
g.replay(); torch.cuda.synchronize()
ref0 = dec.run(qs[5], caches[5])
for o in outs: o.fill_(float("nan"))
g.replay(); torch.cuda.synchronize()
graph_ok = bool(torch.equal(outs[5], ref0))
graph_all = bench(lambda: g.replay())
# Host-side per-layer time: eager loop wall time with sync only at the end.
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): step()
torch.cuda.synchronize(); wall = (time.perf_counter() - t) / 20
g_row = {"layers": L, "eager_one_ms": eager_one, "eager_loop_per_layer_ms": eager_all / L,
         "graph_per_layer_ms": graph_all / L, "graph_over_eager_one": graph_all / L / eager_one,
         "graph_output_matches": graph_ok, "eager_wall_per_layer_ms": wall / L}
print(json.dumps(g_row), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "graph": g_row}, open(sys.argv[1], "w"), indent=1)
