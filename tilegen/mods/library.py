"""Ready-made mods, each a factory returning the function(s) to pass as ``score_mod``/``mask_mod``.

Tensors a factory takes are captured: they are kernel arguments, so their values may change
between calls without a new kernel. Numbers a factory takes are baked into the mod's canonical
text (a new value is a new spec, tuned apart).
"""

from __future__ import annotations

import math

import torch

__all__ = ["alibi", "relative_bias", "relative_buckets", "document_mask", "prefix_lm", "sliding_window", "softcap",
           "causal"]


def alibi(slopes: torch.Tensor):
    """ALiBi (Press et al.): ``score + slopes[h] * (kv_idx - q_idx)``; ``slopes`` fp32 ``[heads_q]``."""

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi_mod


def relative_bias(table: torch.Tensor, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
    """T5's relative position bias: ``score + table[h, bucket(kv_idx - q_idx)]``, ``table`` ``[heads, num_buckets]``.

    The bucket is T5's (``_relative_position_bucket``): exact below half the buckets (per direction when
    bidirectional), logarithmic up to ``max_distance``, the last bucket beyond. Every distance of ``max_distance`` or
    more falls in the last bucket of its direction, so the buckets of the offsets from ``-max_distance`` to
    ``max_distance`` are computed here once, by T5's formula (``relative_buckets``) on the table's device, and the mod
    reads them from that int32 tensor (captured as ``buckets``) at the offset clamped into it: per score a
    subtraction, a clamp and two gathers, where the formula costs a logarithm, two divisions, two conversions and a
    dozen selects and compares; and a block of scores farther from the diagonal than ``max_distance`` reads one bias
    for the whole block (the lowering's clamped gathers, docs/mods.md).

    ``buckets`` stays on the device ``table`` is on when the mod is made: make the mod after moving the table (a
    module's ``.cuda()`` moves its parameter, not ``buckets``).
    """
    num_buckets, max_distance = _check_buckets("relative_bias", num_buckets, max_distance, bidirectional)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] < num_buckets:
        raise ValueError(f"relative_bias: table: expected a [heads, num_buckets] tensor of at least {num_buckets} "
                         f"buckets, got {tuple(table.shape) if isinstance(table, torch.Tensor) else type(table)}")
    buckets = _buckets(torch.arange(-max_distance, max_distance + 1, dtype=torch.int32, device=table.device),
                       num_buckets, max_distance, bidirectional)

    def relative_bias_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, buckets[torch.clamp(kv_idx - q_idx, -max_distance, max_distance) + max_distance]]

    return relative_bias_mod


def relative_buckets(relative: torch.Tensor, num_buckets: int = 32, max_distance: int = 128,
                     bidirectional: bool = True) -> torch.Tensor:
    """T5's bucket (int32) of each offset ``kv_idx - q_idx`` in ``relative`` (an integer tensor)."""
    return _buckets(relative, *_check_buckets("relative_buckets", num_buckets, max_distance, bidirectional),
                    bidirectional)


def _buckets(relative: torch.Tensor, num_buckets: int, max_distance: int, bidirectional: bool) -> torch.Tensor:
    """``relative_buckets`` of arguments checked already."""
    half = num_buckets // 2 if bidirectional else num_buckets
    exact = half // 2
    if bidirectional:
        offset = (relative > 0).to(torch.int32) * half
        distance = torch.abs(relative)
    else:
        offset = 0
        distance = torch.clamp(-relative, min=0)
    # Clamped to 1 so that the log branch, which where() drops below ``exact``, stays finite.
    log_ratio = torch.log(torch.clamp(distance, min=1).to(torch.float32) / exact) / math.log(max_distance / exact)
    far = torch.clamp(exact + (log_ratio * (half - exact)).to(torch.int32), max=half - 1)
    return (offset + torch.where(distance < exact, distance, far)).to(torch.int32)


def _check_buckets(name: str, num_buckets, max_distance, bidirectional: bool) -> tuple[int, int]:
    """``(num_buckets, max_distance)`` as ints, or an error naming ``name`` and the argument."""
    for arg, value in (("num_buckets", num_buckets), ("max_distance", max_distance)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: {arg}: expected an int, got {value!r}")
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if exact < 1 or max_distance <= exact:
        raise ValueError(f"{name}: needs num_buckets >= {4 if bidirectional else 2} and max_distance above the exact "
                         f"buckets ({exact}), got {num_buckets}, {max_distance}")
    return num_buckets, max_distance


def document_mask(doc_ids: torch.Tensor):
    """Packed documents: a query sees keys of its own document only; ``doc_ids`` int ``[n]`` (one packed sequence,
    ``n_q == n_k``) or ``[batch, n]``."""
    if doc_ids.dim() == 1:
        def document_mask_mod(b, h, q_idx, kv_idx):
            return doc_ids[q_idx] == doc_ids[kv_idx]
    else:
        def document_mask_mod(b, h, q_idx, kv_idx):
            return doc_ids[b, q_idx] == doc_ids[b, kv_idx]
    return document_mask_mod


def prefix_lm(prefix_len: torch.Tensor):
    """Prefix-LM: the first ``prefix_len[b]`` keys are seen by every query, the rest causally
    (``q_idx >= kv_idx``); ``prefix_len`` int ``[batch]``."""

    def prefix_lm_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len[b]) | (q_idx >= kv_idx)

    return prefix_lm_mod


def sliding_window(window: int, global_tokens: int = 0, causal: bool = True):
    """A query sees keys at most ``window`` positions before it (and after it unless ``causal``), plus the
    first ``global_tokens`` keys, which every query sees, and which see every key (Longformer's global tokens)."""
    if window < 0 or global_tokens < 0:
        raise ValueError(f"sliding_window: window and global_tokens must be >= 0, got {window}, {global_tokens}")

    def sliding_window_mod(b, h, q_idx, kv_idx):
        near = (q_idx - kv_idx <= window) & (q_idx >= kv_idx) if causal else torch.abs(q_idx - kv_idx) <= window
        if global_tokens:
            return near | (kv_idx < global_tokens) | (q_idx < global_tokens)
        return near

    return sliding_window_mod


def softcap(cap: float):
    """Gemma-2's logit softcap as a score mod: ``cap * tanh(score / cap)``."""
    if not (isinstance(cap, (int, float)) and 0 < cap < math.inf):
        raise ValueError(f"softcap: expected a finite positive number, got {cap!r}")
    cap = float(cap)

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_mod


def causal():
    """Causal as a mask mod: ``q_idx >= kv_idx``, aligned top-left as FlexAttention's indices are (the op's
    ``causal=True`` aligns bottom-right when ``n_q != n_k``)."""

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return causal_mod
