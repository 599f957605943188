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

__all__ = ["memoized"]

T = TypeVar("T")


def memoized(build: Callable[..., T]) -> Callable[..., T]:
    cached = functools.lru_cache(maxsize=1024)(build)

    @functools.wraps(build)
    def spec_for(*args):
        if torch.compiler.is_compiling():
            return build(*args)
        return cached(*args)

    return spec_for
