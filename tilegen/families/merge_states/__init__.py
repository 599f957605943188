"""Merging two partial attention results ``(o, lse)`` into one, by their log-sum-exp.

Cascade and shared-prefix attention build on it (attention over a shared prefix and over
each suffix, merged), and split-KV decode merges its splits with it. One program merges a
block of (token, head) rows, each whole in registers. Files: ``spec`` (dtype, head dim),
``lower`` (template values), ``config`` (knobs, search space, feasibility, defaults),
``reference`` (float64 torch), ``problem`` (what a tuning trial measures). The op is
``tilegen.merge_states`` (``tilegen.ops.merge``).
"""

from __future__ import annotations

from tilegen.families.base import Family
from tilegen.families.buckets import PowerOfTwoBuckets
from tilegen.families.merge_states import config as _config
from tilegen.families.merge_states.config import Config
from tilegen.families.merge_states.lower import lower as _lower
from tilegen.families.merge_states.problem import Problem
from tilegen.families.merge_states.spec import MergeStatesSpec

__all__ = ["FAMILY", "MergeStatesSpec", "Config", "Problem"]


FAMILY = Family(
    name="merge_states",
    spec_type=MergeStatesSpec,
    config_type=Config,
    template="merge_states.py.jinja",
    # A call is bucketed by its rows (tokens x heads): that is the grid's size.
    buckets=PowerOfTwoBuckets("rows"),
    lower=_lower,
    search_space=_config.search_space,
    feasible=_config.feasible,
    default_rule=_config.default_rule,
    problem_type=Problem,
    presets={"merge-d128": MergeStatesSpec(head_dim=128, dtype="bf16")},
)
