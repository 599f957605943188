"""Rotary position embedding (RoPE), rotate-half form, applied from the caller's cos and sin tables.

A transformer layer rotates its fresh q and k projections before attention; in torch that is
five elementwise passes over them in fp32 (casts, a concatenation, two products and a sum),
which at 64k tokens cost a Llama-3-8B layer about 6 ms of its ~120. One kernel reads each
element once and writes it once. The tables are the caller's (``[..., head_dim]`` per token),
so every RoPE variant that differs only in its angles (theta, Llama 3's or NTK scaling,
positions of a ragged batch) runs the same kernel. Files: ``spec`` (dtype, head dim),
``lower`` (template values), ``config`` (knobs, search space, feasibility, defaults),
``reference`` (float64 torch), ``problem`` (what a tuning trial measures). The op is
``tilegen.apply_rope`` (``tilegen.ops.rope``).
"""

from __future__ import annotations

from tilegen.families.base import Family
from tilegen.families.buckets import PowerOfTwoBuckets
from tilegen.families.rope import config as _config
from tilegen.families.rope.config import Config
from tilegen.families.rope.lower import lower as _lower
from tilegen.families.rope.problem import Problem
from tilegen.families.rope.spec import RopeSpec

__all__ = ["FAMILY", "Config", "Problem", "RopeSpec"]


FAMILY = Family(
    name="rope",
    spec_type=RopeSpec,
    config_type=Config,
    template="rope.py.jinja",
    # A call is bucketed by its rows (tokens x heads): that is the grid's size.
    buckets=PowerOfTwoBuckets("rows"),
    lower=_lower,
    search_space=_config.search_space,
    feasible=_config.feasible,
    default_rule=_config.default_rule,
    problem_type=Problem,
    presets={"rope-d128": RopeSpec(head_dim=128, dtype="bf16")},
)
