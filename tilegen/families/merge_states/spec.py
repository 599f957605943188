"""The spec of the merge-states family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.ir import Spec, SpecError, check_int

__all__ = ["MergeStatesSpec", "MAX_HEAD_DIM"]

#: Widest head the kernel holds as one block row; dims that are not powers of two are padded and masked.
MAX_HEAD_DIM = 512


@dataclass(frozen=True)
class MergeStatesSpec(Spec):
    """Merging two partial attention results ``(o, lse)`` by their log-sum-exp.

    Attributes:
        head_dim: the outputs' head dim.
        dtype: the outputs' dtype; the LSEs are always fp32, the arithmetic fp32.
    """

    family: ClassVar[str] = "merge_states"

    head_dim: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("head_dim", self.head_dim)
        if not 1 <= self.head_dim <= MAX_HEAD_DIM:
            raise SpecError("head_dim", f"expected 1..{MAX_HEAD_DIM}, got {self.head_dim}")

    __hash__ = Spec.__hash__  # the base caches it; a frozen dataclass would write its own

    @property
    def name(self) -> str:
        return f"{self.family}_{self.dtype}_d{self.head_dim}"
