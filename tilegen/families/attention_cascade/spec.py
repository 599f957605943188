"""The spec of the cascade family: queries over a prefix tree of shared paged KV levels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.families.attention_fwd.spec import AttentionFields
from tilegen.families.attention_varlen.spec import PAGE_SIZES
from tilegen.dtypes import KV_DTYPES
from tilegen.ir import Spec, SpecError, check_choice, check_int

__all__ = ["CascadeSpec"]


@dataclass(frozen=True)
class CascadeSpec(AttentionFields):
    """Cascade attention over a paged cache (``tilegen.CascadeAttention``). Fields as in
    ``AttentionSpec``; ``mask`` is ``"none"`` or ``"causal"``, and it applies to the last level
    alone: every key of an earlier (shared) level precedes every query token that lies under it,
    so those levels are read whole. ``page_size`` is the cache's; ``kv_dtype`` the pages' when they
    are FP8 (``"fp8e4m3"``, ``"fp8e5m2"``: read with their scales, as ``PagedDecode`` reads them)."""

    family: ClassVar[str] = "attention_cascade"

    page_size: int = 16
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mask == "window":
            raise SpecError("mask", "a window over the levels of a prefix tree is not built; expected 'none' or "
                                    "'causal'")
        check_int("page_size", self.page_size)
        if self.page_size not in PAGE_SIZES:
            raise SpecError("page_size", f"expected one of {PAGE_SIZES}, got {self.page_size!r}")
        if self.kv_dtype is not None:
            check_choice("kv_dtype", self.kv_dtype, tuple(KV_DTYPES))

    __hash__ = Spec.__hash__

    @property
    def name(self) -> str:
        parts = self.name_parts() + [f"paged{self.page_size}"]
        if self.return_lse:
            parts.append("lse")
        if self.kv_dtype is not None:
            parts.append(f"kv{self.kv_dtype}")
        return "_".join(parts)
