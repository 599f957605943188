"""``tilegen.blockwise_ffn``: a transformer layer's FFN half (norm, MLP, residual), a block of rows at a time.

After attention every token's FFN is independent of the others', so the FFN needs no
sequence-sized activation: the generated kernels take a fusion block of rows through the
norm, the MLP and the residual, the block's hidden activations staying on chip. The fusion
block is the ``blockwise_ffn`` family's knob, tuned per token bucket. The whole decoder layer
scheduled over query blocks (``tilegen.blockwise_layer``) composes this op with attention:
it lives above the ops, in ``tilegen.layers``.

It launches as every op does (``tilegen.dispatch.planned``): the fusion block chosen for the
token bucket, the launcher (whose block buffers keep its launches from being recorded, so
every call runs the launcher's Python with direct kernels), a tuned row that fails at the
first launch skipped for the next choice, except in place (``out`` over ``x``). Under ``torch.compile`` the
call is the custom op ``tilegen::blockwise_ffn``, which launches the same plans.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tilegen import dispatch
from tilegen.dtypes import SPEC_DTYPES
from tilegen.families.blockwise_ffn.spec import BlockwiseFFNSpec
from tilegen.ir import SpecError
from tilegen.ops.tensors import check_device, check_out, off_eager, refuse_grad

__all__ = ["blockwise_ffn", "ffn_table"]


def ffn_table(spec: BlockwiseFFNSpec, device: torch.device) -> dispatch.Table:
    return dispatch.table_on(spec, device)


def blockwise_ffn(
    x: torch.Tensor,
    *,
    w_norm: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate: torch.Tensor | None = None,
    b_norm: torch.Tensor | None = None,
    norm: str = "rmsnorm",
    eps: float = 1e-5,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = x + mlp(norm(x))`` for ``x`` ``[tokens, d_model]``, a fusion block of rows at a time.

    Args:
        x: ``[tokens, d_model]``, fp16, bf16 or fp32, any strides.
        w_norm: the norm's weight ``[d_model]``; ``b_norm`` its bias, given exactly when ``norm="layernorm"``.
        w_gate, w_up: ``[d_ffn, d_model]`` (``torch.nn.Linear`` layout). With ``w_gate`` the MLP is
            SwiGLU, ``down(silu(gate(xn)) * up(xn))``; without, ``down(gelu(up(xn)))`` (exact GELU).
        w_down: ``[d_model, d_ffn]``.
        norm: ``rmsnorm`` or ``layernorm``.
        eps: the norm's epsilon.
        out: where to write ``[tokens, d_model]`` (may be ``x`` itself; a partial overlap is refused).

    Every tensor must have ``x``'s dtype and device; an error names the argument that does not.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected a [tokens, d_model] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in SPEC_DTYPES:
        raise TypeError(f"x: expected fp16, bf16 or fp32, got {x.dtype}")
    check_device("x", x.device)
    n, d = x.shape
    if not isinstance(w_up, torch.Tensor) or w_up.dim() != 2 or w_up.shape[1] != d:
        raise ValueError(f"w_up: expected [d_ffn, {d}], got "
                         f"{tuple(w_up.shape) if isinstance(w_up, torch.Tensor) else type(w_up).__name__}")
    f = w_up.shape[0]
    ffn = "swiglu" if w_gate is not None else "gelu_mlp"
    expected = {"w_norm": (w_norm, (d,)), "w_up": (w_up, (f, d)), "w_down": (w_down, (d, f))}
    if w_gate is not None:
        expected["w_gate"] = (w_gate, (f, d))
    if norm == "layernorm":
        if b_norm is None:
            raise ValueError("b_norm: norm='layernorm' needs the norm's bias")
        expected["b_norm"] = (b_norm, (d,))
    elif norm == "rmsnorm":
        if b_norm is not None:
            raise ValueError("b_norm: given, but norm='rmsnorm' has no bias")
    else:
        raise ValueError(f"norm: expected rmsnorm or layernorm, got {norm!r}")
    if out is not None:
        expected["out"] = (out, (n, d))
    for name, (t, shape) in expected.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from x's {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device} while x is on {x.device}")
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: expected a positive finite number, got {eps!r}")
    # No backward: an output without a grad_fn would silently cut the graph.
    if torch.is_grad_enabled() and (x.requires_grad or w_norm.requires_grad or w_up.requires_grad
                                    or w_down.requires_grad or (out is not None and out.requires_grad)
                                    or (w_gate is not None and w_gate.requires_grad)
                                    or (b_norm is not None and b_norm.requires_grad)):
        refuse_grad("tilegen.blockwise_ffn", x=x, w_norm=w_norm, w_gate=w_gate, w_up=w_up, w_down=w_down,
                    b_norm=b_norm, out=out)
    # Under vmap or a FakeTensorMode the tensors have no storage to launch on: the custom op, as under compile.
    if off_eager():
        result = torch.ops.tilegen.blockwise_ffn(x, w_norm, w_up, w_down, w_gate, b_norm, norm, float(eps))
        return result if out is None else out.copy_(result)  # the op allocates its output
    if out is None:
        out = torch.empty_like(x)
    else:
        check_out("out", out, {"x": x, **{name: t for name, (t, _) in expected.items() if name != "out"}},
                  may_be=("x",))
    if n == 0:
        return out
    # In place, the kernels write x's rows block by block: a launch that failed part way could not be
    # run again with the next config, so a tuned row's failure is raised there (dispatch.planned).
    in_place = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    key = (x.shape, x.dtype, x.device, f, norm, ffn, eps.__class__, eps, in_place)
    plan = _plans.get(key)
    if plan is None:
        try:
            spec = BlockwiseFFNSpec(d_model=d, d_ffn=f, norm=norm, ffn=ffn, dtype=SPEC_DTYPES[x.dtype])
        except SpecError as e:
            raise ValueError(f"{ {'d_model': 'x', 'd_ffn': 'w_up'}.get(e.field, e.field)}: {e}") from None
        launcher = dispatch.launcher_for(spec)

        def make(choice: dispatch.Choice) -> _Plan:
            return _Plan(launcher.replay({"eps": float(eps), **choice.config.to_dict()}), choice)

        plan = dispatch.planned(ffn_table(spec, x.device), n, make, fallback=not in_place)
        _plans.put(key, plan)
    args = (x, w_norm, b_norm, w_gate, w_up, w_down, out)
    # The launcher makes its block buffers, so its launches are never recorded: the key is the contract's.
    plan.launch(tuple(None if t is None else t.stride() for t in args), *args)
    return out


@dataclass(frozen=True, slots=True)
class _Plan:
    launch: Callable[..., Any]  # launch(key, *launcher arguments): the launcher's replay (dispatch.planned)
    choice: dispatch.Choice


_plans = dispatch.plan_cache()


@torch.library.custom_op("tilegen::blockwise_ffn", mutates_args=())
def _blockwise_ffn_op(x: torch.Tensor, w_norm: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      w_gate: torch.Tensor | None, b_norm: torch.Tensor | None, norm: str, eps: float) -> torch.Tensor:
    """``blockwise_ffn`` under ``torch.compile``: its arguments were checked in traced code; it launches as an eager
    call does."""
    return blockwise_ffn(x, w_norm=w_norm, w_up=w_up, w_down=w_down, w_gate=w_gate, b_norm=b_norm, norm=norm, eps=eps)


@_blockwise_ffn_op.register_fake
def _(x, w_norm, w_up, w_down, w_gate, b_norm, norm, eps):
    return torch.empty_like(x)
