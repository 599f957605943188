"""``tilegen.apply_rope``: rotary position embedding (rotate-half form) from the caller's tables.

It launches as every op does (``tilegen.dispatch.planned``): a plan per call signature, the
config chosen for its rows, the launcher's replay, a tuned row that fails at the first launch
skipped for the next choice."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tilegen import dispatch
from tilegen.dtypes import SPEC_DTYPES
from tilegen.families.rope import RopeSpec
from tilegen.families.rope.spec import MAX_HEAD_DIM
from tilegen.ir import SpecError
from tilegen.ops.memo import memoized
from tilegen.ops.tensors import check_device, check_out, off_eager, refuse_grad, writable

__all__ = ["apply_rope", "explain_rope"]

_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary position embedding, rotate-half form (Llama's, GPT-NeoX's), as one kernel.

    With ``x = [x1, x2]`` split at ``head_dim / 2``: ``out = x * cos + [-x2, x1] * sin``, per
    token and head, in fp32 and rounded once to ``x``'s dtype. The tables are each token's, over
    the whole head (Llama's repeat their ``head_dim / 2`` angles twice; any table is taken as it
    is), so theta, scaled angles (Llama 3, NTK) and the positions of a ragged batch are the caller's.

    Args:
        x: ``[..., heads, head_dim]``, fp16, bf16 or fp32, any strides; ``head_dim`` even, at most 512.
        cos, sin: ``[..., head_dim]``, ``x``'s shape without ``heads``, fp32, bf16 or fp16, on ``x``'s device.
        out: write the result here (``x``'s shape and dtype, any strides); it may be ``x`` itself
            (in place), and must not otherwise overlap an input (one that does is refused).

    Returns ``out`` when given, else a new tensor. Every call checks shapes, dtypes and devices on the
    host (a call shaped like an earlier one reuses its checked plan); it does not synchronize. Under
    ``torch.compile`` the call goes through the custom op ``tilegen::apply_rope`` (out of place; a
    given ``out`` is then copied into), so ``fullgraph=True`` traces it.
    """
    # Under vmap or a FakeTensorMode the tensors have no storage to launch on: the custom op, as under compile.
    if off_eager():
        _check(x, cos, sin, out)
        if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad
                                        or (out is not None and out.requires_grad)):
            refuse_grad("tilegen.apply_rope", x=x, cos=cos, sin=sin, out=out)
        rotated = torch.ops.tilegen.apply_rope(x, cos, sin)
        return rotated if out is None else out.copy_(rotated)
    try:
        key = (x.shape, cos.shape, sin.shape, x.dtype, cos.dtype, sin.dtype, x.device, cos.device, sin.device,
               None if out is None else (out.__class__, out.shape, out.dtype, out.device))
        plan = _plans.get(key)
    except AttributeError:  # not tensors: the checks say which
        key = plan = None
    if plan is None:
        plan = _plan(x, cos, sin, out)
        if key is not None:
            _plans.put(key, plan)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:  # addresses change from call to call, so this is not part of the plan
        check_out("out", out, {"x": x, "cos": cos, "sin": sin}, may_be=("x",))
    # No backward: an output without a grad_fn would silently cut the graph. Inline, as it runs every call.
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad or out.requires_grad):
        refuse_grad("tilegen.apply_rope", x=x, cos=cos, sin=sin, out=out)
    if plan.launches:
        rows3, rows2 = plan.rows3, plan.rows2
        view = writable(out, rows3)
        # An out whose strides do not collapse to [tokens, heads, head_dim] is written through a buffer.
        target = view if view is not None else out.new_empty(rows3)
        x3, cos2, sin2 = x.reshape(rows3), cos.reshape(rows2), sin.reshape(rows2)
        # The plan fixes the shapes and dtypes the launcher reads; the strides complete the replay key.
        plan.launch((x3.stride(), cos2.stride(), sin2.stride(), target.stride()), x3, cos2, sin2, target)
        if view is None:
            out.copy_(target.reshape(out.shape))
    return out


def explain_rope(x, cos, sin) -> dispatch.Choice:
    """Which config ``apply_rope`` runs these arguments with, and where it comes from."""
    spec = _check(x, cos, sin, None)
    return dispatch.table_on(spec, x.device).choose(math.prod(x.shape[:-1]))


@dataclass(frozen=True, slots=True)
class _Plan:
    launches: bool  # False when there is no row
    rows3: tuple[int, int, int]  # [tokens, heads, head_dim]: x and out as the kernel sees them
    rows2: tuple[int, int]  # [tokens, head_dim]: the tables
    launch: Callable[..., Any]  # launch(key, x, cos, sin, out): the launcher's replay (dispatch.planned)
    choice: dispatch.Choice


_plans = dispatch.plan_cache()


def _plan(x, cos, sin, out) -> _Plan:
    spec = _check(x, cos, sin, out)
    heads, dim = x.shape[-2], x.shape[-1]
    tokens = math.prod(x.shape[:-2])
    launcher = dispatch.launcher_for(spec)

    def make(choice: dispatch.Choice) -> _Plan:
        return _Plan(launches=tokens * heads > 0, rows3=(tokens, heads, dim), rows2=(tokens, dim),
                     launch=launcher.replay(choice.config.to_dict()), choice=choice)

    return dispatch.planned(dispatch.table_on(spec, x.device), tokens * heads, make)


def _check(x, cos, sin, out) -> RopeSpec:
    """Every check, raising with the argument's name at the first that fails; the spec."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x: expected [..., heads, head_dim], got shape {tuple(x.shape)}")
    if x.dtype not in SPEC_DTYPES:
        raise TypeError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    device = x.device
    check_device("x", device)
    table_shape = x.shape[:-2] + x.shape[-1:]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != table_shape:
            raise ValueError(f"{name}: expected shape {tuple(table_shape)} (x's without heads), got {tuple(t.shape)}")
        if t.dtype not in _TABLE_DTYPES:
            raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name}: on {t.device} while x is on {device}; all inputs must share a device")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        if out.shape != x.shape:
            raise ValueError(f"out: expected shape {tuple(x.shape)}, got {tuple(out.shape)}")
        if out.dtype != x.dtype:
            raise TypeError(f"out: expected dtype {x.dtype}, got {out.dtype}")
        if out.device != device:
            raise ValueError(f"out: on {out.device} while the inputs are on {device}")
    return _spec_for(SPEC_DTYPES[x.dtype], x.shape[-1])


@memoized
def _spec_for(dtype: str, dim: int) -> RopeSpec:
    try:
        return RopeSpec(head_dim=dim, dtype=dtype)
    except SpecError:
        raise ValueError(f"x: head_dim {dim} is not supported; expected an even number in 2..{MAX_HEAD_DIM}") from None


@torch.library.custom_op("tilegen::apply_rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rope(x, cos, sin)


@_rope_op.register_fake
def _(x, cos, sin):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
