"""The spec of the dense attention-forward family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.ir import Spec, SpecError, check_bool, check_choice, check_int
from tilegen.mods.lower import ModSyntaxError, check_mod_field, mod_name

__all__ = ["AttentionFields", "AttentionSpec", "MASKS", "KV_LAYOUTS", "SUPPORTED_HEAD_DIMS", "check_attention_fields",
           "check_mods", "mod_name_parts", "without_lse"]

MASKS = ("none", "causal", "window")
KV_LAYOUTS = ("contiguous", "ragged", "paged")
#: Head dims the dense template accepts: multiples of 8 from 16 to 256. Dims that are
#: not powers of two are padded to the next one inside the kernel and masked.
SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 8))


def without_lse(spec) -> tuple:
    """The spec whose tuned rows serve ``spec`` where it has none (``Family.rows_from``): the same forward without
    its LSE, which a training call asks for (the backward reads it) but ``tilegen tune`` presets and inference
    tune without. Writing the LSE is one store of a row's sum after its last key block, so a config's speed
    ranks alike with or without it."""
    return (spec.replace(return_lse=False),) if spec.return_lse else ()


def check_attention_fields(spec) -> None:
    """Validate the fields every attention family's spec has (head dims, grouping, mask, flags);
    an explicit V dim equal to ``head_dim`` becomes ``None``, one canonical form per kernel."""
    if type(spec.head_dim_v) is int and spec.head_dim_v == spec.head_dim:
        object.__setattr__(spec, "head_dim_v", None)
    check_int("head_dim", spec.head_dim)
    if spec.head_dim not in SUPPORTED_HEAD_DIMS:
        raise SpecError("head_dim", f"expected a multiple of 8 in [16, 256], got {spec.head_dim}")
    if spec.head_dim_v is not None:
        check_int("head_dim_v", spec.head_dim_v)
        if spec.head_dim_v not in SUPPORTED_HEAD_DIMS:
            raise SpecError("head_dim_v", f"expected None or a multiple of 8 in [16, 256], got {spec.head_dim_v}")
    check_int("q_per_kv", spec.q_per_kv)
    if spec.q_per_kv < 1:
        raise SpecError("q_per_kv", f"expected a positive integer, got {spec.q_per_kv}")
    check_choice("mask", spec.mask, MASKS)
    check_bool("softcap", spec.softcap)
    check_bool("return_lse", spec.return_lse)


def check_mods(spec) -> None:
    """Validate a spec's ``score_mod``/``mask_mod`` (canonical texts of ``tilegen.mods``)."""
    for field in ("score_mod", "mask_mod"):
        try:
            check_mod_field(field, getattr(spec, field))
        except ModSyntaxError as e:
            raise SpecError(field, str(e)) from None
    if spec.softcap and spec.score_mod is not None:
        # Which would apply first is a choice the caller should make: tilegen.mods.library.softcap is a score mod.
        raise SpecError("softcap", "with a score_mod: put the cap into the score_mod (tilegen.mods.library.softcap)")


def mod_name_parts(spec) -> list[str]:
    return [mod_name(f, getattr(spec, f)) for f in ("score_mod", "mask_mod") if getattr(spec, f) is not None]


@dataclass(frozen=True)
class AttentionFields(Spec):
    """The fields every attention family's spec has (see ``AttentionSpec`` for their meaning)."""

    head_dim: int
    head_dim_v: int | None = None
    q_per_kv: int = 1
    mask: str = "none"
    softcap: bool = False
    return_lse: bool = False

    def __post_init__(self) -> None:
        check_attention_fields(self)
        super().__post_init__()

    __hash__ = Spec.__hash__  # a frozen dataclass would otherwise write its own, per call

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def name_parts(self) -> list[str]:
        """The start of a spec's name: family, dtype, head dims, grouping, mask and softcap."""
        parts = [self.family, self.dtype,
                 f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v is not None else ""),
                 f"g{self.q_per_kv}", self.mask]
        return parts + ["softcap"] if self.softcap else parts


@dataclass(frozen=True)
class AttentionSpec(AttentionFields):
    """One attention-forward variant.

    Attributes:
        head_dim: query/key head dimension.
        head_dim_v: value head dimension; ``None`` means equal to ``head_dim``.
        q_per_kv: query heads per KV head: 1 is MHA, >1 is GQA (MQA is GQA with
            one KV head, so its ratio is the query head count).
        mask: ``"none"``, ``"causal"`` (bottom-right aligned when the query is
            shorter than the key) or ``"window"`` (left/right bounds around the
            same diagonal, given at launch).
        softcap: whether logits pass through ``softcap * tanh(s / softcap)``.
        dtype: input/output dtype; accumulation is always fp32.
        kv_layout: ``"contiguous"``; ``"ragged"`` and ``"paged"`` are reserved
            for the serving kernels and do not lower yet.
        return_lse: whether the natural-log log-sum-exp per row is written.
        score_mod, mask_mod: FlexAttention's mods as canonical texts (``tilegen.mods``), or ``None``;
            they are code, so they are fields (left out of the JSON when ``None``).
    """

    family: ClassVar[str] = "attention_fwd"
    # Every field of IR version 1 is written even at its default, so the hashes of the
    # specs tuned so far stay what they were; fields added later are left out at their default.
    ALWAYS: ClassVar[frozenset[str]] = frozenset(
        {"head_dim", "head_dim_v", "q_per_kv", "mask", "softcap", "dtype", "kv_layout", "return_lse"}
    )

    kv_layout: str = "contiguous"
    score_mod: str | None = None
    mask_mod: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("kv_layout", self.kv_layout, KV_LAYOUTS)
        check_mods(self)

    __hash__ = Spec.__hash__

    @property
    def name(self) -> str:
        parts = [
            self.family,
            self.dtype,
            f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v is not None else ""),
            f"g{self.q_per_kv}",
            self.mask,
        ]
        if self.softcap:
            parts.append("softcap")
        if self.kv_layout != "contiguous":
            parts.append(self.kv_layout)
        if self.return_lse:
            parts.append("lse")
        return "_".join(parts + mod_name_parts(self))
