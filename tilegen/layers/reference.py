"""The plain PyTorch decoder layer that defines what ``tilegen.blockwise_layer`` computes.

Pre-norm, as Llama: ``h = x + o_proj(attention(q, k, v))`` with ``q, k, v`` projected from
``norm1(x)`` (rotary embedding on q and k unless ``rope_theta`` is None; causal or not, a
window and a softcap if the config has them; GQA), then ``out = h + mlp(norm2(h))``. The norms and the MLP are the
blockwise FFN family's (``tilegen.families.blockwise_ffn.reference``).

Tests run it in float64 (``compute_dtype=torch.float64``) on the same rounded weights and
input as the layer under test. Run in the input's dtype it is also the benchmark's unfused
peer (SDPA and the whole sequence's MLP at once), and with ``ffn_chunk`` its chunked peer
(the MLP over ``ffn_chunk`` tokens at a time). With ``rows`` it gives the output at those
tokens only, their attention over the whole sequence's keys masked by position: what a
check of a long sequence can afford in float64 (the layer's whole score matrix cannot be held).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.layers.config import LayerConfig

__all__ = ["reference_layer", "rope_tables", "apply_rope", "norm", "ffn_residual"]


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Llama's ``(cos, sin)`` ``[len(positions), head_dim]`` for integer ``positions``, in ``dtype``."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``t`` ``[..., tokens, heads, head_dim]`` with tables ``[tokens, head_dim]``."""
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos[:, None, :] + rotated * sin[:, None, :]


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, eps: float) -> torch.Tensor:
    """RMSNorm or LayerNorm over the last dim, computed in fp32 at least, returned in ``x``'s dtype."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if kind == "layernorm":
        xf = xf - xf.mean(-1, keepdim=True)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)
    if kind == "layernorm":
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)


def ffn_residual(h: torch.Tensor, w: Mapping[str, torch.Tensor], config: LayerConfig) -> torch.Tensor:
    """``h + mlp(norm(h))``: the layer's second half (its weights by Llama name in ``w``)."""
    hn = norm(h, w["post_attention_layernorm.weight"], w.get("post_attention_layernorm.bias"), config.norm, config.eps)
    up = hn @ w["mlp.up_proj.weight"].T
    if config.ffn == "swiglu":
        act = F.silu(hn @ w["mlp.gate_proj.weight"].T) * up
    else:
        act = F.gelu(up)
    return h + act @ w["mlp.down_proj.weight"].T


def reference_layer(x: torch.Tensor, weights: Mapping[str, torch.Tensor], config: LayerConfig, *,
                    compute_dtype: torch.dtype | None = None, ffn_chunk: int | None = None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """The layer on ``x`` ``[tokens, d_model]`` or ``[batch, tokens, d_model]``, in ``compute_dtype``
    (default: ``x``'s); ``ffn_chunk`` runs the MLP that many tokens at a time (same result);
    ``rows`` (token indices) gives only those tokens' outputs, ``[..., len(rows), d_model]``."""
    dtype = compute_dtype or x.dtype
    w = {name: t.to(dtype) for name, t in weights.items()}
    squeeze = x.dim() == 2
    x = (x[None] if squeeze else x).to(dtype)
    batch, n, _ = x.shape
    hq, hkv, hd = config.heads_q, config.heads_kv, config.head_dim
    # Whole-sequence runs index by a slice, a view: the benchmark measures this layer's peak memory.
    at = slice(None) if rows is None else torch.as_tensor(rows, device=x.device)
    m = n if rows is None else len(at)

    xn = norm(x, w["input_layernorm.weight"], w.get("input_layernorm.bias"), config.norm, config.eps)
    q = (xn[:, at] @ w["self_attn.q_proj.weight"].T).view(batch, m, hq, hd)
    k = (xn @ w["self_attn.k_proj.weight"].T).view(batch, n, hkv, hd)
    v = (xn @ w["self_attn.v_proj.weight"].T).view(batch, n, hkv, hd)
    del xn
    if config.rope_theta is not None:
        cos, sin = rope_tables(torch.arange(n, device=x.device), hd, config.rope_theta, dtype)
        # The tables broadcast over the batch (a batch of no sequence included: nothing to stack).
        q = apply_rope(q, cos[at], sin[at])
        k = apply_rope(k, cos, sin)
    scale = config.scale if config.scale is not None else 1.0 / math.sqrt(hd)
    if rows is not None:
        attn = _attention_at(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), at, config, scale)
    elif config.window is None and config.softcap is None and scale > 0:
        # SDPA's math path scales q and k by sqrt(scale) each: NaN for a scale of 0 or below.
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=config.causal, scale=scale, enable_gqa=hq != hkv)
    else:  # SDPA cannot: the attention family's reference (the whole score matrix) does
        attn = attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=config.causal,
                                   window=config.window, softcap=config.softcap, scale=scale,
                                   compute_dtype=dtype)[0].to(dtype)
    del q, k, v
    h = x[:, at] + attn.transpose(1, 2).reshape(batch, m, hq * hd) @ w["self_attn.o_proj.weight"].T
    del attn
    if ffn_chunk is None:
        out = ffn_residual(h, w, config)
    else:
        out = torch.empty_like(h)
        for start in range(0, m, ffn_chunk):
            out[:, start:start + ffn_chunk] = ffn_residual(h[:, start:start + ffn_chunk], w, config)
    return out[0] if squeeze else out


def _attention_at(q, k, v, positions, config: LayerConfig, scale: float) -> torch.Tensor:
    """Attention of the queries at token ``positions`` (``q`` [batch, heads_q, len(positions), head_dim])
    over all ``n`` keys, each seeing the keys its position allows: a token always sees itself."""
    left, right = config.attention_bounds()
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("bhmd,bhnd->bhmn", q, k.repeat_interleave(group, dim=1)) * scale
    if config.softcap is not None:
        s = config.softcap * torch.tanh(s / config.softcap)
    keys = torch.arange(k.shape[2], device=q.device)[None, :]
    keep = torch.ones(len(positions), k.shape[2], dtype=torch.bool, device=q.device)
    if left is not None:
        keep &= keys >= positions[:, None] - left
    if right is not None:
        keep &= keys <= positions[:, None] + right
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    return p @ v.repeat_interleave(group, dim=1)
