"""Transformer layers built from tilegen's ops: the Blockwise Parallel Transformer decoder layer.

``LayerConfig`` says what the layer is, ``reference_layer`` is the plain PyTorch layer that
defines it, ``BlockwiseLayer`` is the module (Llama weight names) running
``tilegen.blockwise_layer`` (``tilegen.ops.blockwise``).
"""

from tilegen.layers.config import LayerConfig
from tilegen.layers.module import BlockwiseLayer
from tilegen.layers.reference import reference_layer
from tilegen.layers.weights import check_weights, config_from_weights

__all__ = ["BlockwiseLayer", "LayerConfig", "check_weights", "config_from_weights", "reference_layer"]
