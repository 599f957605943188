"""``tilegen.blockwise_layer``: the Blockwise Parallel Transformer decoder layer, one block of query tokens at a time.

After attention every token's FFN is independent of the others', so a layer needs no barrier
between attention and the FFN. ``blockwise_layer`` takes one block of query tokens at a time
through the whole layer: norm and q projection, attention over the keys that block sees
(``tilegen.attention``: causal or not, a window, a softcap, GQA), ``o_proj`` and the residual,
then the generated blockwise FFN kernels (norm, MLP, residual), written into that block's rows
of the output. That schedule is the ``blockwise_layer`` family's generated module
(``tilegen.layers.family``), rendered for the layer's spec
(``BlockwiseLayerSpec.for_layer(config, dtype)``); its query block is that family's knob, tuned
per token bucket (on a GPU by default 4096 rows, so that attention fills the SMs), and the FFN
runs its own tuned fusion block inside it. It composes ops, so it lives above them.

It launches as the ops do (``tilegen.dispatch.planned``: the block chosen for the token count,
the launcher, the fallback), made per call since the ops it calls are looked up per call. The
launcher is host code calling ops, so it is never replayed (``Launcher`` sees its module
functions): every call runs it. A tuned block that fails is skipped for the next choice
when ``out`` is a buffer of its own; in place it is raised (see ``blockwise_layer``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from tilegen import dispatch
from tilegen.dtypes import SPEC_DTYPES
from tilegen.layers.config import LayerConfig
from tilegen.layers.family.spec import BlockwiseLayerSpec
from tilegen.layers.train import MAX_TRAINING_BLOCK, LayerFunction
from tilegen.layers.weights import as_state_dict, check_weights, config_from_weights
from tilegen.ops.attention import attention
from tilegen.ops.blockwise import blockwise_ffn
from tilegen.ops.rope import apply_rope
from tilegen.ops.tensors import NO_BACKWARD, check_device, check_out, refuse_grad

__all__ = ["blockwise_layer", "explain_layer", "layer_spec", "layer_table"]


def layer_table(spec: BlockwiseLayerSpec, device: torch.device) -> dispatch.Table:
    """The layer's tuned query blocks on ``device`` (its schedule is ``dispatch.launcher_for(spec)``'s)."""
    return dispatch.table_on(spec, device)


def layer_spec(config: LayerConfig, dtype: torch.dtype) -> BlockwiseLayerSpec:
    """The ``blockwise_layer`` spec of a layer in ``dtype``: what its generated schedule is rendered for."""
    return BlockwiseLayerSpec.for_layer(config, SPEC_DTYPES[dtype])


def blockwise_layer(
    x: torch.Tensor,
    weights: Mapping[str, torch.Tensor] | torch.nn.Module,
    config: LayerConfig | None = None,
    *,
    block: int | None = None,
    out: torch.Tensor | None = None,
    **config_kwargs: Any,
) -> torch.Tensor:
    """A Llama-style decoder layer, inference forward, one block of query tokens at a time.

    Args:
        x: ``[tokens, d_model]`` or ``[batch, tokens, d_model]``, fp16, bf16 or fp32, on a CUDA
            device (or the CPU under the interpreter).
        weights: the layer's tensors by their Llama names (``input_layernorm.weight``,
            ``self_attn.{q,k,v,o}_proj.weight``, ``post_attention_layernorm.weight``,
            ``mlp.{gate,up,down}_proj.weight``; ``*_layernorm.bias`` for LayerNorm, no
            ``gate_proj`` for a GELU MLP), as a dict or a module whose ``state_dict()`` has them.
        config: a ``tilegen.layers.LayerConfig``; or leave it out and give ``heads_q`` (and
            optionally ``heads_kv``, ``norm``, ``ffn``, ``causal``, ``rope_theta``, ``eps``,
            ``scale``, ``window``, ``softcap``) as keywords, the widths being read from the weights' shapes.
        block: query tokens per block; by default the ``blockwise_layer`` family's tuned (or default)
            block for this many tokens (``explain_layer`` says which): on a GPU 4096 untuned. A training
            forward takes at most ``tilegen.layers.train.MAX_TRAINING_BLOCK`` (4096) of it, which bounds
            the backward's per-block memory.
        out: where to write the result, ``x``'s shape, dtype and device; it may be ``x`` itself
            (in place: a block's rows of ``x`` are read, and K and V taken from them, before the
            block writes them); a view that overlaps ``x`` partly, or a weight, is refused. A tuned
            block that fails to run is skipped with one warning and the next choice runs, except
            when ``out`` shares ``x``'s memory: rows written by then could not be computed again.

    Returns the layer's output, ``x``'s shape and dtype; it computes the function of
    ``tilegen.layers.reference_layer``. With grad mode on and ``x`` or a weight requiring grad, the
    output backpropagates, block by block (``tilegen.layers.train``): the forward keeps ``x``, the
    weights and attention's output and LSE, nothing of the FFN's width; ``out`` is then refused
    (a result written in place cannot be differentiated). Weights that do not match the config
    (missing, unexpected, wrong shape, dtype or device) raise an error naming the weight.

    Under ``torch.compile`` the layer is a graph break: it runs eagerly, forward and backward, and the graph
    around it is compiled (``fullgraph=True`` refuses it, saying so).
    """
    if torch.compiler.is_compiling():
        from tilegen.layers import compiled  # imports Dynamo: only a compiled call gets here

        return compiled.eagerly(blockwise_layer, x, weights, config, block=block, out=out, **config_kwargs)
    if isinstance(x, torch.Tensor) and torch.is_autocast_enabled(x.device.type):
        # Its projections would come out in mixed dtypes (a matmul into a buffer is not autocast, one into a new
        # tensor is), and attention refuses those with a message about its own arguments.
        raise NotImplementedError("tilegen.blockwise_layer: torch.autocast is not supported; cast the layer and x "
                                  "to one dtype instead (layer.to(torch.bfloat16))")
    w, config = _resolve(x, weights, config, config_kwargs)
    held, trains = _trained(x, weights, w)
    if trains and out is not None:
        raise TypeError("out: x or a weight requires grad, and a result written into `out` cannot be differentiated; "
                        "drop `out`, or call under torch.no_grad()")
    if out is None:
        out = torch.empty_like(x)
    elif not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out: expected a {tuple(x.shape)} {x.dtype} tensor on {x.device}")
    else:
        check_out("out", out, {"x": x, **w}, may_be=("x",))
    if torch.is_grad_enabled() and out.requires_grad and not trains:
        refuse_grad("tilegen.blockwise_layer", missing=NO_BACKWARD, out=out)
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"block: expected a positive int, got {block!r}")
    n = x.shape[-2]
    if n == 0 and not trains:
        return out
    spec = layer_spec(config, x.dtype)
    table = layer_table(spec, x.device)
    launcher = dispatch.launcher_for(spec)
    # attention is looked up here, per call: the benchmark's memory replay stands in for it.
    fixed = dict(attention=attention, blockwise_ffn=blockwise_ffn, **spec.launch_args(config))
    if spec.rope:
        fixed["rope"] = apply_rope
    if trains:
        # The training forward runs the chosen block's schedule with attention recorded (no fallback: the
        # backward replays the blocks it ran). An empty x still gets a grad_fn, whose gradients are empty.
        chosen = block if block is not None else _training_choice(table.choose(n)).config.block_q

        def run(x_seq, w_seq, out_seq, recorder):
            launcher.launch(x_seq, w_seq, out_seq, **{**fixed, "attention": recorder, "block_q": chosen})

        names = tuple(held)
        return LayerFunction.apply(x, config, run, names, *(held[name] for name in names))

    def make(choice: dispatch.Choice | None) -> _Plan:
        # The schedule calls the ops (host code, never recorded: the launcher's own Python runs every call).
        return _Plan(launcher.replay({**fixed, "block_q": block if choice is None else choice.config.block_q}))

    if block is not None:
        plan = make(None)
    else:
        # The schedule writes out block by block. Into a buffer of its own, a launch that failed part way
        # leaves x whole, and the next choice runs over every row again; over x (in place), rows of x are
        # already overwritten, so a tuned row's failure is raised there, as the default's is.
        in_place = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        plan = dispatch.planned(table, n, make, fallback=not in_place)
    sequences = zip(x.unbind(0), out.unbind(0)) if x.dim() == 3 else [(x, out)]
    for x_seq, out_seq in sequences:
        plan.launch(None, x_seq, w, out_seq)  # plan.launch each time: the first may fall back and replace it
    return out


@dataclass(frozen=True)
class _Plan:
    launch: Callable[..., Any]  # launch(key, x, w, out): the launcher's replay, not replayable (dispatch.planned)


def explain_layer(
    x: torch.Tensor,
    weights: Mapping[str, torch.Tensor] | torch.nn.Module,
    config: LayerConfig | None = None,
    **config_kwargs: Any,
) -> dispatch.Choice:
    """Which query block ``blockwise_layer(x, weights, config)`` runs with (``block=None``), and where it
    comes from: a tuned row of the ``blockwise_layer`` family, or its default. A call that trains (x or a weight
    requires grad, under grad mode) takes at most ``MAX_TRAINING_BLOCK`` rows a block, as the call does."""
    w, config = _resolve(x, weights, config, config_kwargs)
    choice = layer_table(layer_spec(config, x.dtype), x.device).choose(x.shape[-2])
    return _training_choice(choice) if _trained(x, weights, w)[1] else choice


def _trained(x, weights, w) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors a call holds for its weights, and whether the call trains. A module's state_dict() is detached:
    its parameters say whether they require grad. Its buffers (a frozen norm's weight) and tied parameters under a
    second name stay what state_dict() gave: constants, or the parameter."""
    if isinstance(weights, torch.nn.Module):
        params = dict(weights.named_parameters(remove_duplicate=False))
        held = {name: params.get(name, t) for name, t in w.items()}
    else:
        held = w
    return held, torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in held.values()))


def _training_choice(choice: dispatch.Choice) -> dispatch.Choice:
    """``choice`` as a training call runs it: a block of at most ``MAX_TRAINING_BLOCK`` query rows."""
    if choice.config.block_q <= MAX_TRAINING_BLOCK:
        return choice
    return dataclasses.replace(choice, config=dataclasses.replace(choice.config, block_q=MAX_TRAINING_BLOCK))


def _resolve(x, weights, config, config_kwargs) -> tuple[dict[str, torch.Tensor], LayerConfig]:
    """The weights as a dict and the layer's config, every argument checked against the other."""
    w = as_state_dict(weights)
    if config is None:
        if "heads_q" not in config_kwargs:
            raise TypeError("config: give a LayerConfig, or heads_q= (and the other options) as keywords")
        config = config_from_weights(w, **config_kwargs)
    elif config_kwargs:
        raise TypeError(f"{next(iter(config_kwargs))}: give either config or keyword options, not both")
    elif not isinstance(config, LayerConfig):
        raise TypeError(f"config: expected a tilegen.LayerConfig, got {type(config).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != config.d_model:
        raise ValueError(f"x: expected [tokens, {config.d_model}] or [batch, tokens, {config.d_model}], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in SPEC_DTYPES:
        raise TypeError(f"x: expected fp16, bf16 or fp32, got {x.dtype}")
    check_device("x", x.device)
    check_weights(w, config, dtype=x.dtype, device=x.device)
    return w, config
