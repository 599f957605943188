"""tilegen: generated, autotuned Triton kernels for I/O-aware attention.

    import tilegen
    out = tilegen.attention(q, k, v, causal=True)
"""

from tilegen import env as _env
from tilegen.triton_internals import warmup as _warmup
from tilegen.version import __version__

# Triton's per-process start-up work (tilegen.triton_internals.warmup) overlaps the imports below and whatever the
# caller does before its first call; first thing, so that the overlap is as long as it can be.
if not _env.interpreting():
    _warmup.start()

from tilegen.families.attention_fwd import AttentionSpec  # noqa: E402
from tilegen.families import spec_from_json  # noqa: E402
from tilegen.ir import SpecError  # noqa: E402
from tilegen.ops.append import append_kv  # noqa: E402
from tilegen.ops.attention import attention, explain  # noqa: E402
from tilegen.ops.blockwise import blockwise_ffn  # noqa: E402
from tilegen.ops.cascade import CascadeAttention, CascadeLevel, cascade_levels  # noqa: E402
from tilegen.layers import BlockwiseLayer, LayerConfig, blockwise_layer  # noqa: E402
from tilegen.ops.decode import PagedDecode  # noqa: E402
from tilegen.ops.kv_cache import PagedKVCache  # noqa: E402
from tilegen.ops.merge import merge_states  # noqa: E402
from tilegen.ops.rope import apply_rope  # noqa: E402
from tilegen.ops.varlen import PagedAttention, varlen_attention  # noqa: E402

__all__ = [
    "AttentionSpec",
    "BlockwiseLayer",
    "CascadeAttention",
    "CascadeLevel",
    "LayerConfig",
    "PagedAttention",
    "PagedDecode",
    "PagedKVCache",
    "SpecError",
    "append_kv",
    "apply_rope",
    "attention",
    "blockwise_ffn",
    "blockwise_layer",
    "cascade_levels",
    "explain",
    "merge_states",
    "spec_from_json",
    "varlen_attention",
    "__version__",
]
