"""What a Llama-style decoder layer is, for the blockwise schedule and its reference."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from tilegen.families.attention_fwd.masks import score_scalars, window_bounds
from tilegen.families.blockwise_ffn.spec import FFNS, NORMS

__all__ = ["LayerConfig"]


@dataclass(frozen=True)
class LayerConfig:
    """A pre-norm decoder layer: ``h = x + o_proj(attn(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))``,
    then ``out = h + mlp(n2(h))``.

    Attributes:
        d_model: the residual stream's width.
        heads_q, heads_kv: attention heads; ``heads_q`` a multiple of ``heads_kv`` (GQA).
        head_dim: per head; ``q_proj`` is ``[heads_q * head_dim, d_model]``.
        d_ffn: the MLP's hidden width.
        norm: ``rmsnorm`` (``*_layernorm.weight``) or ``layernorm`` (weight and bias).
        ffn: ``swiglu`` (Llama's gate/up/down) or ``gelu_mlp`` (up, exact GELU, down).
        causal: causal self-attention (a decoder); False attends to every token.
        rope_theta: Llama's rotary embedding (rotate-half form, positions 0..n-1) on q and k
            with this base; ``None`` applies no position embedding.
        eps: the norms' epsilon.
        scale: the softmax scale; ``None`` is ``1/sqrt(head_dim)``.
        window: ``(left, right)``: a token sees keys at most ``left`` positions before it and
            ``right`` after (``None``: unbounded on that side); with ``causal`` right is 0.
        softcap: attention logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
    """

    d_model: int
    heads_q: int
    heads_kv: int
    head_dim: int
    d_ffn: int
    norm: str = "rmsnorm"
    ffn: str = "swiglu"
    causal: bool = True
    rope_theta: float | None = 10000.0
    eps: float = 1e-5
    scale: float | None = None
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("d_model", "heads_q", "heads_kv", "head_dim", "d_ffn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q: {self.heads_q} is not a multiple of heads_kv={self.heads_kv}")
        if self.head_dim % 2 and self.rope_theta is not None:
            raise ValueError(f"head_dim: rotary embedding needs an even head dim, got {self.head_dim}")
        if self.norm not in NORMS:
            raise ValueError(f"norm: expected one of {', '.join(NORMS)}, got {self.norm!r}")
        if self.ffn not in FFNS:
            raise ValueError(f"ffn: expected one of {', '.join(FFNS)}, got {self.ffn!r}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal: expected a bool, got {self.causal!r}")
        if self.rope_theta is not None and not _positive(self.rope_theta):
            raise ValueError(f"rope_theta: expected a finite positive number or None, got {self.rope_theta!r}")
        if not _positive(self.eps):
            raise ValueError(f"eps: expected a finite positive number, got {self.eps!r}")
        score_scalars(self.scale, self.softcap, self.head_dim)  # raises naming scale or softcap
        if self.window is not None:
            object.__setattr__(self, "window", tuple(self.window) if isinstance(self.window, list) else self.window)
        window_bounds(self.window, self.causal)  # raises naming window

    def attention_bounds(self) -> tuple[int | None, int | None]:
        """``(left, right)`` of the keys a token sees around its own position (``None``: unbounded)."""
        return window_bounds(self.window, self.causal)

    def replace(self, **changes) -> LayerConfig:
        return dataclasses.replace(self, **changes)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the layer reads, by its Llama name, with its shape (``torch.nn.Linear``'s ``[out, in]``)."""
        d, f, q, kv = self.d_model, self.d_ffn, self.heads_q * self.head_dim, self.heads_kv * self.head_dim
        shapes = {"input_layernorm.weight": (d,)}
        if self.norm == "layernorm":
            shapes["input_layernorm.bias"] = (d,)
        shapes.update({
            "self_attn.q_proj.weight": (q, d),
            "self_attn.k_proj.weight": (kv, d),
            "self_attn.v_proj.weight": (kv, d),
            "self_attn.o_proj.weight": (d, q),
            "post_attention_layernorm.weight": (d,),
        })
        if self.norm == "layernorm":
            shapes["post_attention_layernorm.bias"] = (d,)
        if self.ffn == "swiglu":
            shapes["mlp.gate_proj.weight"] = (f, d)
        shapes["mlp.up_proj.weight"] = (f, d)
        shapes["mlp.down_proj.weight"] = (d, f)
        return shapes


def _positive(value) -> bool:
    # Not a bool (True would pass as 1), nor inf: an infinite eps zeroes the norms' output, and an infinite theta
    # leaves every rotary pair but the first unrotated; nor an int no float holds, which the kernels take as floats.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= sys.float_info.max
