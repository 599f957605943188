"""The attention-backward family: FlashAttention-2's backward for every variant the forward serves.

The scores are recomputed block by block from Q, K and the forward's LSE, never stored: a
preprocessing pass (Delta = rowsum(dO * O)), a dK/dV kernel holding a key block on chip, and
dQ by its own kernel or by atomics in the dK/dV kernel, as the tuner chooses. Files: ``spec``
(the IR), ``lower`` (template values), ``config`` (knobs, search space, feasibility, defaults),
``reference`` (float64 torch gradients), ``problem`` (what a tuning trial measures).
"""

from __future__ import annotations

from tilegen.families.attention_bwd import config as _config
from tilegen.families.attention_bwd.config import Config
from tilegen.families.attention_bwd.lower import lower as _lower
from tilegen.families.attention_bwd.problem import Problem
from tilegen.families.attention_bwd.spec import AttentionBwdSpec, dense_rows
from tilegen.families.base import Family
from tilegen.families.buckets import PowerOfTwoBuckets

__all__ = ["FAMILY", "AttentionBwdSpec", "Config", "Problem"]


FAMILY = Family(
    name="attention_bwd",
    spec_type=AttentionBwdSpec,
    config_type=Config,
    template="attention_bwd.py.jinja",
    # As the forward: max(n_q, n_k) sets how many blocks each kernel streams.
    buckets=PowerOfTwoBuckets("sequence length"),
    lower=_lower,
    search_space=_config.search_space,
    feasible=_config.feasible,
    default_rule=_config.default_rule,
    problem_type=Problem,
    rows_from=dense_rows,
    presets={
        "train-default": AttentionBwdSpec(head_dim=64, mask="causal", dtype="bf16"),
        "train-llama": AttentionBwdSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16"),
        "train-llama-full": AttentionBwdSpec(head_dim=128, q_per_kv=4, mask="none", dtype="bf16"),
        "train-d128": AttentionBwdSpec(head_dim=128, mask="causal", dtype="bf16"),
        "train-d128-full": AttentionBwdSpec(head_dim=128, mask="none", dtype="bf16"),
        "train-d64": AttentionBwdSpec(head_dim=64, mask="causal", dtype="bf16"),
        "train-d64-full": AttentionBwdSpec(head_dim=64, mask="none", dtype="bf16"),
        "train-d64-gqa": AttentionBwdSpec(head_dim=64, q_per_kv=4, mask="causal", dtype="bf16"),
        "train-d64-gqa-full": AttentionBwdSpec(head_dim=64, q_per_kv=4, mask="none", dtype="bf16"),
    },
)
