"""Plain torch merge that defines the family's semantics; tests and the tuner's gate use it.

With ``m = max(lse_a, lse_b)``, ``w_x = exp(lse_x - m)``:
``o = (w_a o_a + w_b o_b) / (w_a + w_b)`` and ``lse = m + log(w_a + w_b)``, natural log.
A side whose LSE is ``-inf`` saw no key and has weight 0 whatever its ``o`` holds; when both
are ``-inf`` the row is ``o = 0``, ``lse = -inf``.
"""

from __future__ import annotations

import torch

__all__ = ["merge_reference"]


def merge_reference(o_a, lse_a, o_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` in float64 for ``o_*`` ``[..., heads, head_dim]`` and ``lse_*`` ``[..., heads]``."""
    la, lb = lse_a.double(), lse_b.double()
    m = torch.maximum(la, lb)
    empty = m == float("-inf")
    m = torch.where(empty, 0.0, m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    # The o of a side that saw no key may hold anything; a side that saw keys keeps its NaN however little it
    # weighs (an exp that underflows to 0 is still a weight).
    part_a = torch.where(la[..., None] > float("-inf"), wa[..., None] * o_a.double(), 0.0)
    part_b = torch.where(lb[..., None] > float("-inf"), wb[..., None] * o_b.double(), 0.0)
    o = (part_a + part_b) / torch.where(empty, 1.0, total)[..., None]
    lse = torch.where(empty, float("-inf"), m + torch.log(total))
    return o, lse
