"""Decode on a GPU for other head layouts (MQA 32/1, MHA 32/32, head dim 64), and a CUDA graph.

    python examples/decode_layouts.py out.json

PagedDecode (page 16, shuffled pages) and the dense route of tilegen.attention against SDPA
flash and cuDNN on the same keys, in one run, GB/s of K and V read (``do_bench`` medians);
each checked against SDPA first. Then 32 layers of PagedDecode.run at 64 x 4096 (GQA 32/8,
d128), each with its own cache, captured in one CUDA graph: its time per layer on replay
against one eager launch's, and whether a replay writes what an eager run writes.
"""

import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import tilegen
from tilegen.families import relative_error

LAYOUTS = (("mqa 32/1 d128", 32, 1, 128), ("mha 32/32 d128", 32, 32, 128), ("gqa 32/8 d64", 32, 8, 64))
SHAPES = ((64, 4096), (1, 131072))
LAYERS = 32


def timed(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def make(batch, hq, hkv, ctx, d, page, gen):
    """q ``[batch, hq, 1, d]``, contiguous K and V, and a PagedKVCache of the same keys in shuffled pages."""
    k = torch.randn(batch, hkv, ctx, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    per = ctx // page
    perm = torch.randperm(batch * per, device="cuda", generator=gen).to(torch.int32)
    k_pages = torch.empty(batch * per, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_pages = torch.empty_like(k_pages)
    k_pages[perm.long()] = k.permute(0, 2, 1, 3).reshape(batch * per, page, hkv, d)
    v_pages[perm.long()] = v.permute(0, 2, 1, 3).reshape(batch * per, page, hkv, d)
    cache = tilegen.PagedKVCache.from_block_table(k_pages, v_pages, perm.view(batch, per),
                                                  torch.full((batch,), ctx, device="cuda"))
    return q, k, v, cache


def layouts(gen) -> list[dict]:
    rows = []
    for name, hq, hkv, d in LAYOUTS:
        for batch, ctx in SHAPES:
            rows.append(one_layout(name, hq, hkv, d, batch, ctx, gen))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    return rows


def one_layout(name, hq, hkv, d, batch, ctx, gen) -> dict:
    q, k, v, cache = make(batch, hq, hkv, ctx, d, 16, gen)
    decode = tilegen.PagedDecode()
    choice = decode.plan(cache, heads_q=hq, max_seqlen_k=ctx)
    q_step = q[:, :, 0].contiguous()
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[:, :, 0]
    gb = 2 * batch * hkv * ctx * d * 2 / 1e9
    row = {"case": name, "batch": batch, "ctx": ctx, "splits": decode.num_splits, "config": str(choice.config),
           "err": relative_error(decode.run(q_step, cache).float(), ref.float())[0],
           "paged": gb / timed(lambda: decode.run(q_step, cache)) * 1e3,
           "dense": gb / timed(lambda: tilegen.attention(q, k, v)) * 1e3,
           "dense_err": relative_error(tilegen.attention(q, k, v)[:, :, 0].float(), ref.float())[0]}
    for peer, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                row[peer] = gb / timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)) * 1e3
        except Exception as e:  # noqa: BLE001 - a backend missing on this GPU/torch is reported
            row[peer] = str(e)[:60]
    return row


def graph(gen) -> dict:
    caches, queries = [], []
    for _ in range(LAYERS):
        q, _, _, cache = make(64, 32, 8, 4096, 128, 16, gen)
        caches.append(cache)
        queries.append(q[:, :, 0].contiguous())
    decode = tilegen.PagedDecode()
    decode.plan(caches[0], heads_q=32, max_seqlen_k=4096)
    outs = [torch.empty_like(x) for x in queries]

    def step():
        for layer in range(LAYERS):
            decode.run(queries[layer], caches[layer], out=outs[layer])

    eager_one = timed(lambda: decode.run(queries[0], caches[0], out=outs[0]))
    eager_all = timed(step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up off the capture stream, as CUDA graphs require
    torch.cuda.current_stream().wait_stream(side)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        step()
    expected = decode.run(queries[5], caches[5])
    for out in outs:
        out.fill_(float("nan"))
    captured.replay()
    torch.cuda.synchronize()
    matches = bool(torch.equal(outs[5], expected))
    replay = timed(captured.replay)
    return {"layers": LAYERS, "eager_one_ms": eager_one, "eager_loop_per_layer_ms": eager_all / LAYERS,
            "graph_per_layer_ms": replay / LAYERS, "graph_over_eager_one": replay / LAYERS / eager_one,
            "graph_output_matches": matches}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("examples/decode_layouts.py times CUDA kernels; run it on a GPU")
    gen = torch.Generator("cuda").manual_seed(0)
    rows = layouts(gen)
    graph_row = graph(gen)
    print(json.dumps(graph_row), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "graph": graph_row}, f, indent=1)


if __name__ == "__main__":
    main()
