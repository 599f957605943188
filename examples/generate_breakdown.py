"""Where the engine's time goes at one batch size (H200 only): the whole ``generate``, the wall time inside its
prefills and its decode steps (host work included, and, where steps do not overlap, each one's wait for its tokens),
the decode step's CUDA graph replayed alone, and a prefill-only run (one new token per request).

    python examples/generate_breakdown.py --batch 64 --prompt 2048 --new 256

Llama-3-8B widths, 4 layers, bf16, random weights, as ``examples/generate.py``.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate as G  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: the breakdown times CUDA graph replays")
    batch, prompt, new = args.batch, args.prompt, args.new
    dev = torch.device("cuda")
    dims = {**G.LLAMA3_8B, "max_position_embeddings": max(G.LLAMA3_8B["max_position_embeddings"], prompt + new)}
    model = G.build_model(dims, 4, torch.bfloat16, dev)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=gen).tolist()
    engine = G.Engine(model, page_size=16, max_batch=batch, max_seq_len=prompt + new, prefill_tokens=16384,
                      cuda_graphs=True)
    engine.warmup()
    engine.generate([G.Request(p, new) for p in prompts])  # warm-up run
    wall = {"decode": 0.0, "prefill": 0.0}
    for name in ("_decode", "_prefill"):
        real = getattr(engine, name)

        def timed(*a, real=real, name=name[1:]):
            t = time.perf_counter()
            result = real(*a)
            wall[name] += time.perf_counter() - t
            return result

        setattr(engine, name, timed)
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.generate([G.Request(p, new) for p in prompts])
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    print(f"generate: {total:.3f} s, {batch * new / total:.0f} tokens/s; wall in decode steps {wall['decode']:.3f} s, "
          f"in prefills {wall['prefill']:.3f} s; {engine.stats}")
    bucket = engine._bucket(batch)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(new):
        bucket.graph.replay()
    torch.cuda.synchronize()
    replay = time.perf_counter() - t
    print(f"{new} decode graph replays alone at batch {bucket.size}: {replay:.3f} s ({replay / new * 1e3:.2f} ms a step)")
    t = time.perf_counter()
    engine.generate([G.Request(p, 1) for p in prompts])
    torch.cuda.synchronize()
    print(f"prefill only (one new token per request): {time.perf_counter() - t:.3f} s")


if __name__ == "__main__":
    main()
