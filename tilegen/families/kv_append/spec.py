"""The spec of the paged-KV append family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.dtypes import KV_DTYPES
from tilegen.ir import Spec, SpecError, check_choice, check_int

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
        dtype: the new K and V's dtype: the cache's too (nothing is converted), unless
        page_dtype: ``"fp8e4m3"``/``"fp8e5m2"``, FP8 pages: each value is divided by its scale
            (per tensor or per KV head), saturated to the format's largest finite value and
            rounded to nearest on the way in. ``None``: the pages are ``dtype``.
    """

    family: ClassVar[str] = "kv_append"

    head_dim: int
    page_size: int
    head_dim_v: int | None = None
    page_dtype: str | None = None

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
        if self.page_dtype is not None:
            check_choice("page_dtype", self.page_dtype, tuple(KV_DTYPES))

    __hash__ = Spec.__hash__  # the base caches it; a frozen dataclass would write its own

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def name(self) -> str:
        dims = f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v is not None else "")
        pages = "" if self.page_dtype is None else f"_{self.page_dtype}"
        return f"{self.family}_{self.dtype}_{dims}_p{self.page_size}{pages}"
