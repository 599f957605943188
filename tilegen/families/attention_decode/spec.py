"""The spec of the batch-decode family: one query token per sequence against a paged cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.families.attention_fwd.spec import AttentionFields, check_mods, mod_name_parts
from tilegen.families.attention_varlen.spec import PAGE_SIZES, check_kv_dtype
from tilegen.ir import Spec, SpecError, check_choice, check_int

__all__ = ["DecodeSpec", "MAX_Q_TOKENS"]

#: Query tokens per sequence a decode kernel takes: one, or speculative decoding's few.
MAX_Q_TOKENS = 8


@dataclass(frozen=True)
class DecodeSpec(AttentionFields):
    """Batch decode. Fields as in ``AttentionSpec``; ``kv_layout`` is ``"paged"`` (a
    ``tilegen.PagedKVCache``, whose ``page_size`` is part of the key) or ``"dense"``
    (``[batch, kv_heads, n_k, dim]`` tensors, every sequence as long: ``tilegen.attention``
    with a few query rows); ``q_tokens`` query tokens per sequence, aligned bottom-right;
    ``kv_dtype``: the pages' dtype when it is not the query's, ``"fp8e4m3"`` or ``"fp8e5m2"``
    (paged only: FP8 pages with their scales, dequantized in the kernel); ``score_mod``/``mask_mod``
    as in ``AttentionSpec`` (paged only), with ``b`` the sequence and ``q_idx`` the query's position in it
    (its last, ``n_k - q_tokens + t``), ``kv_idx`` the key's."""

    family: ClassVar[str] = "attention_decode"

    kv_layout: str = "paged"
    page_size: int | None = None
    q_tokens: int = 1
    kv_dtype: str | None = None
    score_mod: str | None = None
    mask_mod: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_mods(self)
        check_choice("kv_layout", self.kv_layout, ("paged", "dense"))
        check_int("q_tokens", self.q_tokens)
        if not 1 <= self.q_tokens <= MAX_Q_TOKENS:
            raise SpecError("q_tokens", f"expected 1..{MAX_Q_TOKENS} query tokens per sequence, got {self.q_tokens}")
        if self.kv_layout == "dense":
            if self.page_size is not None:
                raise SpecError("page_size", f"dense KV has no pages; got {self.page_size!r}")
        else:
            check_int("page_size", self.page_size)
            if self.page_size not in PAGE_SIZES:
                raise SpecError("page_size", f"expected one of {PAGE_SIZES} for paged KV, got {self.page_size!r}")
        check_kv_dtype(self)
        if self.kv_layout == "dense" and (self.score_mod is not None or self.mask_mod is not None):
            # Dense decode serves tilegen.attention's short queries, whose mods see top-left positions; calls
            # with mods take the dense forward kernel instead.
            raise SpecError("kv_layout", "mods are for paged decode (tilegen.PagedDecode); dense calls with mods "
                                         "run the attention_fwd family")

    __hash__ = Spec.__hash__

    @property
    def name(self) -> str:
        parts = [self.family, self.dtype, f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v else ""),
                 f"g{self.q_per_kv}", self.mask]
        if self.softcap:
            parts.append("softcap")
        parts.append(f"paged{self.page_size}" if self.kv_layout == "paged" else "dense")
        if self.q_tokens > 1:
            parts.append(f"q{self.q_tokens}")
        if self.return_lse:
            parts.append("lse")
        if self.kv_dtype is not None:
            parts.append(f"kv{self.kv_dtype}")
        return "_".join(parts + mod_name_parts(self))
