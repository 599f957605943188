"""The ops' side of ``tilegen.mods.builtin``: a call's mods that mean a built-in option, made that option
before the call's spec is made, so the call takes the built-in's kernels, routes and rows."""

from __future__ import annotations

from tilegen.families.attention_fwd.masks import window_bounds
from tilegen.mods.builtin import builtin_of, reduce_builtins
from tilegen.mods.trace import traced

__all__ = ["absorb"]


def absorb(score_mod, mask_mod, causal, window, softcap, shift: int | None = 0, known=None):
    """A call's ``(causal, window, softcap, score_mod, mask_mod)`` with every mod that means a built-in option
    made that option (its function then ``None``). ``shift``: ``n_k - n_q`` where the mods' positions are
    aligned top-left (the dense op), 0 where they sit at the keys' positions (the paged paths), ``None``
    where it varies across the batch (then only a score mod can be absorbed). ``known``: the mods'
    ``builtin_of``, where the caller has read their texts already (``torch.compile`` reads them once, at trace
    time: ``tilegen.mods.compiled``)."""
    if known is None:
        score = traced(score_mod, "score_mod").canonical if score_mod is not None else None
        mask = traced(mask_mod, "mask_mod").canonical if mask_mod is not None and shift is not None else None
        known = builtin_of(score, "score_mod"), builtin_of(mask, "mask_mod")
    cap, band = known
    left, right = window_bounds(window, causal)
    window_now, softcap_now, score_kept, mask_kept = reduce_builtins(cap, band if shift is not None else None, left,
                                                                     right, softcap, shift or 0)
    if score_kept and mask_kept:
        return causal, window, softcap, score_mod, mask_mod  # nothing absorbed: the call's own arguments
    return False, window_now, softcap_now, score_mod if score_kept else None, mask_mod if mask_kept else None
