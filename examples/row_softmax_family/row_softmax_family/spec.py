"""The spec of the row-softmax family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.ir import Spec, check_bool


@dataclass(frozen=True)
class RowSoftmaxSpec(Spec):
    """Softmax (or log-softmax) over the last dim of a [rows, cols] matrix."""

    family: ClassVar[str] = "row_softmax"

    log: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool("log", self.log)

    __hash__ = Spec.__hash__

    @property
    def name(self) -> str:
        return f"{self.family}_{self.dtype}" + ("_log" if self.log else "")
