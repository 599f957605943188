"""The spec of the blockwise FFN family: pre-norm feed-forward with its residual, over token rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.ir import Spec, SpecError, check_choice, check_int

__all__ = ["BlockwiseFFNSpec", "NORMS", "FFNS", "MAX_D_MODEL", "MAX_D_FFN"]

NORMS = ("rmsnorm", "layernorm")
FFNS = ("swiglu", "gelu_mlp")
#: The norm kernel holds a whole row in registers (padded to a power of two).
MAX_D_MODEL = 16384
MAX_D_FFN = 1 << 17


@dataclass(frozen=True)
class BlockwiseFFNSpec(Spec):
    """``out = x + ffn(norm(x))`` for rows of ``x`` [tokens, d_model].

    Attributes:
        d_model: the rows' width.
        d_ffn: the FFN's hidden width.
        norm: ``rmsnorm`` (weight only) or ``layernorm`` (weight and bias); eps is a launch argument.
        ffn: ``swiglu`` (``down(silu(gate(xn)) * up(xn))``, Llama's MLP) or ``gelu_mlp``
            (``down(gelu(up(xn)))``, exact erf GELU); no biases in either.
        dtype: of x, the weights and out; accumulation is fp32.
    """

    family: ClassVar[str] = "blockwise_ffn"

    d_model: int
    d_ffn: int
    norm: str = "rmsnorm"
    ffn: str = "swiglu"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("d_model", self.d_model)
        check_int("d_ffn", self.d_ffn)
        if not 1 <= self.d_model <= MAX_D_MODEL:
            raise SpecError("d_model", f"expected 1..{MAX_D_MODEL}, got {self.d_model}")
        if not 1 <= self.d_ffn <= MAX_D_FFN:
            raise SpecError("d_ffn", f"expected 1..{MAX_D_FFN}, got {self.d_ffn}")
        check_choice("norm", self.norm, NORMS)
        check_choice("ffn", self.ffn, FFNS)

    __hash__ = Spec.__hash__  # the base caches it; a frozen dataclass would write its own

    @property
    def name(self) -> str:
        return f"{self.family}_{self.norm}_{self.ffn}_{self.dtype}_d{self.d_model}_f{self.d_ffn}"
