"""Mods named by import path, as ``tilegen tune --score-mod pkg.module:attr`` takes them.

A tuning trial runs in another process and builds its own inputs, so it needs the mod itself,
not only the canonical text a spec holds: the path travels with the tuning problem (a string
pickles; a closure does not) and each trial imports it again.

The attribute is either a mod (a function of the mod's 5 or 4 positional arguments, used as it
is) or a factory: a callable without positional parameters, called with the keywords ``batch``,
``heads`` (query heads), ``n_q``, ``n_k`` and ``device`` of the problem a trial measures, which
returns the mod built for that shape (so that captured tensors such as document ids or a per-head
table fit every tuned bucket). Either way the mod must trace to the spec's canonical text.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from tilegen.mods.trace import CallRanges

__all__ = ["ENV", "load", "build", "canonical_text", "export", "sources_for", "TuningMods", "tuning_mods"]

#: Where ``tilegen tune`` leaves the paths for the processes it starts (forked or spawned alike):
#: JSON ``{"score_mod": "pkg.module:attr", "mask_mod": ...}``.
ENV = "TILEGEN_TUNE_MODS"
_OPTIONS = {"score_mod": "--score-mod", "mask_mod": "--mask-mod"}
#: The shape a factory is built at to read the mod's canonical text, which depends on no size.
_NOMINAL = {"batch": 1, "heads": 1, "n_q": 16, "n_k": 16, "device": torch.device("cpu")}


def load(path: str, option: str) -> Callable:
    """The attribute ``path`` (``pkg.module:attr``, ``attr`` possibly dotted) names; a ``ValueError``
    names the option and what was expected."""
    expected = "expected pkg.module:function (a score or mask mod, or a factory of one)"
    module_name, colon, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not colon or not module_name or not attr:
        raise ValueError(f"{option}: {expected}, got {path!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        # The `tilegen` script's sys.path starts at its own folder, not the one it runs in, where the
        # user's module usually is (python -m puts that folder first).
        sys.path.append(os.getcwd())
    try:
        value: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the path's
        raise ValueError(f"{option}: cannot import module {module_name!r} ({type(e).__name__}: {e}); {expected}") \
            from None
    for part in attr.split("."):
        if not hasattr(value, part):
            raise ValueError(f"{option}: module {module_name!r} has no attribute {attr!r}; {expected}")
        value = getattr(value, part)
    if not callable(value):
        raise ValueError(f"{option}: {path} is a {type(value).__name__}, not callable; {expected}")
    return value


def _is_factory(fn: Callable) -> bool:
    """A factory takes no positional argument; a mod takes its roles positionally."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)


def build(fn: Callable, option: str, *, batch: int, heads: int, n_q: int, n_k: int, device) -> Callable:
    """The mod ``fn`` is or, for a factory, the one it builds for the shape."""
    if not _is_factory(fn):
        return fn
    try:
        mod = fn(batch=batch, heads=heads, n_q=n_q, n_k=n_k, device=torch.device(device))
    except Exception as e:  # the user's code: said in one line, whatever it raised
        raise ValueError(f"{option}: the factory {getattr(fn, '__qualname__', fn)!s} failed for batch={batch}, "
                         f"heads={heads}, n_q={n_q}, n_k={n_k} ({type(e).__name__}: {e}); a factory takes keyword "
                         "arguments batch, heads, n_q, n_k, device and returns a mod") from None
    if not callable(mod):
        raise ValueError(f"{option}: the factory returned a {type(mod).__name__}, expected a mod function")
    return mod


def canonical_text(path: str, kind: str) -> str:
    """The canonical text of the mod ``path`` names (a factory's, built at a nominal shape on the CPU)."""
    from tilegen.mods.trace import trace

    option = _OPTIONS[kind]
    mod = build(load(path, option), option, **_NOMINAL)
    try:
        return trace(mod, kind).canonical
    except (TypeError, ValueError) as e:
        raise ValueError(f"{option}: {path}: {e}") from None


def export(sources: dict[str, str]) -> None:
    """Hand the paths to this process's tuning problems and to the processes it starts."""
    os.environ[ENV] = json.dumps(sources)


def sources_for(spec) -> tuple[str | None, str | None]:
    """The import paths of ``spec``'s mods, as ``tilegen tune`` exported them; ``(None, None)`` for a
    spec without mods. A mod spec without its path cannot be tuned: a trial needs the function."""
    texts = (getattr(spec, "score_mod", None), getattr(spec, "mask_mod", None))
    if texts == (None, None):
        return None, None
    try:
        named = json.loads(os.environ.get(ENV) or "{}")
    except json.JSONDecodeError:
        named = {}
    paths = tuple(named.get(kind) if text is not None else None for kind, text in zip(_OPTIONS, texts))
    missing = [option for (kind, option), text, path in zip(_OPTIONS.items(), texts, paths)
               if text is not None and path is None]
    if missing:
        raise NotImplementedError(f"score_mod/mask_mod: a spec with mods is tuned through tilegen tune "
                                  f"{' and '.join(o + ' pkg.module:function' for o in missing)}, which names the "
                                  "mod (a trial needs its function and captured tensors)")
    return paths


@dataclass
class TuningMods:
    """One problem's mods, built for its shape: the functions (for the reference), their captured tensors
    (for the launches) and a mask mod's block tables per block shape, made at a config's first launch
    so that timed launches reuse them, as a call like the last one does."""

    score_mod: Callable | None
    mask_mod: Callable | None
    tensors: tuple[torch.Tensor, ...]
    mask_text: str | None
    mask_tensors: tuple[torch.Tensor, ...]
    _tables: dict = field(default_factory=dict)

    def block_table(self, batch: int, heads: int, n_q: int, n_k: int, block_m: int, block_n: int, device):
        key = (batch, heads, n_q, n_k, block_m, block_n)
        if key not in self._tables:
            from tilegen.mods.blocks import block_table

            self._tables[key] = block_table(self.mask_text, self.mask_tensors, batch, heads, n_q, n_k, block_m,
                                            block_n, device)
        return self._tables[key]


def tuning_mods(spec, paths: tuple[str | None, str | None], ranges: CallRanges, *, batch: int, heads: int,
                n_q: int, n_k: int, device) -> TuningMods:
    """Import and build ``spec``'s mods for a problem of this shape; their indices are checked against
    ``ranges`` (the problem's roles) and their text against the spec's."""
    from tilegen.mods.trace import bind_mods

    mods = []
    for (kind, option), path in zip(_OPTIONS.items(), paths):
        mods.append(None if path is None else build(load(path, option), option, batch=batch, heads=heads, n_q=n_q,
                                                    n_k=n_k, device=device))
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the current device, as the tensors were made on
        device = torch.device("cuda", torch.cuda.current_device())
    bound = bind_mods(*mods, device, ranges)
    for (kind, option), path, text in zip(_OPTIONS.items(), paths, (bound.score_mod, bound.mask_mod)):
        if text != getattr(spec, kind):
            raise ValueError(f"{option}: {path} builds a different {kind} at batch {batch}, heads {heads}, "
                             f"n_q {n_q}, n_k {n_k} than the spec's ({text} against {getattr(spec, kind)})")
    return TuningMods(mods[0], mods[1], bound.tensors, bound.mask_mod, bound.mask_tensors)
