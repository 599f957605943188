"""Cascade attention: queries under a prefix tree of shared paged KV, each shared prefix read once.

Requests that share a prefix (a system prompt, a document asked many questions, samples of one
prompt) share its pages in a paged cache; batch decode would still read them once per request.
Here the tokens under a shared node read its pages together, their query heads batched into
the rows of one tile (a matrix product over the prefix, not a matrix-vector product per
request), and every token's partial results over its levels are merged by their LSE (FlashInfer's
cascade inference). One launch takes every level's tiles, heaviest first, so the last level's
memory-bound reads run beside the shared levels' products. Tuned per shared prefix length and
batch (``ContextBatchBuckets``).
"""

from __future__ import annotations

from tilegen.families.attention_cascade import config as _config
from tilegen.families.attention_cascade.config import CascadeConfig
from tilegen.families.attention_cascade.lower import lower as _lower
from tilegen.families.attention_cascade.problem import BUCKETS, CascadeProblem
from tilegen.families.attention_cascade.spec import CascadeSpec
from tilegen.families.base import Family

__all__ = ["FAMILY", "CascadeConfig", "CascadeSpec", "CascadeProblem"]


FAMILY = Family(
    name="attention_cascade",
    spec_type=CascadeSpec,
    config_type=CascadeConfig,
    template="attention_cascade.py.jinja",
    buckets=BUCKETS,
    lower=_lower,
    search_space=_config.search_space,
    feasible=_config.feasible,
    default_rule=_config.default_rule,
    problem_type=CascadeProblem,
    presets={"cascade16-llama": CascadeSpec(head_dim=128, q_per_kv=4, dtype="bf16", page_size=16, mask="causal"),
             "cascade16-llama-fp8": CascadeSpec(head_dim=128, q_per_kv=4, dtype="bf16", page_size=16, mask="causal",
                                                kv_dtype="fp8e4m3")},
)
