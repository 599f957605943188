"""The spec of the ragged-batch attention family: packed sequences, keys ragged or in pages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.dtypes import KV_DTYPES
from tilegen.families.attention_fwd.spec import AttentionFields, check_mods, mod_name_parts
from tilegen.ir import Spec, SpecError, check_choice, check_int

__all__ = ["VarlenAttentionSpec", "LAYOUTS", "check_kv_dtype"]

LAYOUTS = ("ragged", "paged")
PAGE_SIZES = (1, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class VarlenAttentionSpec(AttentionFields):
    """Attention forward over a ragged batch (FlashAttention's varlen convention).

    Attributes:
        head_dim, head_dim_v, q_per_kv, mask, softcap, return_lse: as in ``AttentionSpec``;
            the mask is aligned bottom-right per sequence.
        kv_layout: ``"ragged"`` (K and V packed like Q) or ``"paged"`` (``tilegen.PagedKVCache``).
        page_size: tokens per page, for ``"paged"`` only (part of the tuning key).
        kv_dtype: ``None`` (the pages have the query's dtype) or ``"fp8e4m3"``/``"fp8e5m2"``: FP8
            pages with per-tensor or per-KV-head scales, read as fp8 and dequantized in the kernel
            (paged only).
        score_mod, mask_mod: as in ``AttentionSpec``; b is the sequence, q_idx and kv_idx positions in it
            (ragged: a query's row among the sequence's queries; paged: its position among the keys,
            ``n_k - n_q + i``, as ``PagedAttention`` defines it).
    """

    family: ClassVar[str] = "attention_varlen"

    kv_layout: str = "ragged"
    page_size: int | None = None
    kv_dtype: str | None = None
    score_mod: str | None = None
    mask_mod: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_mods(self)
        check_choice("kv_layout", self.kv_layout, LAYOUTS)
        if self.kv_layout == "paged":
            check_int("page_size", self.page_size)
            if self.page_size not in PAGE_SIZES:
                raise SpecError("page_size", f"expected one of {PAGE_SIZES} for paged KV, got {self.page_size!r}")
        elif self.page_size is not None:
            raise SpecError("page_size", f"only paged KV has pages; got {self.page_size!r} for {self.kv_layout!r}")
        check_kv_dtype(self)

    __hash__ = Spec.__hash__

    @property
    def name(self) -> str:
        parts = self.name_parts()
        parts.append(self.kv_layout + (str(self.page_size) if self.page_size else ""))
        if self.return_lse:
            parts.append("lse")
        if self.kv_dtype is not None:
            parts.append(f"kv{self.kv_dtype}")
        return "_".join(parts + mod_name_parts(self))


def check_kv_dtype(spec) -> None:
    """``kv_dtype`` is None or an FP8 format, and only paged KV holds FP8 (it is where the scales live)."""
    if spec.kv_dtype is None:
        return
    check_choice("kv_dtype", spec.kv_dtype, tuple(KV_DTYPES))
    if spec.kv_layout != "paged":
        raise SpecError("kv_dtype", f"FP8 KV is read from a paged cache only; got kv_layout={spec.kv_layout!r}")
