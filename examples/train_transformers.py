"""Train a transformers ``LlamaForCausalLM`` with tilegen attention (``attn_implementation="tilegen"``) beside the
same model with transformers' sdpa attention, from identical weights on identical padded batches.

    python examples/train_transformers.py                  # CPU: Triton's interpreter, tiny model (~12 min on 2 cores)
    python examples/train_transformers.py --hidden 1024 --layers 8 --heads 16/8 --head-dim 64 --ffn 2816 \\
        --seq 2048 --batch 8 --vocab 256 --steps 300 --dtype bf16      # a GPU

The batches are right-padded: every sequence has its own length (from half of ``--seq`` to all of it), the
attention mask marks the padding and the labels ignore it, so tilegen serves every attention call through
``tilegen.varlen_attention`` over the real tokens (the padding mask becomes ragged offsets, never a dense
mask) and its backward. The data is the random Markov chain of ``examples/train_blockwise.py``. Both models
train with AdamW. The loss curves go to ``--out`` (JSON) and a plot (``--plot``, default ``--out`` with
``.png``); the printout ends with the largest per-step loss difference.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before tilegen imports Triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_blockwise import markov_batches, plot  # noqa: E402  (the same synthetic data and plot)

from tilegen.integrations.transformers import use_tilegen  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TILEGEN, SDPA = "transformers + tilegen attention", "transformers + sdpa attention"


def padded(tokens: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` of ``tokens`` ``[steps, batch, seq + 1]`` cut to random lengths
    (at least half the sequence) and right-padded; padding's labels are -100 (ignored)."""
    steps, batch, width = tokens.shape
    seq = width - 1
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, seq // 2), seq + 1, (steps, batch), generator=gen)
    keep = torch.arange(seq)[None, None, :] < lengths[..., None]
    ids = torch.where(keep, tokens[..., :-1], 0)
    labels = torch.where(keep, tokens[..., 1:], -100)
    return ids, keep.long(), labels


def train(model, ids, mask, labels, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    device = next(model.parameters()).device
    losses = []
    for step in range(len(ids)):
        logits = model(input_ids=ids[step].to(device), attention_mask=mask[step].to(device)).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels[step].to(device).flatten(),
                                                 ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == len(ids) - 1:
            print(f"  step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", default="4/2", help="query/KV heads")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=160)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--seq", type=int, default=48)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="train_transformers.json")
    parser.add_argument("--plot", default=None, help="default: --out with .png")
    args = parser.parse_args(argv)
    try:
        heads_q, heads_kv = (int(v) for v in args.heads.split("/"))
    except ValueError:
        parser.error(f"--heads: expected Q/KV, e.g. 4/2; got {args.heads!r}")
    if min(args.layers, args.steps, args.seq, args.batch, args.vocab, args.hidden) < 1:
        parser.error("--layers, --hidden, --steps, --seq, --batch and --vocab must be positive")
    if heads_q < 1 or heads_kv < 1 or heads_q % heads_kv:
        parser.error(f"--heads: expected positive Q/KV with Q a multiple of KV; got {args.heads!r}")
    if args.hidden % heads_q:
        parser.error(f"--heads/--hidden: transformers' Llama takes a hidden size ({args.hidden}) that is a multiple "
                     f"of the query heads ({heads_q})")
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        sys.exit("this example trains a transformers model: pip install 'tilegen[transformers]'")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=heads_q, num_key_value_heads=heads_kv,
                         head_dim=args.head_dim, max_position_embeddings=max(64, args.seq), attention_bias=False,
                         mlp_bias=False, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    reference = LlamaForCausalLM(config).to(device=device, dtype=DTYPES[args.dtype])
    models = {TILEGEN: use_tilegen(copy.deepcopy(reference)), SDPA: reference}
    ids, mask, labels = padded(markov_batches(args.vocab, args.steps, args.batch, args.seq, args.seed + 1),
                               args.seed + 2)

    curves, seconds = {}, {}
    for name, model in models.items():
        print(f"{name}:", flush=True)
        start = time.perf_counter()
        curves[name] = train(model, ids, mask, labels, args.lr)
        seconds[name] = time.perf_counter() - start
    diff = max(abs(a - b) for a, b in zip(curves[TILEGEN], curves[SDPA]))
    print(f"max |loss difference| tilegen vs sdpa over {args.steps} steps: {diff:.3g}")
    print(f"sdpa loss: {curves[SDPA][0]:.3f} at step 0 (ln(vocab) = {math.log(args.vocab):.3f}), "
          f"{sum(curves[SDPA][-10:]) / len(curves[SDPA][-10:]):.3f} over the last steps")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu-interpreter",
                   "torch": torch.__version__, "args": vars(args), "seconds": seconds,
                   "max_abs_loss_difference": diff, "padding_tokens": int((mask == 0).sum()),
                   "tokens": int(mask.numel()), "losses": curves}, f, indent=1)
    title = (f"LlamaForCausalLM {args.layers} x {args.hidden}, heads {args.heads}, right-padded seq <= {args.seq}, "
             f"batch {args.batch}, {args.dtype}")
    plot_path = plot(curves, title, args.plot or os.path.splitext(args.out)[0] + ".png", ours=TILEGEN, base=SDPA)
    print(f"wrote {args.out}" + (f" and {plot_path}" if plot_path else " (matplotlib not installed: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
