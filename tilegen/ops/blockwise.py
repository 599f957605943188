"""The Blockwise Parallel Transformer layer: ``tilegen.blockwise_ffn`` and ``tilegen.blockwise_layer``.

After attention every token's FFN is independent of the others', so a layer needs no barrier
between attention and the FFN. ``blockwise_layer`` takes one block of query tokens at a time
through the whole layer: norm and q projection, attention over the keys that block sees
(``tilegen.attention``: causal or not, a window, a softcap, GQA), ``o_proj`` and the residual,
then the generated blockwise FFN kernels (norm, MLP, residual), written into that block's rows
of the output. That schedule is the ``blockwise_layer`` family's generated module, rendered
for the layer's spec (``BlockwiseLayerSpec.for_layer(config, dtype)``); its query block is that
family's knob, tuned per token bucket (on a GPU by default 4096 rows, so that attention fills
the SMs), and the FFN runs its own tuned fusion block inside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from tilegen import dispatch
from tilegen.dtypes import SPEC_DTYPES
from tilegen.env import interpreting
from tilegen.families.blockwise_ffn.spec import BlockwiseFFNSpec
from tilegen.families.blockwise_layer.spec import BlockwiseLayerSpec
from tilegen.layers.config import LayerConfig
from tilegen.layers.weights import as_state_dict, check_weights, config_from_weights
from tilegen.ops.attention import attention
from tilegen.ops.rope import apply_rope
from tilegen.ops.tensors import check_out

__all__ = ["blockwise_ffn", "blockwise_layer", "explain_layer", "ffn_table", "layer_spec", "layer_table"]


def ffn_table(spec: BlockwiseFFNSpec, device: torch.device) -> dispatch.Table:
    return dispatch.table_on(spec, device)


def layer_table(spec: BlockwiseLayerSpec, device: torch.device) -> dispatch.Table:
    """The layer's tuned query blocks on ``device``; its ``launch`` is the generated schedule's."""
    return dispatch.table_on(spec, device)


def layer_spec(config: LayerConfig, dtype: torch.dtype) -> BlockwiseLayerSpec:
    """The ``blockwise_layer`` spec of a layer in ``dtype``: what its generated schedule is rendered for."""
    return BlockwiseLayerSpec.for_layer(config, SPEC_DTYPES[dtype])


def _check_device(name: str, t: torch.Tensor) -> None:
    if not (t.device.type == "cuda" or (t.device.type == "cpu" and interpreting())):
        raise ValueError(f"{name}: on {t.device}; the kernels run on a CUDA device, or on the CPU under "
                         f"TRITON_INTERPRET=1 (set before the first import of tilegen)")


def blockwise_ffn(
    x: torch.Tensor,
    *,
    w_norm: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate: torch.Tensor | None = None,
    b_norm: torch.Tensor | None = None,
    norm: str = "rmsnorm",
    eps: float = 1e-5,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = x + mlp(norm(x))`` for ``x`` ``[tokens, d_model]``, a fusion block of rows at a time.

    Args:
        x: ``[tokens, d_model]``, fp16, bf16 or fp32, any strides.
        w_norm: the norm's weight ``[d_model]``; ``b_norm`` its bias, given exactly when ``norm="layernorm"``.
        w_gate, w_up: ``[d_ffn, d_model]`` (``torch.nn.Linear`` layout). With ``w_gate`` the MLP is
            SwiGLU, ``down(silu(gate(xn)) * up(xn))``; without, ``down(gelu(up(xn)))`` (exact GELU).
        w_down: ``[d_model, d_ffn]``.
        norm: ``rmsnorm`` or ``layernorm``.
        eps: the norm's epsilon.
        out: where to write ``[tokens, d_model]`` (may be ``x`` itself; a partial overlap is refused).

    Every tensor must have ``x``'s dtype and device; an error names the argument that does not.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected a [tokens, d_model] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in SPEC_DTYPES:
        raise TypeError(f"x: expected fp16, bf16 or fp32, got {x.dtype}")
    _check_device("x", x)
    n, d = x.shape
    if not isinstance(w_up, torch.Tensor) or w_up.dim() != 2 or w_up.shape[1] != d:
        raise ValueError(f"w_up: expected [d_ffn, {d}], got "
                         f"{tuple(w_up.shape) if isinstance(w_up, torch.Tensor) else type(w_up).__name__}")
    f = w_up.shape[0]
    ffn = "swiglu" if w_gate is not None else "gelu_mlp"
    expected = {"w_norm": (w_norm, (d,)), "w_up": (w_up, (f, d)), "w_down": (w_down, (d, f))}
    if w_gate is not None:
        expected["w_gate"] = (w_gate, (f, d))
    if norm == "layernorm":
        if b_norm is None:
            raise ValueError("b_norm: norm='layernorm' needs the norm's bias")
        expected["b_norm"] = (b_norm, (d,))
    elif norm == "rmsnorm":
        if b_norm is not None:
            raise ValueError("b_norm: given, but norm='rmsnorm' has no bias")
    else:
        raise ValueError(f"norm: expected rmsnorm or layernorm, got {norm!r}")
    if out is not None:
        expected["out"] = (out, (n, d))
    for name, (t, shape) in expected.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from x's {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device} while x is on {x.device}")
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: expected a positive finite number, got {eps!r}")
    if out is None:
        out = torch.empty_like(x)
    else:
        check_out("out", out, {"x": x, **{name: t for name, (t, _) in expected.items() if name != "out"}},
                  may_be=("x",))
    if n == 0:
        return out
    spec = BlockwiseFFNSpec(d_model=d, d_ffn=f, norm=norm, ffn=ffn, dtype=SPEC_DTYPES[x.dtype])
    table = ffn_table(spec, x.device)
    table.run(n, lambda config: table.launch(x, w_norm, b_norm, w_gate, w_up, w_down, out, eps=float(eps),
                                             **config.to_dict()))
    return out


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
            block for this many tokens (``explain_layer`` says which): on a GPU 4096 untuned.
        out: where to write the result, ``x``'s shape, dtype and device; it may be ``x`` itself
            (in place: a block's rows of ``x`` are read, and K and V taken from them, before the
            block writes them); a view that overlaps ``x`` partly, or a weight, is refused.

    Returns the layer's output, ``x``'s shape and dtype; it computes the function of
    ``tilegen.layers.reference_layer``. Weights that do not match the config (missing,
    unexpected, wrong shape, dtype or device) raise an error naming the weight.
    """
    w, config = _resolve(x, weights, config, config_kwargs)
    if out is None:
        out = torch.empty_like(x)
    elif not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out: expected a {tuple(x.shape)} {x.dtype} tensor on {x.device}")
    else:
        check_out("out", out, {"x": x, **w}, may_be=("x",))
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"block: expected a positive int, got {block!r}")
    n = x.shape[-2]
    if n == 0:
        return out
    spec = layer_spec(config, x.dtype)
    table = layer_table(spec, x.device)
    if block is None:
        # choose, not run: the schedule writes out block by block (over x, in place), so a launch
        # that failed part way could not be run again with another block.
        block = table.choose(n).config.block_q
    # attention is looked up here, per call: the benchmark's memory replay stands in for it.
    args = dict(attention=attention, blockwise_ffn=blockwise_ffn, block_q=block, **spec.launch_args(config))
    if spec.rope:
        args["rope"] = apply_rope
    sequences = zip(x.unbind(0), out.unbind(0)) if x.dim() == 3 else [(x, out)]
    for x_seq, out_seq in sequences:
        table.launch(x_seq, w, out_seq, **args)
    return out


def explain_layer(
    x: torch.Tensor,
    weights: Mapping[str, torch.Tensor] | torch.nn.Module,
    config: LayerConfig | None = None,
    **config_kwargs: Any,
) -> dispatch.Choice:
    """Which query block ``blockwise_layer(x, weights, config)`` runs with (``block=None``), and where it
    comes from: a tuned row of the ``blockwise_layer`` family, or its default."""
    _, config = _resolve(x, weights, config, config_kwargs)
    return layer_table(layer_spec(config, x.dtype), x.device).choose(x.shape[-2])


def _resolve(x, weights, config, config_kwargs) -> tuple[dict[str, torch.Tensor], LayerConfig]:
    """The weights as a dict and the layer's config, every argument checked against the other."""
    w = as_state_dict(weights)
    if config is None:
        if "heads_q" not in config_kwargs:
            raise TypeError("config: give a LayerConfig, or heads_q= (and the other options) as keywords")
        config = config_from_weights(w, **config_kwargs)
    elif config_kwargs:
        raise TypeError(f"{next(iter(config_kwargs))}: give either config or keyword options, not both")
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != config.d_model:
        raise ValueError(f"x: expected [tokens, {config.d_model}] or [batch, tokens, {config.d_model}], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in SPEC_DTYPES:
        raise TypeError(f"x: expected fp16, bf16 or fp32, got {x.dtype}")
    _check_device("x", x)
    check_weights(w, config, dtype=x.dtype, device=x.device)
    return w, config
