"""The spec of the blockwise layer family: a Llama-style decoder layer scheduled over query blocks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from tilegen.families.attention_fwd.spec import AttentionSpec
from tilegen.families.blockwise_ffn.spec import FFNS, NORMS, BlockwiseFFNSpec
from tilegen.ir import Spec, SpecError, check_bool, check_choice, check_int

__all__ = ["BlockwiseLayerSpec", "NORMS", "FFNS"]



@dataclass(frozen=True)
class BlockwiseLayerSpec(Spec):
    """A pre-norm decoder layer, ``h = x + o_proj(attn(n1(x)))`` then ``out = h + mlp(n2(h))``, run one
    block of query tokens at a time (``tilegen.layers.reference_layer`` defines it).

    Attributes:
        d_model: the residual stream's width.
        d_ffn: the MLP's hidden width.
        heads_q: query heads; ``q_proj`` is ``[heads_q * head_dim, d_model]``.
        head_dim: per head, for queries, keys and values.
        q_per_kv: query heads per KV head (1: MHA, ``heads_q``: MQA, else GQA).
        causal: no token sees a key after its own (the window's right side is 0). K and V are
            then projected block by block as the schedule goes; otherwise all of them first.
        window: a bounded window: its left side (and, when not causal, perhaps its right)
            is a launch argument, as are the softcap value, RoPE's base, eps and the scale.
        softcap: attention logits become ``softcap * tanh(logits / softcap)``.
        rope: rotary position embedding (Llama's rotate-half form) on q and k.
        norm: ``rmsnorm`` or ``layernorm`` (weight and bias), for both norms of the layer.
        ffn: ``swiglu`` (gate, up, down) or ``gelu_mlp`` (up, exact GELU, down).
        dtype: of x, the weights and out.
    """

    family: ClassVar[str] = "blockwise_layer"

    d_model: int
    d_ffn: int
    heads_q: int
    head_dim: int
    q_per_kv: int = 1
    causal: bool = True
    window: bool = False
    softcap: bool = False
    rope: bool = True
    norm: str = "rmsnorm"
    ffn: str = "swiglu"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("d_model", "d_ffn", "heads_q", "head_dim", "q_per_kv"):
            check_int(name, getattr(self, name))
            if getattr(self, name) < 1:
                raise SpecError(name, f"expected a positive int, got {getattr(self, name)}")
        if self.heads_q % self.q_per_kv:
            raise SpecError("q_per_kv", f"heads_q={self.heads_q} is not a multiple of q_per_kv={self.q_per_kv}")
        for name in ("causal", "window", "softcap", "rope"):
            check_bool(name, getattr(self, name))
        if self.rope and self.head_dim % 2:
            raise SpecError("head_dim", f"rotary embedding needs an even head dim, got {self.head_dim}")
        check_choice("norm", self.norm, NORMS)
        check_choice("ffn", self.ffn, FFNS)
        self.parts()  # head dims attention cannot take, widths the FFN kernels cannot, raise here

    __hash__ = Spec.__hash__  # the base caches it; a frozen dataclass would write its own

    @property
    def heads_kv(self) -> int:
        return self.heads_q // self.q_per_kv

    @property
    def attention_mask(self) -> str:
        """The attention family's mask for the layer's query blocks."""
        if self.window:
            return "window"
        return "causal" if self.causal else "none"

    @property
    def name(self) -> str:
        mask = {(True, False): "causal", (True, True): "causal-window", (False, True): "window",
                (False, False): "full"}[self.causal, self.window]
        parts = [self.family, self.dtype, f"d{self.d_model}", f"f{self.d_ffn}",
                 f"h{self.heads_q}g{self.q_per_kv}x{self.head_dim}", self.norm, self.ffn, mask]
        if self.softcap:
            parts.append("softcap")
        parts.append("rope" if self.rope else "norope")
        return "_".join(parts)

    def parts(self) -> tuple[Spec, Spec]:
        """The specs of the ops the schedule calls, attention's and the FFN's; a layer they cannot run
        raises their ``SpecError``, which names the field (the same name here)."""
        attention = AttentionSpec(head_dim=self.head_dim, q_per_kv=self.q_per_kv,
                                               mask=self.attention_mask, softcap=self.softcap, dtype=self.dtype)
        ffn = BlockwiseFFNSpec(d_model=self.d_model, d_ffn=self.d_ffn, norm=self.norm, ffn=self.ffn,
                                         dtype=self.dtype)
        return attention, ffn

    @classmethod
    def for_layer(cls, config: Any, dtype: str) -> BlockwiseLayerSpec:
        """The spec of a ``tilegen.layers.LayerConfig`` in ``dtype``: what changes the schedule's code.

        A window whose right side is 0 is causal whatever ``config.causal`` says (the same keys);
        an unbounded window is none.
        """
        left, right = config.attention_bounds()
        causal = right == 0
        return cls(d_model=config.d_model, d_ffn=config.d_ffn, heads_q=config.heads_q, head_dim=config.head_dim,
                   q_per_kv=config.heads_q // config.heads_kv, causal=causal,
                   window=left is not None or (not causal and right is not None),
                   softcap=config.softcap is not None, rope=config.rope_theta is not None, norm=config.norm,
                   ffn=config.ffn, dtype=dtype)

    def launch_args(self, config: Any) -> dict[str, Any]:
        """The schedule's numeric arguments for ``config`` (a ``LayerConfig`` of this spec): only those
        the spec's code reads. Window sides are ints, ``None`` where unbounded."""
        left, right = config.attention_bounds()
        args: dict[str, Any] = {
            "eps": float(config.eps),
            "scale": float(config.scale) if config.scale is not None else 1.0 / math.sqrt(self.head_dim),
        }
        if self.rope:
            args["rope_theta"] = float(config.rope_theta)
        if self.softcap:
            args["softcap"] = float(config.softcap)
        if self.window:
            args["window_left"] = left
            if not self.causal:
                args["window_right"] = right
        return args
