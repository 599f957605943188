"""Score and mask mods: FlexAttention's ``score_mod``/``mask_mod`` as a field of the attention spec.

A mod is a small torch function, traced once with ``torch.fx`` (``trace``), written down as a
canonical text that the spec holds (so it enters the spec's hash, tuning key and rows), and
lowered from that text into Triton statements that the attention templates inline (``lower``).
``grad`` differentiates a score mod's graph (forward mode) for the backward, which recomputes the scores
through the mods. ``blocks`` evaluates a mask mod per (query block, key block) for the kernels, which skip
the blocks it empties. ``library`` holds ready-made mods.

``score_mod(score, b, h, q_idx, kv_idx) -> score`` receives the scaled logit ``q . k * scale`` in
fp32 (as FlexAttention does); its result is softmaxed. ``mask_mod(b, h, q_idx, kv_idx) -> bool``
keeps a score where it is True. ``b``, ``h``, ``q_idx`` and ``kv_idx`` are int32 scalars: the batch
(or, in ``varlen_attention``, the sequence), the query head, and the query and key positions (in
``varlen_attention`` within their sequence). On the paged paths (``PagedAttention``, ``PagedDecode``)
``b`` is the request and both positions are in its cache: a query's ``q_idx`` is ``kv_len - q_len + i``
(bottom-right), so a mod means the same in prefill and decode (docs/mods.md). A row that keeps no key
gives 0 and an LSE of -inf.

The supported operations (anything else is refused when the mod is traced, naming it):

- arithmetic ``+ - * /``, unary ``-``, ``abs``; integer ``//`` and ``%`` with Python's (and
  torch's) floor semantics;
- comparisons ``< <= > >= == !=``; ``&``, ``|`` and ``~`` (logical on bools);
- ``torch.where``, ``torch.tanh``, ``torch.exp``, ``torch.log``, ``torch.sqrt``,
  ``torch.minimum``, ``torch.maximum``, ``torch.clamp`` (and the methods of those names);
- ``.to(dtype)`` to float32/float16/bfloat16/int32/int64/bool (and ``.float()``, ``.int()``,
  ``.long()``, ``.bool()``); Python numbers;
- indexing a captured tensor (a tensor the function closes over or reads from its module)
  with one index expression per dimension: ``bias[h, q_idx - kv_idx + n]``, ``slopes[h]``,
  ``doc_ids[q_idx] == doc_ids[kv_idx]``, ``temperature[0]``. Captured tensors are strided (dense)
  kernel arguments (pointer, strides, sizes), read at every call, so their values may change
  between calls without a new kernel; a new shape or dtype traces the function again.

Types: every value is computed in the dtype torch gives it when the mod is traced (on 0-dim tensors
and Python numbers, as FlexAttention traces it), whatever Triton's own promotion would make of the
operands: ``bool + bool`` is a logical or, ``uint8 + int8`` is int16, a bfloat16 product is rounded
to bfloat16. A Python number that torch converts to the operation's integer type by wrapping it
around (``uint8_value < 300``), or to float16/bfloat16 by rounding it, which torch does for some
operations and devices and not for others (``bf16_value * 0.1``), is refused when the mod is traced.

Out-of-range indices: an index the host can bound (the roles and integer constants under ``+ - *``,
``//`` and ``%`` by a positive constant, unary ``-``, ``abs``, ``minimum``, ``maximum``, ``clamp``,
``where``, bools: ``q_idx``, ``kv_idx - q_idx + n``) is checked on the host at every call over every
(query, key) position the call computes (its ``causal``/``window`` mask's dropped positions left out)
against the roles' ranges (``b`` in [0, batch), ``h`` in [0, heads_q), ``q_idx`` in [0, n_q),
``kv_idx`` in [0, n_k); for ``varlen_attention`` the longest sequences', an index reading both positions
only where each sequence's queries are its keys), and a ``ValueError`` names
the tensor, dimension and range. Any other index (one read from another captured tensor, or cast from
a float) is masked in the kernel: an element outside the tensor (a negative index included: there is
no wrap-around) reads as 0 (False for bools).

Gradients: with ``q``, ``k``, ``v`` or a captured tensor that requires grad (and grad mode on), the op is
differentiable: Q, K and V get theirs, and so does every captured float tensor of the score mod that
requires grad (accumulated in fp32, returned in its dtype). The score mod's derivative is formed for
``+ - * /``, unary ``-``, ``abs``, ``tanh``, ``exp``, ``log``, ``sqrt``, ``where``, ``minimum``,
``maximum``, ``clamp`` and casts; integer and bool values carry none. A float ``//`` or ``%`` that the
score (or a captured tensor that requires grad) reaches has none: ``tilegen.mods.grad.ModGradError``
(a ``NotImplementedError``) names it before anything runs, and only when gradients are asked for. The
second derivative is not formed: differentiating the gradients again (``create_graph=True``, then a
backward through them) raises a ``NotImplementedError`` naming the op.
"""

from __future__ import annotations

import importlib

# The library's factories, imported on first use: the spec and its lowering import this package
# (tilegen.mods.lower), and tracing brings torch.fx, which they need not load.
_LIBRARY = ("alibi", "relative_bias", "relative_buckets", "document_mask", "prefix_lm", "sliding_window", "softcap",
            "causal")
__all__ = list(_LIBRARY)


def __getattr__(name: str):
    if name in _LIBRARY:
        return getattr(importlib.import_module("tilegen.mods.library"), name)
    raise AttributeError(f"module 'tilegen.mods' has no attribute {name!r}")
