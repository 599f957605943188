"""Code generation: IR -> lowering (all decisions) -> rendered Triton source -> imported module."""

from tilegen.codegen.cache import module_for, source_for, source_path

__all__ = ["module_for", "source_for", "source_path"]
