"""A kernel family kept outside tilegen: row-wise softmax (or log-softmax) of a [rows, cols] matrix.

It goes through everything a family goes through (lower, render, tune, store, dispatch,
``tilegen db list/prune``, ``tilegen emit``) with no edit to tilegen: this package declares
``FAMILY`` and names it in its ``tilegen.families`` entry point (pyproject.toml), and tilegen
registers it the first time it meets the name. docs/adding-a-family.md walks through it.
"""

from __future__ import annotations

from pathlib import Path

from row_softmax_family import config
from row_softmax_family.config import RowSoftmaxConfig
from row_softmax_family.lower import lower
from row_softmax_family.problem import RowSoftmaxProblem
from row_softmax_family.spec import RowSoftmaxSpec
from tilegen.families import Family, PowerOfTwoBuckets

__all__ = ["FAMILY", "RowSoftmaxConfig", "RowSoftmaxProblem", "RowSoftmaxSpec"]

FAMILY = Family(
    name="row_softmax",
    spec_type=RowSoftmaxSpec,
    config_type=RowSoftmaxConfig,
    template="row_softmax.py.jinja",
    template_dir=Path(__file__).parent / "templates",
    # A call of n columns uses the bucket next_pow2(n): the columns set the block each row is held in.
    buckets=PowerOfTwoBuckets("columns", gpu_sizes=(256, 1024, 4096, 16384), interpreter_sizes=(16, 64)),
    lower=lower,
    search_space=config.search_space,
    feasible=config.feasible,
    default_rule=config.default_rule,
    problem_type=RowSoftmaxProblem,
    presets={"row-softmax": RowSoftmaxSpec(dtype="fp32")},
)
