"""Kernel families and their registry.

A family is a folder here (spec, lowering, config space, reference, problem) whose
``__init__`` declares ``FAMILY = Family(...)``, plus its template; the rest of tilegen finds
it through ``family_of(spec)`` and never imports it by name. Adding one here is a folder and
a line in ``BUILTIN`` below; a family kept in another package registers through an entry
point of group ``tilegen.families`` or one call to ``register``. See docs/adding-a-family.md.
"""

from tilegen.families.base import (
    TOLERANCE,
    Config,
    ConfigError,
    Family,
    Problem,
    RowsProblem,
    relative_error,
)
from tilegen.families.buckets import Buckets, ContextBatchBuckets, PowerOfTwoBuckets
from tilegen.families.registry import families, family_of, get, register, spec_from_json, spec_type

__all__ = [
    "TOLERANCE",
    "BUILTIN",
    "Buckets",
    "Config",
    "ContextBatchBuckets",
    "ConfigError",
    "Family",
    "PowerOfTwoBuckets",
    "Problem",
    "RowsProblem",
    "families",
    "family_of",
    "get",
    "register",
    "relative_error",
    "spec_from_json",
    "spec_type",
]

from tilegen.families import (  # noqa: E402
    attention_cascade,
    attention_bwd,
    attention_decode,
    attention_fwd,
    attention_varlen,
    blockwise_ffn,
    kv_append,
    merge_states,
    rope,
)

#: tilegen's own kernel families, registered in this order (``families()`` lists them first).
BUILTIN = [
    attention_fwd.FAMILY,
    kv_append.FAMILY,
    merge_states.FAMILY,
    attention_varlen.FAMILY,
    attention_decode.FAMILY,
    blockwise_ffn.FAMILY,
    rope.FAMILY,
    attention_bwd.FAMILY,
    attention_cascade.FAMILY,
]
for _family in BUILTIN:
    register(_family)
del _family
