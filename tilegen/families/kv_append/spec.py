"""The spec of the paged-KV append family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.ir import Spec, SpecError, check_int

__all__ = ["KVAppendSpec", "MAX_HEAD_DIM", "PAGE_SIZES"]

#: Page sizes of ``tilegen.PagedKVCache`` (kept equal to ``tilegen.ops.kv_cache.PAGE_SIZES``; a test says so).
PAGE_SIZES = (1, 8, 16, 32, 64, 128)
#: Widest head the kernel moves as one block row; dims that are not powers of two are padded and masked.
MAX_HEAD_DIM = 512


@dataclass(frozen=True)
class KVAppendSpec(Spec):
    """Writing new tokens' K and V into the pages of a ``PagedKVCache``.

    Attributes:
        head_dim: K's head dim.
        head_dim_v: V's head dim; ``None`` means equal to ``head_dim``.
        page_size: tokens per page; the kernel's page arithmetic is specialized on it.
        dtype: the cache's dtype (the new K and V have it too; nothing is converted).
    """

    family: ClassVar[str] = "kv_append"

    head_dim: int
    page_size: int
    head_dim_v: int | None = None

    def __post_init__(self) -> None:
        if type(self.head_dim_v) is int and self.head_dim_v == self.head_dim:
            object.__setattr__(self, "head_dim_v", None)  # one canonical form per kernel
        super().__post_init__()
        for name in ("head_dim", "head_dim_v"):
            value = getattr(self, name)
            if value is None and name == "head_dim_v":
                continue
            check_int(name, value)
            if not 1 <= value <= MAX_HEAD_DIM:
                raise SpecError(name, f"expected 1..{MAX_HEAD_DIM}, got {value}")
        check_int("page_size", self.page_size)
        if self.page_size not in PAGE_SIZES:
            raise SpecError("page_size", f"expected one of {PAGE_SIZES}, got {self.page_size}")

    __hash__ = Spec.__hash__  # the base caches it; a frozen dataclass would write its own

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def name(self) -> str:
        dims = f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v is not None else "")
        return f"{self.family}_{self.dtype}_{dims}_p{self.page_size}"
