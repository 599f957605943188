"""Batch decode over a paged KV cache: one query token per sequence, GQA-packed, split-KV.

The query heads that share a KV head are computed together, so each page is read once
per KV head; when batch x KV heads cannot fill the GPU, each sequence's keys are split
across programs (flash-decoding) and a merge kernel combines the partial results by their
log-sum-exp. The split count comes from the SM count, the batch and the config's
``ctas_per_sm`` knob; the knobs are tuned per longest context and batch (one packed bucket:
``ContextBatchBuckets``), and callers bucket a call by ``(max context, batch)``. The
online-softmax loop and the page addressing are the prefill kernels' shared pieces. FP8 pages
(``kv_dtype``) are read as FP8, their scales folded into the softmax scale and the output.
"""

from __future__ import annotations

from tilegen.families.attention_decode import config as _config
from tilegen.families.attention_decode.config import DecodeConfig
from tilegen.families.attention_decode.lower import lower as _lower
from tilegen.families.attention_decode.problem import BUCKETS, DecodeProblem
from tilegen.families.attention_decode.spec import DecodeSpec
from tilegen.families.base import Family

__all__ = ["FAMILY", "DecodeConfig", "DecodeSpec", "DecodeProblem"]


FAMILY = Family(
    name="attention_decode",
    spec_type=DecodeSpec,
    config_type=DecodeConfig,
    template="attention_decode.py.jinja",
    # The longest context sets the key blocks a program streams; the batch sets how many programs the
    # split rule adds, so the knobs it reads (ctas_per_sm above all) are tuned per batch too.
    buckets=BUCKETS,
    lower=_lower,
    search_space=_config.search_space,
    feasible=_config.feasible,
    default_rule=_config.default_rule,
    problem_type=DecodeProblem,
    presets={"decode16-llama": DecodeSpec(head_dim=128, q_per_kv=4, dtype="bf16", page_size=16),
             # bf16 queries over FP8 (e4m3) pages with their scales, as vLLM's fp8 KV cache stores them.
             "decode16-llama-fp8": DecodeSpec(head_dim=128, q_per_kv=4, dtype="bf16", page_size=16,
                                              kv_dtype="fp8e4m3")},
)
