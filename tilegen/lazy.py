"""Package names that load on first use (PEP 562), for packages whose light users must not pay
for the heavy modules behind their other names."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(package: str, where: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: each name of ``where`` is imported from its
    module on first use, then kept in the package like any other."""

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
