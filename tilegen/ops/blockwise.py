"""The Blockwise Parallel Transformer layer: ``tilegen.blockwise_ffn`` and ``tilegen.blockwise_layer``.

After attention every token's FFN is independent of the others', so a layer needs no barrier
between attention and the FFN. ``blockwise_layer`` takes one block of query tokens at a time
through the whole layer: norm and q projection, attention over the keys that block sees
(``tilegen.attention``: causal or not, a window, a softcap, GQA), ``o_proj`` and the residual, then the generated blockwise FFN kernels
(norm, MLP, residual), written into that block's rows of the output. K and V are projected
once for the whole sequence, a block at a time, since every query block needs them; nothing
else sequence-sized is ever held but the output. The query block is the FFN config's fusion
block (``block_tokens``, tuned with the family), on a GPU at least 4096 rows so that attention
fills the SMs; the FFN runs its fusion block inside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from tilegen import dispatch
from tilegen.device import device_info
from tilegen.dtypes import SPEC_DTYPES
from tilegen.env import interpreting
from tilegen.families.blockwise_ffn.spec import BlockwiseFFNSpec
from tilegen.layers.config import LayerConfig
from tilegen.layers.reference import rope_tables
from tilegen.layers.weights import as_state_dict, check_weights, config_from_weights
from tilegen.ops.attention import attention

__all__ = ["blockwise_ffn", "blockwise_layer", "ffn_table"]

#: Fewest query rows per block on a GPU by default: with 8 KV heads' worth of query tiles of 128
#: rows, fewer leave an H200's 132 SMs idle in attention. The FFN still runs its own (tuned)
#: fusion block inside it; the block's other activations are a few [rows, d_model] tensors.
_MIN_QUERY_BLOCK = 4096


def ffn_table(spec: BlockwiseFFNSpec, device: torch.device) -> dispatch.Table:
    index = device.index if device.type == "cuda" else None
    return dispatch.table_for(spec, device_info(index))


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
        out: where to write ``[tokens, d_model]`` (may be ``x`` itself, not a partial overlap).

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
        block: query tokens per block; by default the tuned (or default) fusion block of the
            FFN kernels for this length, on a GPU at least 4096 (attention wants that many rows).
        out: where to write the result, ``x``'s shape, dtype and device; it may be ``x`` itself
            (in place: a block's rows of ``x`` are read, and K and V taken from them, before the
            block writes them), but not a view that overlaps ``x`` partly.

    Returns the layer's output, ``x``'s shape and dtype; it computes the function of
    ``tilegen.layers.reference_layer``. Weights that do not match the config (missing,
    unexpected, wrong shape, dtype or device) raise an error naming the weight.
    """
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
    if out is None:
        out = torch.empty_like(x)
    elif not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out: expected a {tuple(x.shape)} {x.dtype} tensor on {x.device}")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"block: expected a positive int, got {block!r}")
    if x.dim() == 3:
        for b in range(x.shape[0]):
            _layer(x[b], w, config, block, out[b])
    else:
        _layer(x, w, config, block, out)
    return out


def _ffn_spec(config: LayerConfig, dtype: torch.dtype) -> BlockwiseFFNSpec:
    return BlockwiseFFNSpec(d_model=config.d_model, d_ffn=config.d_ffn, norm=config.norm, ffn=config.ffn,
                            dtype=SPEC_DTYPES[dtype])


def _layer(x: torch.Tensor, w: Mapping[str, torch.Tensor], config: LayerConfig, block: int | None,
           out: torch.Tensor) -> None:
    n = x.shape[0]
    if n == 0:
        return
    if block is None:
        block = ffn_table(_ffn_spec(config, x.dtype), x.device).choose(n).config.block_tokens
        if x.device.type == "cuda":
            block = max(block, _MIN_QUERY_BLOCK)
    hq, hkv, hd = config.heads_q, config.heads_kv, config.head_dim
    scale = config.scale if config.scale is not None else 1.0 / math.sqrt(hd)
    k_all = x.new_empty(n, hkv * hd)
    v_all = x.new_empty(n, hkv * hd)
    blocks = [(start, min(n, start + block)) for start in range(0, n, block)]

    def normed(start, end):
        # torch's fused norms: one kernel with fp32 statistics, where the reference's spelled-out
        # norm is several elementwise passes over the block.
        if config.norm == "rmsnorm":
            return F.rms_norm(x[start:end], (config.d_model,), w["input_layernorm.weight"], config.eps)
        return F.layer_norm(x[start:end], (config.d_model,), w["input_layernorm.weight"], w["input_layernorm.bias"],
                            config.eps)

    def rope(t, start, end, heads):
        if config.rope_theta is None:
            return t
        positions = torch.arange(start, end, device=x.device)
        cos, sin = rope_tables(positions, hd, config.rope_theta, torch.float32)
        # In fp32 with one rounding, in place: a block's transient is two fp32 copies of q, not five.
        tf = t.view(end - start, heads, hd).float()
        rotated = torch.cat((-tf[..., hd // 2:], tf[..., :hd // 2]), dim=-1).mul_(sin[:, None, :])
        return tf.mul_(cos[:, None, :]).add_(rotated).to(x.dtype).view(end - start, heads * hd)

    def project_kv(start, end, xn):
        k_all[start:end] = rope(xn @ w["self_attn.k_proj.weight"].T, start, end, hkv)
        torch.matmul(xn, w["self_attn.v_proj.weight"].T, out=v_all[start:end])

    left, right = config.attention_bounds()
    progressive = right == 0  # a block sees no key after its own: K and V can be filled as blocks go
    if not progressive:  # a block sees later keys too: K and V first
        for start, end in blocks:
            project_kv(start, end, normed(start, end))
    for start, end in blocks:
        rows = end - start
        xn = normed(start, end)
        if progressive:
            project_kv(start, end, xn)
        q = rope(xn @ w["self_attn.q_proj.weight"].T, start, end, hq)
        del xn
        # The block sees keys [k0, k1). tilegen.attention aligns query row i with key k1 - rows + i
        # (bottom-right); token start + i sits at key start + i, so the window moves by k1 - end.
        k0 = 0 if left is None else max(0, start - left)
        k1 = n if right is None else min(n, end + right)
        shift = k1 - end
        window = None if left is None and right is None else (
            None if left is None else left + shift, None if right is None else right - shift)
        k = k_all[k0:k1].view(k1 - k0, hkv, hd).transpose(0, 1)[None]
        v = v_all[k0:k1].view(k1 - k0, hkv, hd).transpose(0, 1)[None]
        attn = x.new_empty(rows, hq * hd)
        attention(q.view(rows, hq, hd).transpose(0, 1)[None], k, v, window=window, softcap=config.softcap,
                  scale=scale, out=attn.view(rows, hq, hd).transpose(0, 1)[None])
        del q
        h = torch.addmm(x[start:end], attn, w["self_attn.o_proj.weight"].T)
        del attn
        blockwise_ffn(h, w_norm=w["post_attention_layernorm.weight"], b_norm=w.get("post_attention_layernorm.bias"),
                      w_gate=w.get("mlp.gate_proj.weight"), w_up=w["mlp.up_proj.weight"],
                      w_down=w["mlp.down_proj.weight"], norm=config.norm, eps=config.eps, out=out[start:end])
