"""Pre-norm feed-forward with its residual, fused a block of tokens at a time (Blockwise Parallel Transformer).

After attention each token's FFN is independent of the others', so the FFN runs on one
fusion block of rows at a time and its ``[tokens, d_ffn]`` intermediate never exists beyond
one block. Three generated kernels per block: the norm, gate/up projections with the
activation, the down projection with the residual. Files: ``spec`` (norm and FFN kind,
widths, dtype), ``lower`` (template values), ``config`` (knobs incl. the fusion block,
search space, feasibility, defaults), ``reference`` (float64 torch), ``problem`` (what a
tuning trial measures). The op is ``tilegen.blockwise_ffn`` (``tilegen.ops.blockwise``); the
decoder layer's generated schedule (the ``blockwise_layer`` family) calls it once per query
block, and the FFN runs its own fusion block inside that block.
"""

from __future__ import annotations

from tilegen.families.base import Family
from tilegen.families.blockwise_ffn import config as _config
from tilegen.families.blockwise_ffn.config import Config
from tilegen.families.blockwise_ffn.lower import lower as _lower
from tilegen.families.blockwise_ffn.problem import Problem
from tilegen.families.blockwise_ffn.spec import BlockwiseFFNSpec
from tilegen.families.buckets import PowerOfTwoBuckets

__all__ = ["FAMILY", "BlockwiseFFNSpec", "Config", "Problem"]


FAMILY = Family(
    name="blockwise_ffn",
    spec_type=BlockwiseFFNSpec,
    config_type=Config,
    template="blockwise_ffn.py.jinja",
    # A call is bucketed by its token rows: the matmuls' M and the number of fusion blocks.
    buckets=PowerOfTwoBuckets("tokens"),
    lower=_lower,
    search_space=_config.search_space,
    feasible=_config.feasible,
    default_rule=_config.default_rule,
    problem_type=Problem,
    presets={"llama3-8b-ffn": BlockwiseFFNSpec(d_model=4096, d_ffn=14336, norm="rmsnorm", ffn="swiglu",
                                               dtype="bf16")},
)
