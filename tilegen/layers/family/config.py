"""The blockwise layer's config, its search space, what the schedule can run, and the heuristic default.

``block_q`` is the query block: the tokens that go through the layer together (their q, attention
output, ``o_proj`` and the FFN's input exist at once). Larger blocks mean fewer, fuller launches
of attention and the projections; smaller ones bound the activations. The FFN inside a block
runs its own tuned fusion block (the ``blockwise_ffn`` family's ``block_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tilegen.device import DeviceInfo
from tilegen.dtypes import TORCH_DTYPES
from tilegen.families import base
from tilegen.layers.family.spec import BlockwiseLayerSpec

__all__ = ["Config", "search_space", "feasible", "default_rule", "MIN_GPU_BLOCK"]

#: Fewest query rows per block on a GPU by default: with 8 KV heads' worth of query tiles of 128
#: rows, fewer leave an H200's 132 SMs idle in attention.
MIN_GPU_BLOCK = 4096
#: A block's activations may take at most this share of the device's memory; the sequence's K
#: and V, the input and the output need the rest.
_BLOCK_MEMORY_SHARE = 0.25


@dataclass(frozen=True, order=True)
class Config(base.Config):
    """Query tokens per block."""

    block_q: int


def block_bytes(spec: BlockwiseLayerSpec, block_q: int) -> int:
    """The most bytes a block's activations hold at once: its normalized input, q and its two fp32
    copies while RoPE turns it, attention's output, ``h`` and the FFN's output rows."""
    itemsize = TORCH_DTYPES[spec.dtype].itemsize
    q_width = spec.heads_q * spec.head_dim
    fp32_copies = 2 * 4 * q_width if spec.rope else 0
    return block_q * (itemsize * (3 * spec.d_model + 2 * q_width) + fp32_copies)


def search_space(spec: BlockwiseLayerSpec, device: DeviceInfo) -> dict[str, list[int]]:
    if device.is_interpreter:
        return {"block_q": [8, 16, 32, 64]}
    return {"block_q": [2048, 4096, 8192, 16384]}


def feasible(spec: BlockwiseLayerSpec, config: Config, device: DeviceInfo) -> str | None:
    if device.is_interpreter or not device.memory_bytes:
        return None
    need = block_bytes(spec, config.block_q)
    if need > _BLOCK_MEMORY_SHARE * device.memory_bytes:
        return (f"block_q={config.block_q}: a block's activations take {need / 1e9:.1f} GB, more than "
                f"{_BLOCK_MEMORY_SHARE:.0%} of the device's {device.memory_bytes / 1e9:.0f} GB")
    return None


def default_rule(spec: BlockwiseLayerSpec, device: DeviceInfo) -> list[tuple[int | None, Config]]:
    """On a GPU, 4096 rows (``MIN_GPU_BLOCK``): attention fills the SMs, and the block's activations
    stay a few [4096, d_model] tensors. Under the interpreter, a few blocks of a short sequence."""
    if device.is_interpreter:
        return [(None, Config(32))]
    return [(None, Config(MIN_GPU_BLOCK))]
