"""The ops' side of ``tilegen.mods.builtin``: a call's mods that mean a built-in option, made that option
before the call's spec is made, so the call takes the built-in's kernels, routes and rows."""

from __future__ import annotations

from tilegen.families.attention_fwd.masks import window_bounds
from tilegen.mods.builtin import reduce_mods
from tilegen.mods.trace import traced

__all__ = ["absorb"]


def absorb(score_mod, mask_mod, causal, window, softcap, shift: int | None = 0):
    """A call's ``(causal, window, softcap, score_mod, mask_mod)`` with every mod that means a built-in option
    made that option (its function then ``None``). ``shift``: ``n_k - n_q`` where the mods' positions are
    aligned top-left (the dense op), 0 where they sit at the keys' positions (the paged paths), ``None``
    where it varies across the batch (then only a score mod can be absorbed)."""
    score = traced(score_mod, "score_mod").canonical if score_mod is not None else None
    mask = traced(mask_mod, "mask_mod").canonical if mask_mod is not None and shift is not None else None
    left, right = window_bounds(window, causal)
    reduced = reduce_mods(score, mask, left, right, softcap, 0, shift or 0)
    score_left = score_mod if score is None or reduced.score_mod is not None else None
    mask_left = mask_mod if mask is None or reduced.mask_mod is not None else None
    if score_left is score_mod and mask_left is mask_mod:
        return causal, window, softcap, score_mod, mask_mod  # nothing absorbed: the call's own arguments
    return False, reduced.window, reduced.softcap, score_left, mask_left
