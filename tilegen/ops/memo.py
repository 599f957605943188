"""Memoized spec builders for the ops: a spec is built and validated once per argument tuple.

Under ``torch.compile`` Dynamo traces an op's Python wrapper; it ignores an ``lru_cache`` and
warns that it did, on every op. The builders are pure, so a compiled graph traces the builder
itself (its spec is a constant of the graph) and eager calls keep the cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from tilegen.ir import SpecError

__all__ = ["memoized", "with_mod_fields"]

T = TypeVar("T")


def memoized(build: Callable[..., T]) -> Callable[..., T]:
    cached = functools.lru_cache(maxsize=1024)(build)

    @functools.wraps(build)
    def spec_for(*args):
        if torch.compiler.is_compiling():
            return build(*args)
        return cached(*args)

    return spec_for


@memoized
def with_mod_fields(spec, score_mod: str | None, mask_mod: str | None):
    """``spec`` with the mods' canonical texts (``tilegen.mods``); a ``ValueError`` names a bad combination."""
    try:
        return spec.replace(score_mod=score_mod, mask_mod=mask_mod)
    except SpecError as e:
        raise ValueError(str(e)) from None
