"""The spec of the ragged-batch attention family: packed sequences, keys ragged or in pages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.families.attention_fwd.spec import AttentionFields, check_mods, mod_name_parts
from tilegen.ir import Spec, SpecError, check_choice

__all__ = ["VarlenAttentionSpec", "LAYOUTS"]

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
        score_mod, mask_mod: as in ``AttentionSpec``; b is the sequence, q_idx and kv_idx positions in it.
    """

    family: ClassVar[str] = "attention_varlen"

    kv_layout: str = "ragged"
    page_size: int | None = None
    score_mod: str | None = None
    mask_mod: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_mods(self)
        check_choice("kv_layout", self.kv_layout, LAYOUTS)
        if self.kv_layout == "paged":
            if self.page_size not in PAGE_SIZES or isinstance(self.page_size, bool):
                raise SpecError("page_size", f"expected one of {PAGE_SIZES} for paged KV, got {self.page_size!r}")
        elif self.page_size is not None:
            raise SpecError("page_size", f"only paged KV has pages; got {self.page_size!r} for {self.kv_layout!r}")

    __hash__ = Spec.__hash__

    @property
    def name(self) -> str:
        parts = self.name_parts()
        parts.append(self.kv_layout + (str(self.page_size) if self.page_size else ""))
        if self.return_lse:
            parts.append("lse")
        return "_".join(parts + mod_name_parts(self))
