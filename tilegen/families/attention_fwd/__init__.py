"""The dense attention-forward family: FlashAttention's fused kernel over [batch, heads, seq, dim].

One program owns a tile of query rows and streams key/value blocks past it with an
online softmax; causal and windowed masks visit only the blocks they must. Files:
``spec`` (the IR), ``lower`` (template values), ``config`` (knobs, search space,
feasibility, defaults), ``masks`` (argument canonicalization), ``reference`` (float64
torch), ``problem`` (what a tuning trial measures), ``standalone`` (``emit --tuned``).
"""

from __future__ import annotations

from tilegen.families.attention_fwd import config as _config
from tilegen.families.attention_fwd.config import Config
from tilegen.families.attention_fwd.lower import lower as _lower
from tilegen.families.attention_fwd.problem import Problem
from tilegen.families.attention_fwd.spec import AttentionSpec, without_lse
from tilegen.families.attention_fwd.standalone import entry_point
from tilegen.families.base import Family
from tilegen.families.buckets import PowerOfTwoBuckets

__all__ = ["FAMILY", "AttentionSpec", "Config", "Problem"]


FAMILY = Family(
    name="attention_fwd",
    spec_type=AttentionSpec,
    config_type=Config,
    template="attention_fwd.py.jinja",
    # A call is bucketed by max(n_q, n_k): the longer side sets how many tiles and blocks there are.
    buckets=PowerOfTwoBuckets("sequence length"),
    lower=_lower,
    search_space=_config.search_space,
    feasible=_config.feasible,
    default_rule=_config.default_rule,
    problem_type=Problem,
    presets={
        "default": AttentionSpec(head_dim=64, mask="causal", dtype="bf16"),
        "llama-prefill": AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16"),
        "mha-d128-causal": AttentionSpec(head_dim=128, mask="causal", dtype="bf16"),
        "mha-d128": AttentionSpec(head_dim=128, mask="none", dtype="bf16"),
        "mha-d64-causal": AttentionSpec(head_dim=64, mask="causal", dtype="bf16"),
        "gemma-softcap": AttentionSpec(head_dim=256, q_per_kv=2, mask="window", softcap=True, dtype="bf16"),
        # The other common head dims: Phi-3 (96, MHA), Gemma 2 27B's global and local layers (128, GQA 2, softcap,
        # the local ones a window), DeepSeek's MLA prefill (192 for queries and keys, 128 for values).
        "phi3-prefill": AttentionSpec(head_dim=96, mask="causal", dtype="bf16"),
        "gemma2-27b": AttentionSpec(head_dim=128, q_per_kv=2, mask="causal", softcap=True, dtype="bf16"),
        "gemma2-27b-local": AttentionSpec(head_dim=128, q_per_kv=2, mask="window", softcap=True, dtype="bf16"),
        "deepseek-prefill": AttentionSpec(head_dim=192, head_dim_v=128, mask="causal", dtype="bf16"),
    },
    standalone=entry_point,
    rows_from=without_lse,
)
