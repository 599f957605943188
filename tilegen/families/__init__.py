"""Kernel families and their registry.

A family is a folder here (spec, lowering, config space, reference, problem) plus its
templates; the rest of tilegen finds it through ``family_of(spec)`` and never imports
it by name. Adding one is a folder and one ``register`` line below (or, for a family
kept elsewhere, one call to ``tilegen.families.register``). See docs/adding-a-family.md.
"""

from tilegen.families.base import (
    TOLERANCE,
    Config,
    ConfigError,
    Family,
    Problem,
    relative_error,
)
from tilegen.families.buckets import Buckets, PowerOfTwoBuckets
from tilegen.families.registry import families, family_of, get, register, spec_from_json, spec_type

__all__ = [
    "TOLERANCE",
    "Buckets",
    "Config",
    "ConfigError",
    "Family",
    "PowerOfTwoBuckets",
    "Problem",
    "families",
    "family_of",
    "get",
    "register",
    "relative_error",
    "spec_from_json",
    "spec_type",
]

from tilegen.families.attention_fwd import AttentionFwd  # noqa: E402
from tilegen.families.kv_append import KVAppend  # noqa: E402
from tilegen.families.merge_states import MergeStates  # noqa: E402
from tilegen.families.attention_varlen import AttentionVarlen  # noqa: E402
from tilegen.families.attention_decode import AttentionDecode  # noqa: E402
from tilegen.families.blockwise_ffn import BlockwiseFFN  # noqa: E402
from tilegen.families.rope import Rope  # noqa: E402

register(AttentionFwd())
register(KVAppend())
register(MergeStates())
register(AttentionVarlen())
register(AttentionDecode())
register(BlockwiseFFN())
register(Rope())

