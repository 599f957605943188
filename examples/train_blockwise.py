"""Train a small Llama-architecture model whose decoder layers are ``tilegen.BlockwiseLayer``s, beside the same
model in plain torch (``tilegen.layers.reference_layer``, autograd), from identical weights on identical data.

    python examples/train_blockwise.py                      # CPU: Triton's interpreter, tiny model (~10 min on 2 cores)
    python examples/train_blockwise.py --d-model 1024 --layers 8 --heads 16/8 --head-dim 64 --d-ffn 2816 \\
        --seq 4096 --batch 4 --vocab 256 --steps 500 --dtype bf16      # a GPU

The model: token embedding, ``--layers`` pre-norm decoder layers (RMSNorm, RoPE, causal GQA attention,
SwiGLU), a final RMSNorm and an LM head (tied to the embedding with ``--tie``). The data: a random
first-order Markov chain over ``--vocab`` tokens, each token with a few likely successors, so the loss
falls from ln(vocab) towards the chain's entropy. Both models train with AdamW; when ``transformers``
imports, the same model as a ``LlamaForCausalLM`` (sdpa attention) trains too. The loss curves go to
``--out`` (JSON) and a plot (``--plot``, default ``--out`` with ``.png``); the printout ends with the
largest per-step loss difference between tilegen and the plain torch model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before tilegen imports Triton

import tilegen
from tilegen.bench import pyplot
from tilegen.layers import LayerConfig, reference_layer
from tilegen.layers.family.problem import random_weights
from tilegen.layers.reference import norm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TinyLlama(torch.nn.Module):
    """Embedding, decoder layers, final RMSNorm, LM head. ``impl`` picks how a layer runs: ``tilegen``
    (the layer module itself, BPT's forward and backward) or ``reference`` (``reference_layer`` on the same
    parameters under autograd); the parameters, and so the state dicts, are the same either way."""

    def __init__(self, config: LayerConfig, vocab: int, layers: int, tie: bool, impl: str, dtype, device):
        super().__init__()
        self.config, self.impl, self.tie = config, impl, tie
        self.embed = torch.nn.Embedding(vocab, config.d_model, dtype=dtype, device=device)
        self.layers = torch.nn.ModuleList(
            tilegen.BlockwiseLayer(config, dtype=dtype, device=device) for _ in range(layers))
        self.norm = torch.nn.Parameter(torch.ones(config.d_model, dtype=dtype, device=device))
        self.head = None if tie else torch.nn.Linear(config.d_model, vocab, bias=False, dtype=dtype, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h) if self.impl == "tilegen" else reference_layer(h, layer.weights(), self.config)
        h = norm(h, self.norm, None, "rmsnorm", self.config.eps)
        return h @ (self.embed.weight if self.tie else self.head.weight).T


def init_weights(model: TinyLlama, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=gen))
        for layer in model.layers:
            layer.load_weights(random_weights(model.config, gen, "cpu", torch.float32))
        if model.head is not None:
            model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=gen) * model.config.d_model ** -0.5)


def markov_batches(vocab: int, steps: int, batch: int, seq: int, seed: int, successors: int = 3) -> torch.Tensor:
    """``[steps, batch, seq + 1]`` tokens of a random Markov chain: each token has ``successors`` likely next
    tokens (80% of the mass, uneven) and the rest share 20%."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.full((vocab, vocab), 0.2 / vocab)
    for t in range(vocab):
        likely = torch.randperm(vocab, generator=gen)[:successors]
        probs[t, likely] += 0.8 * torch.softmax(torch.randn(successors, generator=gen), 0)
    tokens = torch.empty(steps * batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (steps * batch,), generator=gen)
    for i in range(seq):
        tokens[:, i + 1] = torch.multinomial(probs[tokens[:, i]], 1, generator=gen)[:, 0]
    return tokens.view(steps, batch, seq + 1)


def as_llama(model: TinyLlama, vocab: int):
    """The same model as transformers' ``LlamaForCausalLM`` (sdpa attention), holding ``model``'s weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=c.d_model, intermediate_size=c.d_ffn,
                      num_hidden_layers=len(model.layers), num_attention_heads=c.heads_q,
                      num_key_value_heads=c.heads_kv, head_dim=c.head_dim, rms_norm_eps=c.eps,
                      rope_theta=c.rope_theta, max_position_embeddings=1 << 20, tie_word_embeddings=model.tie,
                      attention_bias=False, mlp_bias=False, attn_implementation="sdpa")
    llama = LlamaForCausalLM(cfg).to(dtype=model.embed.weight.dtype, device=model.embed.weight.device)
    state = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm,
             **{f"model.layers.{i}.{name}": t for i, layer in enumerate(model.layers)
                for name, t in layer.weights().items()}}
    state["lm_head.weight"] = model.embed.weight if model.tie else model.head.weight
    missing, unexpected = llama.load_state_dict({k: v.detach() for k, v in state.items()}, strict=False)
    if [m for m in missing if "rotary" not in m] or unexpected:
        raise RuntimeError(f"LlamaForCausalLM's weights differ: missing {missing}, unexpected {unexpected}")
    return llama


def train(model, data: torch.Tensor, lr: float, logits_of=None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    device = next(model.parameters()).device
    for step, tokens in enumerate(data):
        tokens = tokens.to(device)
        logits = (logits_of or model)(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == len(data) - 1:
            print(f"  step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def plot(curves: dict[str, list[float]], title: str, path: str, ours: str = "tilegen BlockwiseLayer",
         base: str = "reference (torch autograd)") -> str | None:
    """The loss curves, and below them the per-step difference between ``ours`` and ``base``."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for (name, losses), style in zip(curves.items(), ("-", "--", ":")):
        ax.plot(losses, style, label=name)
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    diff = [abs(a - b) for a, b in zip(curves[ours], curves[base])]
    ax_diff.plot(diff, color="C3")
    ax_diff.set_ylabel(f"|{ours.split()[0]} - {base.split()[0]}|")
    ax_diff.set_xlabel("step")
    ax_diff.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", default="4/2", help="query/KV heads")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--d-ffn", type=int, default=160)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--tie", action="store_true", help="tie the LM head to the embedding")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-transformers", action="store_true", help="skip the LlamaForCausalLM peer")
    parser.add_argument("--out", default="train_blockwise.json")
    parser.add_argument("--plot", default=None, help="default: --out with .png")
    args = parser.parse_args(argv)
    try:
        heads_q, heads_kv = (int(v) for v in args.heads.split("/"))
    except ValueError:
        parser.error(f"--heads: expected Q/KV, e.g. 4/2; got {args.heads!r}")
    if min(args.layers, args.steps, args.seq, args.batch, args.vocab) < 1:
        parser.error("--layers, --steps, --seq, --batch and --vocab must be positive")
    try:
        config = LayerConfig(d_model=args.d_model, heads_q=heads_q, heads_kv=heads_kv, head_dim=args.head_dim,
                             d_ffn=args.d_ffn, rope_theta=10000.0)
    except ValueError as e:
        parser.error(f"the layer: {e}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    data = markov_batches(args.vocab, args.steps, args.batch, args.seq, args.seed + 1)

    models = {impl: TinyLlama(config, args.vocab, args.layers, args.tie, impl, dtype, device)
              for impl in ("tilegen", "reference")}
    init_weights(models["tilegen"], args.seed)
    models["reference"].load_state_dict(models["tilegen"].state_dict())
    peers = {"tilegen BlockwiseLayer": (models["tilegen"], None),
             "reference (torch autograd)": (models["reference"], None)}
    skipped = None
    if not args.no_transformers:
        try:
            llama = as_llama(models["reference"], args.vocab)
            peers["transformers LlamaForCausalLM (sdpa)"] = (llama, lambda t: llama(input_ids=t).logits)
        except ImportError as error:
            skipped = f"transformers: {error}"
            print(f"skipping the LlamaForCausalLM peer ({skipped})")

    curves, seconds = {}, {}
    for name, (model, logits_of) in peers.items():
        print(f"{name}:", flush=True)
        start = time.perf_counter()
        curves[name] = train(model, data, args.lr, logits_of)
        seconds[name] = time.perf_counter() - start
    ref = curves["reference (torch autograd)"]
    diffs = {name: max(abs(a - b) for a, b in zip(losses, ref)) for name, losses in curves.items() if losses is not ref}
    for name, d in diffs.items():
        print(f"max |loss difference| {name} vs reference: {d:.3g}")
    first, last = ref[0], sum(ref[-10:]) / len(ref[-10:])
    print(f"reference loss: {first:.3f} at step 0 (ln(vocab) = {math.log(args.vocab):.3f}), "
          f"{last:.3f} over the last steps")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu-interpreter",
                   "torch": torch.__version__, "args": vars(args), "layer": config.__dict__,
                   "seconds": seconds, "max_abs_loss_difference": diffs, "skipped": skipped, "losses": curves},
                  f, indent=1)
    title = (f"{args.layers} x d_model {args.d_model}, heads {args.heads}, seq {args.seq}, batch {args.batch}, "
             f"{args.dtype}: loss curves")
    plot_path = plot(curves, title, args.plot or os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}" + (f" and {plot_path}" if plot_path else " (matplotlib not installed: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
