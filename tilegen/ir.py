"""The IR: frozen dataclasses that describe one attention variant.

A spec holds only what changes the generated code. Numeric values that do not
(the softmax scale, the softcap value, the window sizes) are launch arguments,
so one compiled kernel and one tuned config serve every value of them.

The canonical JSON form is the spec's identity: its hash names generated
modules, tuning studies and database rows.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DTYPES",
    "MASKS",
    "KV_LAYOUTS",
    "SUPPORTED_HEAD_DIMS",
    "IR_VERSION",
    "AttentionSpec",
    "SpecError",
    "spec_from_json",
]

#: Bumped when a field is added or its meaning changes, so old hashes never
#: alias new semantics.
IR_VERSION = 1

DTYPES = ("fp16", "bf16", "fp32")
MASKS = ("none", "causal", "window")
KV_LAYOUTS = ("contiguous", "ragged", "paged")
#: Head dims the dense template accepts: multiples of 8 from 16 to 256. Dims that are
#: not powers of two are padded to the next one inside the kernel and masked.
SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 8))


class SpecError(ValueError):
    """A spec field holds a value tilegen cannot generate code for."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class AttentionSpec:
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
    """

    head_dim: int
    head_dim_v: int | None = None
    q_per_kv: int = 1
    mask: str = "none"
    softcap: bool = False
    dtype: str = "bf16"
    kv_layout: str = "contiguous"
    return_lse: bool = False

    def __post_init__(self) -> None:
        if type(self.head_dim_v) is int and self.head_dim_v == self.head_dim:
            # One canonical form per kernel: an explicit V dim equal to head_dim is the default.
            object.__setattr__(self, "head_dim_v", None)
        _check_int("head_dim", self.head_dim)
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise SpecError("head_dim", f"expected a multiple of 8 in [16, 256], got {self.head_dim}")
        if self.head_dim_v is not None:
            _check_int("head_dim_v", self.head_dim_v)

            if self.head_dim_v not in SUPPORTED_HEAD_DIMS:
                raise SpecError(
                    "head_dim_v", f"expected None or a multiple of 8 in [16, 256], got {self.head_dim_v}"
                )
        _check_int("q_per_kv", self.q_per_kv)
        if self.q_per_kv < 1:
            raise SpecError("q_per_kv", f"expected a positive integer, got {self.q_per_kv}")
        _check_choice("mask", self.mask, MASKS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_layout", self.kv_layout, KV_LAYOUTS)
        for name in ("softcap", "return_lse"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(name, f"expected a bool, got {getattr(self, name)!r}")

    def __hash__(self) -> int:
        # Specs key the dispatch tables on every call: hash the fields once, not per lookup.
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", value)
            return value

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def family(self) -> str:
        """The kernel family (template) that implements this spec."""
        return "attention_fwd"

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "ir_version": IR_VERSION, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace, so equal specs give equal text."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @functools.cached_property
    def hash(self) -> str:
        """Short stable hash of the canonical JSON (computed once per object)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """A readable name that spells the spec out, for modules and logs."""
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
        return "_".join(parts)

    def replace(self, **changes: Any) -> AttentionSpec:
        return dataclasses.replace(self, **changes)


def spec_from_json(text: str | dict[str, Any]) -> AttentionSpec:
    """Parse the canonical form (or any JSON object with the same fields)."""
    data = json.loads(text) if isinstance(text, str) else dict(text)
    if not isinstance(data, dict):
        raise SpecError("spec", f"expected a JSON object, got {type(data).__name__}")
    family = data.pop("family", "attention_fwd")
    if family != "attention_fwd":
        raise SpecError("family", f"unknown kernel family {family!r}; known: 'attention_fwd'")
    version = data.pop("ir_version", IR_VERSION)
    if type(version) is not int or version != IR_VERSION:
        raise SpecError("ir_version", f"this tilegen reads IR version {IR_VERSION}, got {version}")
    fields = {f.name for f in dataclasses.fields(AttentionSpec)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise SpecError(unknown[0], f"unknown field; known fields: {', '.join(sorted(fields))}")
    if "head_dim" not in data:
        raise SpecError("head_dim", "missing")
    return AttentionSpec(**data)


def _check_int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, f"expected an int, got {value!r}")


def _check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpecError(field, f"expected one of {', '.join(choices)}; got {value!r}")
