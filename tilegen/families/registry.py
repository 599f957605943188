"""The registry of kernel families: the one place that maps specs, names and types to families."""

from __future__ import annotations

import json
from typing import Any

from tilegen.families.base import Family
from tilegen.ir import IR_VERSION, Spec, SpecError

__all__ = ["register", "family_of", "get", "families", "spec_type", "spec_from_json"]

_by_name: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make ``family`` known by its name. Registering the same family again is a no-op."""
    known = _by_name.get(family.name)
    if known is not None and known != family:
        raise ValueError(f"kernel family {family.name!r} is already registered as {type(known).__qualname__}")
    if family.spec_type.family != family.name:
        raise ValueError(f"{family.name}: its spec type says family {family.spec_type.family!r}")
    _by_name.setdefault(family.name, family)
    return _by_name[family.name]


def get(name: str) -> Family:
    """The family registered as ``name``; a ``SpecError`` on ``family`` lists the known ones."""
    try:
        return _by_name[name]
    except (KeyError, TypeError):
        raise SpecError("family", f"unknown kernel family {name!r}; known: {', '.join(map(repr, _by_name))}") from None


def family_of(spec: Spec) -> Family:
    """The family that implements ``spec``."""
    return get(type(spec).family)


def spec_type(name: str) -> type[Spec]:
    return get(name).spec_type


def families() -> list[Family]:
    """Every registered family, in registration order."""
    return list(_by_name.values())


def spec_from_json(text: str | dict[str, Any]) -> Spec:
    """Parse a canonical form (or any JSON object with a family's fields) into that family's spec type.

    ``"family"`` picks the type and must be there: a spec that names none is refused rather than
    read as some family's, which would make the answer depend on what was registered first.
    """
    data = json.loads(text) if isinstance(text, str) else dict(text)
    if not isinstance(data, dict):
        raise SpecError("spec", f"expected a JSON object, got {type(data).__name__}")
    if "family" not in data:
        raise SpecError("family", f"missing; a spec names its kernel family, one of: {', '.join(map(repr, _by_name))}")
    cls = spec_type(data.pop("family"))
    version = data.pop("ir_version", IR_VERSION)
    if type(version) is not int or version != IR_VERSION:
        raise SpecError("ir_version", f"this tilegen reads IR version {IR_VERSION}, got {version}")
    return cls.from_fields(data)
