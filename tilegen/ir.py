"""The IR's base: a frozen spec per kernel family, its canonical JSON and its hash.

Each kernel family (``tilegen.families``) declares one frozen dataclass deriving from
``Spec``. A spec holds only what changes the generated code; numeric values that do
not (the softmax scale, a softcap value, window sizes) are launch arguments, so one
compiled kernel and one tuned config serve every value of them.

The canonical JSON form is a spec's identity (``tilegen.families.spec_from_json`` reads it back,
through the registry): its hash names generated modules,
tuning studies and database rows. It leaves out every field that holds its default,
except the fields a family lists in ``ALWAYS`` (those its specs have always written),
so adding an optional field later changes the hash of no existing spec.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["IR_VERSION", "DTYPES", "Spec", "SpecError", "check_int", "check_choice", "check_bool"]

#: Bumped when a field's meaning changes, so old hashes never alias new semantics.
IR_VERSION = 1

DTYPES = ("fp16", "bf16", "fp32")


class SpecError(ValueError):
    """A spec field holds a value tilegen cannot generate code for."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, kw_only=True)
class Spec:
    """Fields every family's spec has. Subclasses are frozen dataclasses too.

    Attributes:
        dtype: input/output dtype; accumulation is always fp32.
    """

    #: The family this spec type belongs to (the registry's name for it).
    family: ClassVar[str]
    #: Fields written to the canonical JSON even at their default (see the module docstring).
    ALWAYS: ClassVar[frozenset[str]] = frozenset()

    dtype: str = "bf16"

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)

    def __hash__(self) -> int:
        # Specs key the dispatch tables: hash the fields once, not per lookup.
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash((type(self), *(getattr(self, f.name) for f in dataclasses.fields(self))))
            object.__setattr__(self, "_hash", value)
            return value

    def __getstate__(self) -> dict[str, Any]:
        # The hash above is Python's, salted per process for strings: a spec sent to another process (a tuning
        # worker) computes its own there, or it would miss every table its equal keys.
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def to_dict(self) -> dict[str, Any]:
        """The canonical fields: family, IR version, and every field not at its default (or in ``ALWAYS``)."""
        data: dict[str, Any] = {"family": self.family, "ir_version": IR_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.ALWAYS or f.default is dataclasses.MISSING or value != f.default:
                data[f.name] = value
        return data

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
        return f"{self.family}_{self.dtype}"

    def replace(self, **changes: Any) -> Spec:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_fields(cls, data: dict[str, Any]) -> Spec:
        """Build from JSON fields (family and IR version already removed); unknown or missing fields name themselves."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise SpecError(unknown[0], f"unknown field; known fields: {', '.join(sorted(fields))}")
        for name, f in fields.items():
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in data:
                raise SpecError(name, "missing")
        return cls(**data)


def check_int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, f"expected an int, got {value!r}")


def check_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SpecError(field, f"expected a bool, got {value!r}")


def check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpecError(field, f"expected one of {', '.join(choices)}; got {value!r}")
