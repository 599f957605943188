"""``tilegen.blockwise_layer`` under ``torch.compile``, imported by the first compiled call (``torch.compiler.disable``
imports Dynamo, which a process that never compiles need not pay for).

The layer's schedule is host code over the ops, and its training forward keeps host state (each block's key
range) for its backward: under ``torch.compile`` the layer is a graph break, run eagerly as a whole, forward and
backward, the graph around it compiled.
"""

from __future__ import annotations

import torch

__all__ = ["eagerly"]


@torch.compiler.disable(reason="tilegen.blockwise_layer runs eagerly under torch.compile: its kernels are fused "
                               "already, and its training backward keeps host state")
def eagerly(layer, *args, **kwargs):
    """``layer(*args, **kwargs)`` outside the trace (Dynamo breaks the graph at this call)."""
    return layer(*args, **kwargs)
