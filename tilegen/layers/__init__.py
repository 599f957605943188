"""Transformer layers built from tilegen's ops: the Blockwise Parallel Transformer decoder layer.

``LayerConfig`` says what the layer is, ``reference_layer`` is the plain PyTorch layer that
defines it, ``blockwise_layer`` (``tilegen.layers.op``) runs it over query blocks with the
schedule the ``blockwise_layer`` family (``tilegen.layers.family``) generates, and
``BlockwiseLayer`` is the module (Llama weight names) around it. Everything here composes ops:
the layers sit above ``tilegen.ops`` and nothing below imports them.
"""

from tilegen.families import register
from tilegen.layers.config import LayerConfig
from tilegen.layers.family import FAMILY as LAYER_FAMILY
from tilegen.layers.module import BlockwiseLayer
from tilegen.layers.op import blockwise_layer, explain_layer
from tilegen.layers.reference import reference_layer
from tilegen.layers.weights import check_weights, config_from_weights

__all__ = ["LAYER_FAMILY", "BlockwiseLayer", "LayerConfig", "blockwise_layer", "check_weights", "config_from_weights",
           "explain_layer", "reference_layer"]

# The layer family composes the ops, so it registers here, above them, not among the kernel families.
register(LAYER_FAMILY)
