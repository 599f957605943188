"""The registry of kernel families: the one place that maps specs, names and types to families.

Families come from three places: tilegen's own (``tilegen.families`` registers its kernel
families, ``tilegen.layers`` its layer family), a ``register`` call at run time, and the Python
entry points of group ``tilegen.families`` that installed packages declare, each naming a
``Family`` object (``row_softmax_family = "row_softmax_family:FAMILY"``). Entry points are loaded
once, on the first lookup of a name not registered yet or on ``families()``: a command that
never meets another package's family never imports it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from tilegen.families.base import Family
from tilegen.ir import IR_VERSION, Spec, SpecError

__all__ = ["ENTRY_POINT_GROUP", "register", "family_of", "get", "families", "spec_type", "spec_from_json"]

#: The entry point group whose entries (``Family`` objects) tilegen registers.
ENTRY_POINT_GROUP = "tilegen.families"

log = logging.getLogger(__name__)

_by_name: dict[str, Family] = {}
_entry_points_loaded = False


def register(family: Family) -> Family:
    """Make ``family`` known by its name; returns the registered one. Registering an equal family
    again is a no-op (a tuning worker registers the copy it unpickles); another by that name is refused."""
    if not isinstance(family, Family):
        raise TypeError(f"family: expected a tilegen.families.Family, got {family!r}")
    known = _by_name.get(family.name)
    if known is not None and known != family:
        raise ValueError(f"kernel family {family.name!r} is already registered, with other parts")
    return _by_name.setdefault(family.name, family)


def load_entry_points() -> None:
    """Register the families of group ``tilegen.families`` once. A bad entry point (it fails to
    import, names no ``Family``, or takes a registered name) is one logged warning naming it, never
    an error: the other families, and commands that do not need it, still work."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name!r} ({point.value}) of group {ENTRY_POINT_GROUP!r}"
        try:
            register(point.load())
        except Exception as e:  # a broken plugin must not take the rest of tilegen with it
            log.warning("tilegen: skipping %s: %s: %s", where, type(e).__name__, e)


def get(name: str) -> Family:
    """The family registered as ``name``; a ``SpecError`` on ``family`` lists the known ones."""
    try:
        return _by_name[name]
    except (KeyError, TypeError):
        pass
    load_entry_points()
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
    """Every family, installed ones included, in registration order."""
    load_entry_points()
    return list(_by_name.values())


def spec_from_json(text: str | dict[str, Any]) -> Spec:
    """Parse a canonical form (or any JSON object with a family's fields) into that family's spec type.

    ``"family"`` picks the type and must be there: a spec that names none is refused rather than
    read as some family's, which would make the answer depend on what was registered first.
    """
    if isinstance(text, (str, bytes, bytearray)):
        data = json.loads(text)
    elif isinstance(text, Mapping):
        data = dict(text)
    else:
        raise SpecError("spec", f"expected JSON text or a dict, got {type(text).__name__}")
    if not isinstance(data, dict):
        raise SpecError("spec", f"expected a JSON object, got {type(data).__name__}")
    if "family" not in data:
        known = ", ".join(repr(f.name) for f in families())
        raise SpecError("family", f"missing; a spec names its kernel family, one of: {known}")
    cls = spec_type(data.pop("family"))
    version = data.pop("ir_version", IR_VERSION)
    if type(version) is not int or version != IR_VERSION:
        raise SpecError("ir_version", f"this tilegen reads IR version {IR_VERSION}, got {version}")
    return cls.from_fields(data)
