"""Attention forward over ragged batches: packed queries, keys packed alike or in a paged cache.

The same fused kernel as ``attention_fwd`` (its online-softmax loop and mask ranges are
shared template pieces), indexed by ``cu_seqlens`` per sequence; with ``kv_layout="paged"``
keys and values are read through a page table (``tilegen.PagedKVCache``), which also
serves chunked prefill: new tokens attending to a cached prefix, aligned bottom-right.
Configs, search space and defaults are the dense family's, less its TMA knob; on Hopper a ragged
batch may run the dense family's warp-specialized Gluon kernel (``wgmma``).
"""

from __future__ import annotations

from tilegen.families.attention_varlen import config as _config
from tilegen.families.attention_varlen.lower import lower as _lower
from tilegen.families.attention_varlen.problem import VarlenProblem
from tilegen.families.attention_fwd.spec import without_lse
from tilegen.families.attention_varlen.spec import VarlenAttentionSpec
from tilegen.families.base import Family
from tilegen.families.buckets import PowerOfTwoBuckets

__all__ = ["FAMILY", "VarlenAttentionSpec", "VarlenProblem"]


FAMILY = Family(
    name="attention_varlen",
    spec_type=VarlenAttentionSpec,
    config_type=_config.VarlenConfig,
    template="attention_varlen.py.jinja",
    # The longest sequence sets how many tiles and key blocks the longest programs run.
    buckets=PowerOfTwoBuckets("longest sequence"),
    lower=_lower,
    search_space=_config.search_space,
    feasible=_config.feasible,
    default_rule=_config.default_rule,
    problem_type=VarlenProblem,
    rows_from=without_lse,
    presets={
        "varlen-llama": VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16"),
        "paged16-llama": VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16",
                                             kv_layout="paged", page_size=16),
        "paged16-llama-fp8": VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16",
                                                 kv_layout="paged", page_size=16, kv_dtype="fp8e4m3"),
    },
)
