"""``tilegen.merge_states``: merge two partial attention results by their log-sum-exp.

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
from tilegen.families.merge_states import MergeStatesSpec
from tilegen.families.merge_states.spec import MAX_HEAD_DIM
from tilegen.ir import SpecError
from tilegen.ops.memo import memoized
from tilegen.ops.tensors import check_device, check_out, off_eager, refuse_grad, writable

__all__ = ["explain_merge", "merge_states"]


def merge_states(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets into the result over both.

    With ``m = max(lse_a, lse_b)`` per row:
    ``o = (e^(lse_a - m) o_a + e^(lse_b - m) o_b) / (e^(lse_a - m) + e^(lse_b - m))`` and
    ``lse = m + log(e^(lse_a - m) + e^(lse_b - m))``, in fp32. LSEs are natural-log with
    ``-inf`` for a part that saw no key (``tilegen.attention(..., return_lse=True)`` gives
    them so): such a part weighs 0 whatever its ``o`` holds, so one ``-inf`` side gives the
    other side exactly, and both ``-inf`` give ``o = 0`` and ``lse = -inf``, never NaN.

    Args:
        o_a, o_b: ``[..., heads, head_dim]``, fp16, bf16 or fp32, one shape, dtype and device,
            any strides.
        lse_a, lse_b: fp32 ``[..., heads]`` (``o``'s shape without head_dim), same device.
        out: write the merged output here (``o_a``'s shape and dtype, any strides); it may be
            ``o_a`` or ``o_b`` itself, and must not otherwise overlap an input (one that does is refused).
        out_lse: write the merged LSE here (``lse_a``'s shape, fp32); it may be ``lse_a`` or ``lse_b``,
            likewise.

    Returns:
        ``(o, lse)``: ``out`` and ``out_lse`` when given.

    Every call checks shapes, dtypes and devices on the host (a call shaped like an earlier
    one reuses its checked plan); it does not synchronize, and the LSE values are not checked
    (a NaN or ``+inf`` LSE gives NaN rows). Under ``torch.compile`` the call goes through the
    custom op ``tilegen::merge_states``, so ``fullgraph=True`` traces it.
    """
    # Under vmap or a FakeTensorMode the tensors have no storage to launch on: the custom op, as under compile.
    if off_eager():
        _check(o_a, lse_a, o_b, lse_b, out, out_lse)
        if torch.is_grad_enabled() and (o_a.requires_grad or lse_a.requires_grad or o_b.requires_grad
                                        or lse_b.requires_grad or (out is not None and out.requires_grad)
                                        or (out_lse is not None and out_lse.requires_grad)):
            refuse_grad("tilegen.merge_states", o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b, out=out, out_lse=out_lse)
        o, lse = torch.ops.tilegen.merge_states(o_a, lse_a, o_b, lse_b)
        return (o if out is None else out.copy_(o)), (lse if out_lse is None else out_lse.copy_(lse))
    try:
        key = (
            o_a.shape, lse_a.shape, o_b.shape, lse_b.shape, o_a.dtype, o_b.dtype, lse_a.dtype, lse_b.dtype,
            o_a.device, lse_a.device, o_b.device, lse_b.device,
            None if out is None else (out.__class__, out.shape, out.dtype, out.device),
            None if out_lse is None else (out_lse.__class__, out_lse.shape, out_lse.dtype, out_lse.device),
        )
        plan = _plans.get(key)
    except AttributeError:  # not tensors: the checks say which
        key = plan = None
    if plan is None:
        plan = _plan(o_a, lse_a, o_b, lse_b, out, out_lse)
        if key is not None:
            _plans.put(key, plan)
    # Addresses change from call to call, so these are not part of the plan.
    if out is not None:
        check_out("out", out, {"o_a": o_a, "o_b": o_b, "lse_a": lse_a, "lse_b": lse_b, "out_lse": out_lse},
                  may_be=("o_a", "o_b"))
    if out_lse is not None:
        check_out("out_lse", out_lse, {"lse_a": lse_a, "lse_b": lse_b, "o_a": o_a, "o_b": o_b},
                  may_be=("lse_a", "lse_b"))
    # empty_like, not new_empty(shape): a torch.Size argument takes torch's slow path (on the H200's
    # host 5.1 us against 1.6 for empty_like), a large part of a short call.
    if out is None:
        out = torch.empty_like(o_a, memory_format=torch.contiguous_format)
    if out_lse is None:
        out_lse = torch.empty_like(lse_a, memory_format=torch.contiguous_format)
    # No backward: an output without a grad_fn would silently cut the graph. Inline, as it runs every call.
    if torch.is_grad_enabled() and (o_a.requires_grad or lse_a.requires_grad or o_b.requires_grad
                                    or lse_b.requires_grad or out.requires_grad or out_lse.requires_grad):
        refuse_grad("tilegen.merge_states", o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b, out=out, out_lse=out_lse)
    if plan.launches:
        rows, rows3 = plan.rows, plan.rows3
        o_view, lse_view = writable(out, rows3), writable(out_lse, rows)
        # An out whose strides do not collapse to [tokens, heads, head_dim] is written through a buffer.
        target_o = o_view if o_view is not None else out.new_empty(rows3)
        target_lse = lse_view if lse_view is not None else out_lse.new_empty(rows)
        a3, a2, b3, b2 = o_a.reshape(rows3), lse_a.reshape(rows), o_b.reshape(rows3), lse_b.reshape(rows)
        # The plan fixes the shapes and dtypes the launcher reads; the strides complete the replay key.
        plan.launch((a3.stride(), a2.stride(), b3.stride(), b2.stride(), target_o.stride(), target_lse.stride()),
                    a3, a2, b3, b2, target_o, target_lse)
        if o_view is None:
            out.copy_(target_o.reshape(out.shape))
        if lse_view is None:
            out_lse.copy_(target_lse.reshape(out_lse.shape))
    return out, out_lse


def explain_merge(o_a, lse_a, o_b, lse_b) -> dispatch.Choice:
    """Which config ``merge_states`` runs these arguments with, and where it comes from."""
    spec = _check(o_a, lse_a, o_b, lse_b, None, None)
    return dispatch.table_on(spec, o_a.device).choose(lse_a.numel())


@dataclass(frozen=True, slots=True)
class _Plan:
    launches: bool  # False when there is no row
    rows: tuple[int, int]  # [tokens, heads]: the LSEs as the kernel sees them
    rows3: tuple[int, int, int]  # [tokens, heads, head_dim]: the outputs
    launch: Callable[..., Any]  # launch(key, o_a, lse_a, o_b, lse_b, out, out_lse): the launcher's replay
    choice: dispatch.Choice


_plans = dispatch.plan_cache()


def _plan(o_a, lse_a, o_b, lse_b, out, out_lse) -> _Plan:
    spec = _check(o_a, lse_a, o_b, lse_b, out, out_lse)
    heads, dim = o_a.shape[-2], o_a.shape[-1]
    tokens = math.prod(o_a.shape[:-2])
    launcher = dispatch.launcher_for(spec)

    def make(choice: dispatch.Choice) -> _Plan:
        return _Plan(launches=tokens * heads > 0, rows=(tokens, heads), rows3=(tokens, heads, dim),
                     launch=launcher.replay(choice.config.to_dict()), choice=choice)

    return dispatch.planned(dispatch.table_on(spec, o_a.device), tokens * heads, make)


def _check(o_a, lse_a, o_b, lse_b, out, out_lse) -> MergeStatesSpec:
    """Every check, raising with the argument's name at the first that fails; the spec."""
    for name, t in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if o_a.dim() < 2:
        raise ValueError(f"o_a: expected [..., heads, head_dim], got shape {tuple(o_a.shape)}")
    if o_a.dtype not in SPEC_DTYPES:
        raise TypeError(f"o_a: expected dtype float16, bfloat16 or float32, got {o_a.dtype}")
    device = o_a.device
    check_device("o_a", device)
    if o_b.shape != o_a.shape:
        raise ValueError(f"o_b: shape {tuple(o_b.shape)} differs from o_a's {tuple(o_a.shape)}")
    if o_b.dtype != o_a.dtype:
        raise TypeError(f"o_b: dtype {o_b.dtype} differs from o_a's {o_a.dtype}")
    lse_shape = o_a.shape[:-1]
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != lse_shape:
            raise ValueError(f"{name}: expected shape {tuple(lse_shape)} (o_a's without head_dim), "
                             f"got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected dtype float32, got {t.dtype}")
    for name, t in (("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if t.device != device:
            raise ValueError(f"{name}: on {t.device} while o_a is on {device}; all inputs must share a device")
    for name, t, shape, dtype in (("out", out, o_a.shape, o_a.dtype), ("out_lse", out_lse, lse_shape, torch.float32)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
        if t.shape != shape:
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name}: on {t.device} while the inputs are on {device}")
    return _spec_for(SPEC_DTYPES[o_a.dtype], o_a.shape[-1])


@memoized
def _spec_for(dtype: str, dim: int) -> MergeStatesSpec:
    try:
        return MergeStatesSpec(head_dim=dim, dtype=dtype)
    except SpecError:
        raise ValueError(f"o_a: head_dim {dim} is not supported; expected 1..{MAX_HEAD_DIM}") from None


@torch.library.custom_op("tilegen::merge_states", mutates_args=())
def _merge_op(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return merge_states(o_a, lse_a, o_b, lse_b)


@_merge_op.register_fake
def _(o_a, lse_a, o_b, lse_b):
    return o_a.new_empty(o_a.shape), lse_a.new_empty(lse_a.shape)
