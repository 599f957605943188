"""``tilegen.BlockwiseLayer``: a Llama-style decoder layer as a ``torch.nn.Module`` running the blockwise schedule."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tilegen.layers.config import LayerConfig
from tilegen.layers.op import blockwise_layer
from tilegen.layers.weights import as_state_dict, check_weights, config_from_weights

__all__ = ["BlockwiseLayer"]


class BlockwiseLayer(torch.nn.Module):
    """A pre-norm decoder layer through ``tilegen.blockwise_layer``, for inference and training.

    Its weights are ``torch.nn.Parameter``s that take gradients, as ``torch.nn.Linear``'s do: with
    grad mode on, ``layer(x)`` backpropagates, block by block (BPT's schedule, ``tilegen.layers.train``).
    For inference call it under ``torch.no_grad()`` or ``torch.inference_mode()`` (or turn the
    parameters' grad off): the forward then keeps nothing for a backward.

    Its parameters carry Llama's names (``self_attn.q_proj.weight``, ``mlp.gate_proj.weight``, ...),
    so ``load_state_dict`` takes a ``LlamaDecoderLayer``'s state dict as it is, and
    ``BlockwiseLayer.from_llama(layer_or_state_dict, heads_q=32, heads_kv=8)`` builds one from it.

    Args:
        config: the layer's ``LayerConfig``.
        dtype, device: of the (uninitialized) parameters.
        block: query tokens per block; ``None`` uses the ``blockwise_layer`` family's tuned (else default) block.
    """

    def __init__(self, config: LayerConfig, *, dtype: torch.dtype = torch.bfloat16, device: Any = None,
                 block: int | None = None):
        if not isinstance(config, LayerConfig):
            raise TypeError(f"config: expected a tilegen.LayerConfig, got {type(config).__name__}")
        super().__init__()
        self.config = config
        self.block = block
        for name, shape in config.weight_shapes().items():
            module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))

    @classmethod
    def from_llama(cls, source: Mapping[str, torch.Tensor] | torch.nn.Module, *, heads_q: int,
                   heads_kv: int | None = None, block: int | None = None, **options: Any) -> BlockwiseLayer:
        """A layer holding ``source``'s weights (a state dict, or a module such as ``LlamaDecoderLayer``),
        its widths read from their shapes; ``options`` are ``LayerConfig``'s (``rope_theta``,
        ``eps``, ``causal``, ...). Weights that do not fit raise an error naming the weight.

        A transformers decoder layer also gives what its weights cannot, unless ``options`` say otherwise: its
        norm's eps, its attention config's ``rope_theta`` (so a Llama 3 layer gets 500000, not the default
        10000) and ``sliding_window`` (Mistral's), as ``window=(sliding_window - 1, 0)``. A RoPE of another type
        there (Llama 3.1's scaled frequencies, YaRN, ...) raises ``NotImplementedError``: tilegen's RoPE turns by
        plain ``rope_theta`` frequencies, and the layer would differ from the module's; pass ``rope_theta`` to build
        it anyway. So does an MLP activation other than SiLU or attention dropout, and ``heads_q``/``heads_kv``
        other than its config's raise ``ValueError``."""
        if isinstance(source, torch.nn.Module):
            _check_module_config(source, heads_q, heads_kv)
            options = {**_module_options(source, explicit_rope="rope_theta" in options), **options}
        weights = as_state_dict(source)
        config = config_from_weights(weights, heads_q=heads_q, heads_kv=heads_kv, **options)
        check_weights(weights, config)
        first = weights["self_attn.q_proj.weight"]
        layer = cls(config, dtype=first.dtype, device=first.device, block=block)
        layer.load_weights(weights)
        return layer

    def load_weights(self, source: Mapping[str, torch.Tensor] | torch.nn.Module) -> BlockwiseLayer:
        """Copy a Llama-style layer's weights in (dtype and device converted to the layer's);
        a missing, unexpected or misshapen weight raises an error naming it, as does one of a parameter tied under
        two names whose values there differ."""
        weights = as_state_dict(source)
        check_weights(weights, self.config)
        held = self.weights()
        first: dict[int, str] = {}
        for name, param in held.items():
            # A tied parameter holds one value: of two that differ, whichever came last would silently win.
            other = first.setdefault(id(param), name)
            if other != name and not torch.equal(weights[name], weights[other]):
                raise ValueError(f"{name}: tied to {other} in this layer, but the source's values for the two "
                                 "differ")
        with torch.no_grad():
            for name, param in held.items():
                param.copy_(weights[name])
        return self

    def weights(self) -> dict[str, torch.Tensor]:
        """The layer's tensors by Llama name: a parameter tied under two names appears under both, and a weight
        re-registered as a buffer (a frozen norm) is there too; ``named_parameters()`` would drop either. Other
        buffers are not weights."""
        names = self.config.weight_shapes()
        held = {name: t for name, t in self.named_buffers(remove_duplicate=False) if name in names}
        held.update(self.named_parameters(remove_duplicate=False))
        return held

    def forward(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output; differentiable (to ``x`` and the parameters) when grad mode is on and
        either requires grad, in which case ``out`` is refused."""
        return blockwise_layer(x, self.weights(), self.config, block=self.block, out=out)

    def extra_repr(self) -> str:
        return repr(self.config)


def _check_module_config(module: torch.nn.Module, heads_q: Any, heads_kv: Any) -> None:
    """What a transformers decoder layer's config says that its weights cannot, against the call: the layer would
    otherwise compute something other than what the module does, and say nothing."""
    config = getattr(getattr(module, "self_attn", None), "config", None)
    if config is None:
        return
    act = getattr(config, "hidden_act", "silu")
    if hasattr(getattr(module, "mlp", None), "gate_proj") and act not in ("silu", "swish"):
        raise NotImplementedError(f"source: its MLP's activation is {act!r}; the layer's gated MLP (swiglu) applies "
                                  "SiLU")
    dropout = getattr(config, "attention_dropout", 0.0)
    if isinstance(dropout, (int, float)) and dropout > 0:
        raise NotImplementedError(f"source: its attention config has attention_dropout={dropout}; tilegen's "
                                  "attention applies no dropout (set it to 0.0 to build the layer)")
    for name, given, held in (("heads_q", heads_q, "num_attention_heads"),
                              ("heads_kv", heads_kv, "num_key_value_heads")):
        want = getattr(config, held, None)
        if given is not None and isinstance(want, int) and given != want:
            raise ValueError(f"{name}: {given!r}, but the module's config has {held}={want}")


def _module_options(module: torch.nn.Module, explicit_rope: bool) -> dict[str, Any]:
    """The options a transformers decoder layer holds beside its weights: the input norm's eps, and its attention
    config's RoPE base (``rope_parameters``, or an older transformers' ``rope_theta`` and ``rope_scaling``) and sliding
    window (``sliding_window``, where ``layer_types`` makes this layer one of sliding attention, if it has them)."""
    found: dict[str, Any] = {}
    norm = getattr(module, "input_layernorm", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if isinstance(eps, (int, float)) and not isinstance(eps, bool):
        found["eps"] = float(eps)
    config = getattr(getattr(module, "self_attn", None), "config", None)
    if config is None:
        return found
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default") and not explicit_rope:
        raise NotImplementedError(f"source: its attention config's RoPE is of type {kind!r}, whose frequencies "
                                  "tilegen's RoPE (plain rope_theta frequencies) does not apply; pass rope_theta= to "
                                  "build the layer with plain RoPE anyway")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if isinstance(theta, (int, float)) and not isinstance(theta, bool):
        found["rope_theta"] = float(theta)
    window = getattr(config, "sliding_window", None)
    types, index = getattr(config, "layer_types", None), getattr(module.self_attn, "layer_idx", None)
    if isinstance(types, (list, tuple)) and isinstance(index, int) and 0 <= index < len(types):
        window = window if types[index] == "sliding_attention" else None
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        # transformers' sliding window keeps a key when q_idx - kv_idx < sliding_window: the token and the
        # sliding_window - 1 before it (Mistral's 4096).
        found["window"] = (window - 1, 0)
    return found
