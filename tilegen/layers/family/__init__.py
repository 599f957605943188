"""A Llama-style decoder layer scheduled over query blocks (Blockwise Parallel Transformer).

The family's generated module is host code, not a kernel: a schedule that takes one block of
query tokens at a time through the whole layer (norm, q projection, attention over the keys
the block sees, ``o_proj`` and the residual, then the blockwise FFN), rendered from the spec so
that it holds only what the layer has: its norm, RoPE or none, the progressive K/V projection
of a causal layer or the whole-sequence one of any other, the window's per-block arithmetic.
It calls tilegen's ops for the fused parts (``tilegen.attention``, ``tilegen.blockwise_ffn``:
the ``attention_fwd`` and ``blockwise_ffn`` families' kernels, each tuned on its own), handed
to its ``launch``; its own knob is the query block, tuned per token bucket like any kernel's.

Files: ``spec`` (the layer's shape: attention, norm, FFN, widths, RoPE, dtype), ``lower``
(template values), ``config`` (the query block, search space, feasibility, defaults),
``reference`` (``tilegen.layers.reference_layer`` in float64), ``problem`` (what a tuning trial
measures). The op is ``tilegen.blockwise_layer`` (``tilegen.layers.op``). The family composes tilegen's ops,
so it lives above them, in ``tilegen.layers``, not among the kernel families.
"""

from __future__ import annotations

from tilegen.families.base import Family
from tilegen.families.buckets import PowerOfTwoBuckets
from tilegen.layers.family import config as _config
from tilegen.layers.family.config import Config
from tilegen.layers.family.lower import lower as _lower
from tilegen.layers.family.problem import Problem
from tilegen.layers.family.spec import BlockwiseLayerSpec

__all__ = ["FAMILY", "BlockwiseLayerSpec", "Config", "Problem"]


FAMILY = Family(
    name="blockwise_layer",
    spec_type=BlockwiseLayerSpec,
    config_type=Config,
    template="blockwise_layer.py.jinja",
    # A call is bucketed by its tokens (per sequence of a batch): they set the number of query blocks.
    buckets=PowerOfTwoBuckets("tokens"),
    lower=_lower,
    search_space=_config.search_space,
    feasible=_config.feasible,
    default_rule=_config.default_rule,
    problem_type=Problem,
    presets={
        "llama3-8b-layer": BlockwiseLayerSpec(d_model=4096, d_ffn=14336, heads_q=32, head_dim=128, q_per_kv=4,
                                              dtype="bf16"),
        # Small enough for the interpreter: a tune of a few configs takes seconds without a GPU.
        "tiny-layer": BlockwiseLayerSpec(d_model=32, d_ffn=48, heads_q=4, head_dim=16, q_per_kv=2, dtype="fp32"),
    },
)
