"""The spec of the RoPE family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.ir import Spec, SpecError, check_int

__all__ = ["MAX_HEAD_DIM", "RopeSpec"]

#: Widest head the kernel holds as one block row; halves that are not powers of two are padded and masked.
MAX_HEAD_DIM = 512


@dataclass(frozen=True)
class RopeSpec(Spec):
    """Rotate-half RoPE of ``[tokens, heads, head_dim]`` by per-token cos and sin tables.

    Attributes:
        head_dim: the rotated vectors' length, even: element i pairs with i + head_dim / 2.
        dtype: the rotated tensor's dtype; the tables may be any float dtype, the arithmetic is fp32.
    """

    family: ClassVar[str] = "rope"

    head_dim: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("head_dim", self.head_dim)
        if not 2 <= self.head_dim <= MAX_HEAD_DIM or self.head_dim % 2:
            raise SpecError("head_dim", f"expected an even number in 2..{MAX_HEAD_DIM}, got {self.head_dim}")

    __hash__ = Spec.__hash__  # the base caches it; a frozen dataclass would write its own

    @property
    def name(self) -> str:
        return f"{self.family}_{self.dtype}_d{self.head_dim}"
