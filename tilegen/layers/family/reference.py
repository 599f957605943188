"""The float64 layer a tuning trial's output is checked against: ``tilegen.layers.reference_layer``.

The plain PyTorch layer defines what the generated schedule computes; this runs it in float64
on the trial's (already rounded) input and weights. Past a few thousand tokens its score matrix
cannot be held, so a check passes ``rows`` and gets only those tokens' outputs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tilegen.layers.config import LayerConfig
from tilegen.layers.reference import reference_layer

__all__ = ["layer_reference"]


def layer_reference(x: torch.Tensor, weights: Mapping[str, torch.Tensor], config: LayerConfig, *,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's output on ``x`` ``[tokens, d_model]`` in float64, at ``rows`` (token indices) or every token."""
    return reference_layer(x, weights, config, compute_dtype=torch.float64, rows=rows)
