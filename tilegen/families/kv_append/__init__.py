"""Appending new tokens' K and V to a paged KV cache: one launch for a whole ragged batch.

One program moves a block of new-token rows of one KV head into their pages; each row
finds its sequence by a binary search over ``cu_seqlens`` and its page and slot through
the page table, so the launch needs no host-side map and no synchronization. Files:
``spec`` (the IR: dtype, head dims, page size, FP8 page dtype), ``lower`` (template values), ``config``
(knobs, search space, feasibility, defaults), ``reference`` (float64 torch), ``problem``
(what a tuning trial measures). The op is ``tilegen.append_kv`` (``tilegen.ops.append``).
"""

from __future__ import annotations

from tilegen.families.base import Family
from tilegen.families.buckets import PowerOfTwoBuckets
from tilegen.families.kv_append import config as _config
from tilegen.families.kv_append.config import Config
from tilegen.families.kv_append.lower import lower as _lower
from tilegen.families.kv_append.problem import Problem
from tilegen.families.kv_append.spec import KVAppendSpec

__all__ = ["FAMILY", "KVAppendSpec", "Config", "Problem"]


FAMILY = Family(
    name="kv_append",
    spec_type=KVAppendSpec,
    config_type=Config,
    template="kv_append.py.jinja",
    # A call is bucketed by its new tokens (all sequences together): that is the grid's size.
    buckets=PowerOfTwoBuckets("new tokens"),
    lower=_lower,
    search_space=_config.search_space,
    feasible=_config.feasible,
    default_rule=_config.default_rule,
    problem_type=Problem,
    presets={
        "append-d128-p16": KVAppendSpec(head_dim=128, page_size=16, dtype="bf16"),
        "append-d128-p16-fp8": KVAppendSpec(head_dim=128, page_size=16, dtype="bf16", page_dtype="fp8e4m3"),
    },
)
