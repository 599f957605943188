"""Mods under ``torch.compile``: traced once by tilegen's own tracer while Dynamo traces the call.

Dynamo cannot trace ``torch.fx.symbolic_trace``, and should not: the mod's canonical text is a constant of
the graph, like the spec's other fields. ``_trace`` runs it at trace time instead
(``torch.compiler.assume_constant_result``) and returns only constants: the text, what the text says of
the built-ins, and where the function reaches each captured tensor (a closure cell, a global, a default).
The tensors themselves are then read along those paths in traced code (``tilegen.mods.trace.fetch``), so
Dynamo makes them graph inputs: a compiled call passes the tensors of the moment, values written in place
included, never constants baked in at trace time.

Dynamo of torch 2.11 does neither half of that guard: it traced ``id()`` of a function passed in without guarding
on it (a second closure of the same code then reused the first's text: a silently wrong answer, seen on the H200)
and refused ``id()`` of one made inside the compiled function. Mods under ``torch.compile`` therefore need the
torch whose Dynamo does both, 2.13 (where the tests run); before it they are refused by name.

A constant result holds while the function does: ``entries`` takes ``id()`` of each mod, which makes Dynamo
guard on the function object itself (a closure is otherwise guarded by its code only, and
``sliding_window(64)`` after ``sliding_window(32)`` would reuse the first text). Eager calls cache traces
per function object too (``tilegen.mods.trace.traced``), so both see the same mod.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from tilegen.mods.builtin import builtin_of
from tilegen.mods.grad import check_differentiable as _check_differentiable
from tilegen.mods.grad import warned_of_atomics as _warned_of_atomics
from tilegen.mods.trace import TracedMod, fetch, locate, number_paths, traced

__all__ = ["Entry", "entries", "bind", "check_differentiable", "MIN_TORCH", "compiles_mods", "warned_of_atomics"]

MIN_TORCH = "2.13"


def compiles_mods() -> bool:
    """Whether this torch's Dynamo guards a graph on the mod function (its release, so 2.13's pre-releases count)."""
    from packaging.version import Version

    return Version(torch.__version__).release[:2] >= Version(MIN_TORCH).release[:2]


class Entry(NamedTuple):
    """A mod as ``torch.compile`` keeps it: constants only."""

    kind: str
    canonical: str
    names: tuple[str, ...]
    checks: tuple[tuple[int, int, tuple], ...]  # TracedMod.checks
    paths: tuple[tuple, ...]  # per captured tensor, for fetch
    builtin: object  # builtin_of(canonical, kind)
    numbers: tuple[tuple[tuple, object], ...] = ()  # (path, value) of the numbers the text holds (number_paths)


@torch.compiler.assume_constant_result
def _trace(fn: Callable, kind: str) -> Entry:
    mod = traced(fn, kind)
    paths = tuple(locate(fn, t) for t in mod.tensors)
    for name, path in zip(mod.names, paths):
        if path is None:
            raise NotImplementedError(f"{kind}: under torch.compile a captured tensor must be the mod's own closure "
                                      f"variable, global or default; {name!r} is reached otherwise (an attribute, "
                                      "an element of a container): bind it to a variable the mod closes over")
    return Entry(kind, mod.canonical, mod.names, mod.checks, paths, builtin_of(mod.canonical, kind),
                 number_paths(fn))


@torch.compiler.assume_constant_result  # at trace time: Dynamo of torch 2.11 fails inside packaging's Version
def _refusal(op: str) -> str:
    """What an older torch's compiled call with mods is refused with; empty where it compiles them."""
    if compiles_mods():
        return ""
    return (f"{op}: score_mod/mask_mod under torch.compile need torch {MIN_TORCH} or later; torch "
            f"{torch.__version__}'s Dynamo does not guard a graph on the mod function itself, so a second mod of the "
            "same code would reuse the first's. Call it eagerly, or outside the compiled function")


def entries(score_mod, mask_mod, op: str = "tilegen.attention") -> tuple[Entry | None, Entry | None]:
    """The mods' entries, read at trace time; Dynamo guards on the functions' identity. ``op`` names the caller in
    the refusal an older torch gets."""
    refusal = _refusal(op)
    if refusal:
        raise NotImplementedError(refusal)
    found = []
    for fn, kind in ((score_mod, "score_mod"), (mask_mod, "mask_mod")):
        if fn is None:
            found.append(None)
            continue
        id(fn)  # the guard (module docstring)
        entry = _trace(fn, kind)
        for path, value in entry.numbers:
            # Read in traced code and compared, a number makes Dynamo guard the graph on its value: one changed
            # later (a global rebound, a closure's variable assigned again) compiles the mod's new text, as an
            # eager call traces it again.
            if fetch(fn, path) != value:
                raise AssertionError(f"{kind}: a number the mod reads changed while it was traced")
        found.append(entry)
    return found[0], found[1]


def bind(score_mod, mask_mod, found: tuple[Entry | None, Entry | None]) -> list[TracedMod | None]:
    """The mods as ``bind_traced`` takes them, their captured tensors fetched in traced code (graph inputs)."""
    return [None if e is None else TracedMod(e.kind, e.canonical, tuple(fetch(fn, p) for p in e.paths), e.names,
                                             e.checks)
            for fn, e in zip((score_mod, mask_mod), found)]


@torch.compiler.assume_constant_result
def check_differentiable(score_mod: str | None, wanted: tuple[int, ...] = ()) -> None:
    """``tilegen.mods.grad.check_differentiable`` at trace time: a ``ModGradError`` names the operation when the
    graph is made, as an eager call raises it before its forward runs."""
    _check_differentiable(score_mod, wanted)


@torch.compiler.assume_constant_result
def warned_of_atomics() -> bool:
    """``tilegen.mods.grad.warned_of_atomics`` at trace time: Dynamo has no rule for the flag's ``warn_only``, and
    traced code emits no warning."""
    return _warned_of_atomics()
