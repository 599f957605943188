"""Mask arguments, canonicalized once: the op, the tuner, the reference and emitted modules use these.

``window_bounds`` turns the user's ``causal``/``window`` into ``(left, right)`` key bounds
around the bottom-right aligned diagonal (``None``: unbounded); ``mask_kind`` names the
spec's mask for them; ``launch_window`` gives the launcher's integers. ``launch_window``
has no imports because ``tilegen emit --tuned`` copies its source into standalone modules.
"""

from __future__ import annotations

import math
import sys
from numbers import Integral, Real

__all__ = ["window_bounds", "mask_kind", "launch_window", "mask_band", "score_scalars"]


_FP32_TINY = 2.0 ** -126


def score_scalars(scale, softcap, head_dim: int) -> tuple[float, float]:
    """The launcher's ``(scale, softcap)``: ``1/sqrt(head_dim)`` by default, softcap 0.0 for none.

    A ``ValueError`` names the argument that is not a finite number (a positive one for softcap). NumPy's
    scalars count as numbers: a value read from an array is as good as a Python float.
    """
    if scale is None:
        # A head dim of 0 has no default scale; the spec check that follows names the argument it came from.
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    # Comparisons, not math.isfinite: under torch.compile(dynamic=True) a scale computed from a size
    # (q.shape[-1] ** -0.5) is a symbolic float, which Dynamo compares (NaN compares false) but cannot pass to math.
    elif isinstance(scale, bool) or not isinstance(scale, Real) or not -math.inf < scale < math.inf:
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    # The kernels' base-2 scale (times log2(e)), in fp32; compared, not multiplied: an int no float holds overflows.
    elif abs(scale) > 3.4028234663852886e38 / 1.4426950408889634:
        raise ValueError(f"scale: {scale!r} overflows fp32 once the kernels take it to base 2 (times log2(e))")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, Real) or not (0 < softcap <= sys.float_info.max)
    ):
        raise ValueError(f"softcap: expected None or a finite positive number, got {softcap!r}")
    if softcap is not None and softcap < _FP32_TINY:
        # The backward divides by it (tanh's derivative): past fp32's normal range 1/softcap is inf, and the
        # gradients NaN where the forward was right.
        raise ValueError(f"softcap: expected None or a number >= {_FP32_TINY:.4g} (fp32's smallest normal), "
                         f"got {softcap!r}")
    return float(scale), float(softcap) if softcap is not None else 0.0


def window_bounds(window, causal) -> tuple[int | None, int | None]:
    """``(left, right)`` for a call's arguments; a ``TypeError``/``ValueError`` names the bad one."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    if window is None:
        return None, (0 if causal else None)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window: expected (left, right), each an int >= 0 or None, got {window!r}")
    left, right = window
    for side, value in (("left", left), ("right", right)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, Integral) or value < 0):
            raise ValueError(f"window: {side} must be an int >= 0 or None (unbounded), got {value!r}")
    # Python ints from here on: a NumPy integer would reach the kernels' launch arguments.
    left, right = (None if value is None else int(value) for value in (left, right))
    if causal:
        if right not in (None, 0):
            raise ValueError(f"window: causal=True sees no key right of the diagonal, but right={right}")
        right = 0
    return left, right


def mask_kind(left: int | None, right: int | None) -> str:
    """The spec's mask: an unbounded window is no mask, ``(None, 0)`` is causal, anything else a window."""
    if left is None and right is None:
        return "none"
    if left is None and right == 0:
        return "causal"
    return "window"


def launch_window(mask, left, right, n_q, n_k):
    """The kernel's ``(window_left, window_right)``: unbounded sides become ``n_q + n_k``.

    That reaches every key from every row; larger sides are clamped to it so the
    kernel's int32 index arithmetic around the diagonal cannot overflow.
    """
    unbounded = n_q + n_k
    return (
        unbounded if left is None else min(left, unbounded),
        0 if mask == "causal" else (unbounded if right is None else min(right, unbounded)),
    )


def mask_band(left: int | None, right: int | None, diag: int = 0) -> tuple[int | None, int | None]:
    """The ``band`` of a mod's range check (``tilegen.mods.trace.TracedMod.check_ranges``) for a call's window
    ``(left, right)`` around the diagonal ``kv_idx - q_idx = diag`` (``n_k - n_q`` where positions are rows,
    bottom-right; 0 where ``q_idx`` is the query's position among the keys, the paged ops'): the key a query sees
    lies ``left`` before to ``right`` after it (None: unbounded)."""
    return None if left is None else diag - left, None if right is None else diag + right
