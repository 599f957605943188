"""Ragged and paged attention: ``tilegen.varlen_attention`` and ``tilegen.PagedAttention`` (plan/run).

Both run the ``attention_varlen`` family's kernel and launch as every op does
(``tilegen.dispatch.planned``: the config chosen for the longest sequence's bucket, the
launcher's replay, a tuned row that fails at the first launch skipped for the next choice).

What is checked, and when:
- every call, on the host (cheap, no synchronization): ranks, shapes, dtypes and devices of
  every tensor, head counts and dims, ``cu_seqlens`` lengths against each other and their
  contiguity, the max lengths as non-negative host ints that can hold the packed token counts
  (``batch * max_seqlen >= total``), the cache's page size and heads against the plan;
- with ``TILEGEN_DEBUG=1``, also on the device (one synchronization per call): ``cu_seqlens``
  start at 0, never decrease, end at the packed token count, and no sequence is longer than
  its max length; the page table's indices lie inside the cache (``PagedKVCache.validate``)
  and no sequence has more queries than keys in the paged case.
Without the debug checks, values that contradict the tensors (a ``cu_seqlens`` past the end,
a length above ``max_seqlen``) give wrong results for their sequences, as in FlashAttention and
FlashInfer, but never an access outside the tensors: the kernel clamps every offset it reads
into the tensor it indexes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as _fwad

from tilegen import dispatch, env
from tilegen.dtypes import SPEC_DTYPES, SPEC_KV_DTYPES
from tilegen.families.attention_fwd.masks import (
    launch_window,
    mask_band,
    mask_kind,
    score_scalars,
    window_bounds,
)
from tilegen.families.attention_varlen import VarlenAttentionSpec
from tilegen.ir import SpecError
from tilegen.mods.blocks import block_table
from tilegen.mods.trace import CallRanges, ModCall, bind_mods, bind_traced, wants_grad
from tilegen.dispatch import launcher_for
from tilegen.ops import attention_grad
from tilegen.ops.kv_cache import (_MAX_TOKENS, PagedKVCache, check_heads_q, check_max_seqlen_k, check_run_cache,
                                  page_dtypes)
from tilegen.ops.memo import memoized, with_mod_fields
from tilegen.ops.mods import absorb
from tilegen.ops.planned import Planner, mod_tensor_names
from tilegen.ops.tensors import (NO_BACKWARD, autocast_inputs, autocasting, check_bool, check_device, check_distinct,
                                  check_grid, check_out, empty_like_template, off_eager, refuse_grad, refuse_tangents,
                                  transformed)

__all__ = ["varlen_attention", "varlen_attention_padded", "PagedAttention"]

_plans = dispatch.plan_cache()
_padded_plans = dispatch.plan_cache()  # varlen_attention_padded's: (plan, output template), or None: no views


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False, window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, scale: float | None = None, return_lse: bool = False,
    out: torch.Tensor | None = None, deterministic: bool = False, score_mod=None, mask_mod=None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed batch of sequences of different lengths (FlashAttention's varlen API);
    differentiable when an input requires grad, as ``tilegen.attention`` is.

    Args:
        q: ``[total_q, heads_q, head_dim]``, the batch's queries packed sequence after sequence.
        k, v: ``[total_k, heads_kv, head_dim]`` and ``[total_k, heads_kv, head_dim_v]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]``, on the inputs' device: sequence ``b``
            owns rows ``cu_seqlens[b]:cu_seqlens[b + 1]``. Sequences of length 0 are allowed. Rows past
            the last offset belong to no sequence: no query reads such keys, and the output and LSE rows
            of such queries are not written (as FlashAttention's varlen leaves them; their gradients are
            zeros), since only the device knows where the last sequence ends.
        max_seqlen_q, max_seqlen_k: host ints, the longest sequence of each (size the grid
            and pick the tuned config without reading the GPU).
        causal, window, softcap, scale, return_lse, out: as in ``tilegen.attention``, per
            sequence, with causal aligned bottom-right (query ``i`` of a sequence sees keys up
            to ``i + n_k - n_q``). ``lse`` is fp32 ``[total_q, heads_q]``.
        deterministic: the backward gives the same bits on every run (no atomic adds); always so under
            ``torch.use_deterministic_algorithms(True)`` (as in ``tilegen.attention``, mods included).
        score_mod, mask_mod: as in ``tilegen.attention`` (differentiable too), with ``b`` the sequence and
            ``q_idx``/``kv_idx`` positions within it; captured tensors indexed by them are range-checked
            against ``max_seqlen_q``/``max_seqlen_k``.

    In an autocast region for the inputs' device, the inputs are cast to its dtype as ``tilegen.attention`` casts
    them.
    """
    if autocasting():
        q, k, v = autocast_inputs(q, k, v)
    try:
        trains = (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()
    except AttributeError:  # not tensors: the checks say which
        trains = False
    if _fwad._current_level >= 0:  # a dual level is open: a tangent would be dropped silently on every route
        refuse_tangents("tilegen.varlen_attention", q=q, k=k, v=v)
    if score_mod is not None or mask_mod is not None:
        return _with_mods(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softcap,
                          scale, return_lse, out, deterministic, score_mod, mask_mod)
    if trains:
        return _differentiable(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                               softcap, scale, return_lse, out, deterministic)
    # Under vmap or a FakeTensorMode the tensors have no storage to launch on: the custom op, as under compile.
    if off_eager():
        return _compiled(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softcap,
                         scale, return_lse, out, deterministic)
    if type(deterministic) is not bool:
        raise TypeError(f"deterministic: expected a bool, got {deterministic!r}")
    key = None
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               call_key(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softcap, scale),
               return_lse.__class__, return_lse)
        plan = _plans.get(key)
    except (AttributeError, TypeError):
        plan = None
    if plan is None:
        plan = _plan_ragged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal, window, softcap, scale, return_lse)
        if key is not None:
            _plans.put(key, plan)
    if env.debug():
        _check_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    if out is None:
        out = _new_output(plan, q)
    else:
        out = _output(plan, q, out, {"k": k, "v": v})
        if out.requires_grad and torch.is_grad_enabled():
            refuse_grad("tilegen.varlen_attention", missing=NO_BACKWARD, out=out)
    # From a storage-free template kept in the plan: about 0.7 us less host time than new_empty (CPU machine).
    lse = torch.empty_like(plan.lse_like) if plan.lse_like is not None else None
    if plan.launches:
        # The plan's key fixes every shape, dtype and scalar the launcher reads; the strides complete the
        # key under which its launches are replayed (tilegen.triton_internals.launch.Replay).
        plan.launch((q.stride(), k.stride(), v.stride(), out.stride()),
                    q, k, v, out, out if lse is None else lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    elif lse is not None:
        lse.fill_(-math.inf)
    return (out, lse) if return_lse else out


def varlen_attention_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False, window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, scale: float | None = None,
) -> torch.Tensor:
    """``varlen_attention`` over a padded batch in transformers' layout, read where it lies: q ``[batch, heads,
    n_q, head_dim]``, k and v ``[batch, kv_heads, n_k, head_dim]``, whose rows ``b * n + i`` are the packed rows
    the offsets index; returns ``[batch, n_q, heads, head_dim_v]``, contiguous.

    The same as flattening q, k and v to ``[batch * n, heads, dim]``, calling ``varlen_attention`` and viewing
    its output back, but the kernel takes those flattened views at recording only (``Replay``'s ``views``):
    the seven views a call would make cost more host time than the rest of the call (CPU machine). Where a tensor
    does not flatten in place, under autograd and under ``torch.compile``, it is that call."""
    try:
        call = call_key(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softcap, scale)
    except (AttributeError, TypeError):  # offsets that are not tensors: varlen_attention says which
        call = None
    return padded_call(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                       softcap, scale)


def padded_call(call: tuple | None, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                softcap, scale) -> torch.Tensor:
    """``varlen_attention_padded`` with the key of its arguments past q, k and v made already (``call_key``;
    ``None``: none could be). A caller that makes many calls on one set of offsets (every layer of a transformers
    model) keys them once: the key is a quarter of the call's host time."""
    if autocasting():  # as varlen_attention, before the plan's key reads the dtypes
        q, k, v = autocast_inputs(q, k, v)
    try:
        plain = not ((q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled())
        strides = (q.stride(), k.stride(), v.stride())
        key = (q.shape, k.shape, v.shape, strides, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, call)
        planned = _padded_plans.get(key, False) if (call is not None and plain and not off_eager()) else None
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: varlen_attention says which
        key, planned = None, None
    if planned is False:
        planned = _plan_padded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                               softcap, scale)
        _padded_plans.put(key, planned)
    if planned is None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name}: expected [batch, heads, n, head_dim], got {_shape(t)}")
        _check_padded(q, k, v)
        rows = [t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], t.shape[3]) for t in (q, k, v)]
        out = varlen_attention(*rows, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                               window=window, softcap=softcap, scale=scale)
        return out.view(q.shape[0], q.shape[2], q.shape[1], out.shape[2])
    if env.debug():
        _check_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0] * q.shape[2], k.shape[0] * k.shape[2], max_seqlen_q,
                       max_seqlen_k)
    plan, out_like = planned
    out = torch.empty_like(out_like)
    if plan.launches:
        # The key's strides are q's, k's and v's own, which fix their views'; the output's are its template's.
        plan.launch(strides, q, k, v, out, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    return out


def call_key(cq, ck, max_q, max_k, causal, window, softcap, scale) -> tuple:
    """The part of a ragged call's plan key past its q, k and v: the offsets' layout and the other arguments, each
    with its type (``True == 1``, but only one was checked)."""
    # One tensor of offsets for both (self-attention) is keyed once: half the offsets' part of the key's host time.
    offsets = (cq.shape, cq.stride(), cq.dtype, cq.device) if ck is cq else (
        cq.shape, ck.shape, cq.stride(), ck.stride(), cq.dtype, ck.dtype, cq.device, ck.device)
    return (offsets, type(max_q), max_q, type(max_k), max_k, causal.__class__, causal, softcap.__class__, softcap,
            scale.__class__, scale, window if window is None else (window.__class__, *map(type, window), *window))


def _plan_padded(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, scale):
    """varlen_attention_padded's plan and output template, or ``None`` where a tensor does not flatten in place
    (or is not a 4-d tensor: the call without views says what is wrong)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and _flattens(t) for t in (q, k, v)):
        return None
    _check_padded(q, k, v)
    views = {0: _flat_rows, 1: _flat_rows, 2: _flat_rows, 3: _flat_out, 4: _flat_out}  # q, k, v, out, (no) LSE
    plan = _plan_ragged(_flat_rows(q), _flat_rows(k), _flat_rows(v), cu_q, cu_k, max_q, max_k, causal, window,
                        softcap, scale, False, views=views)
    return plan, empty_like_template((q.shape[0], q.shape[2], q.shape[1], plan.spec.dv), q.dtype, q.device)


def _check_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The padded batch's rows are ``b * n + i``: a batch (or v's length) that disagrees would still flatten to as
    many rows, and pair other rows' tokens."""
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name}: a batch of {t.shape[0]}, q has {q.shape[0]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v: {v.shape[2]} tokens a row, k has {k.shape[2]}")


def _flattens(t: torch.Tensor) -> bool:
    """Whether ``[batch, heads, n, dim]`` has a ``[batch * n, heads, dim]`` view: rows a fixed distance apart."""
    batch, _, n, _ = t.shape
    return batch <= 1 or n <= 1 or t.stride(0) == n * t.stride(2)


def _flat_rows(t: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, n, dim]`` as ``[batch * n, heads, dim]``, in place (``_flattens``)."""
    return t.transpose(1, 2).view(t.shape[0] * t.shape[2], t.shape[1], t.shape[3])


def _flat_out(out: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[batch, n, heads, dim]`` output as the launcher's ``[batch * n, heads, dim]``."""
    return out.view(out.shape[0] * out.shape[1], out.shape[2], out.shape[3])


def _with_mods(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, scale, return_lse, out, deterministic,
               score_mod, mask_mod):
    """A call with mods: the mod spec's own table and config, the mods' tensors passed at every launch.
    Differentiated (Q, K, V or a captured tensor requires grad) through ``attention_grad.apply_with_mods``.
    A mod that means a built-in option becomes it first (``tilegen.mods.builtin``); a mask, only where every
    sequence's queries are its keys (``cu_seqlens_q is cu_seqlens_k``), since the mods' positions are aligned
    top-left in each sequence and the built-ins' bottom-right. Under ``torch.compile``, the
    ``tilegen::varlen_attention_mods_fwd`` op (``_compiled_with_mods``)."""
    # Under torch.compile the mods are read at trace time (tilegen.mods.compiled), their tensors being graph inputs.
    found = (_compiled_mods().entries(score_mod, mask_mod, "tilegen.varlen_attention")
             if torch.compiler.is_compiling() else None)
    if found is None and transformed():  # the mods' op is made at trace time: none to run outside torch.compile
        raise NotImplementedError("tilegen.varlen_attention: score_mod/mask_mod under a torch.func transform (vmap, "
                                  "grad) or a FakeTensorMode are not supported; call it outside, or under "
                                  "torch.compile")
    checked = _checked_ragged(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, scale, return_lse)
    absorbed = absorb(score_mod, mask_mod, causal, window, softcap, 0 if cu_q is cu_k else None,
                      known=None if found is None else tuple(e and e.builtin for e in found))
    if absorbed[3:] != (score_mod, mask_mod):
        causal, window, softcap, score_mod, mask_mod = absorbed
        return varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window=window, softcap=softcap,
                                scale=scale, return_lse=return_lse, out=out, deterministic=deterministic,
                                score_mod=score_mod, mask_mod=mask_mod)
    # Each sequence has a diagonal of its own, which the host knows only where its queries are its keys.
    ranges = CallRanges(cu_q.numel() - 1, q.shape[1], max_q, max_k,
                        mask_band(checked[1], checked[2]) if cu_q is cu_k else "unknown")
    if found is not None:
        mods = bind_traced(_compiled_mods().bind(score_mod, mask_mod, found), q.device, ranges)
        return _compiled_with_mods(q, k, v, cu_q, cu_k, max_q, max_k, checked, mods, return_lse, out, deterministic)
    plan = _plan_checked(q, max_q, max_k, checked)
    mods = bind_mods(score_mod, mask_mod, q.device, ranges)
    spec = with_mod_fields(plan.spec, mods.score_mod, mods.mask_mod)
    if env.debug():
        _check_offsets(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    if wants_grad(q, k, v, mods.tensors):
        attention_grad.check_training_args(out, deterministic)
        spec = spec.replace(return_lse=True)  # the backward reads it
        bwd, deterministic = attention_grad.mod_backward_spec(spec, "ragged", mods, deterministic)
        fixed = {key: plan.launch_args[key] for key in ("scale", "softcap", "window_left", "window_right")}

        def backward(dout, dlse, q, k, v, out, lse, wants):
            return attention_grad.run_with_mods(bwd, mods, wants, dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q,
                                                max_k, fixed, deterministic)

        out, lse = attention_grad.apply_with_mods(
            "tilegen.varlen_attention",
            lambda q, k, v: _launch_with_mods(spec, plan, mods, q, k, v, cu_q, cu_k, max_q, max_k, None),
            backward, q, k, v, mods.tensors)
    else:
        check_bool("deterministic", deterministic)
        out, lse = _launch_with_mods(spec, plan, mods, q, k, v, cu_q, cu_k, max_q, max_k, out)
    return (out, lse) if return_lse else out


def _compiled_mods():
    """``tilegen.mods.compiled``, imported at the first call under ``torch.compile`` (it imports Dynamo)."""
    from tilegen.mods import compiled

    return compiled


def _compiled_with_mods(q, k, v, cu_q, cu_k, max_q, max_k, checked, mods, return_lse, out, deterministic):
    """A call with mods under ``torch.compile``: the ``tilegen::varlen_attention_mods_fwd`` custom op, which plans
    and launches as an eager call does, differentiable through ``tilegen::varlen_attention_mods_bwd``
    (``attention_grad.attach_ragged_mods``). ``checked``: ``_checked_ragged``'s spec and launch values."""
    spec, left, right, scale, softcap = checked
    trains, deterministic = attention_grad.check_compiled_mods(q, k, v, mods, out, deterministic)
    if env.debug():
        _check_offsets(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    result, lse = torch.ops.tilegen.varlen_attention_mods_fwd(
        q, k, v, cu_q, cu_k, max_q, max_k, list(mods.tensors), len(mods.tensors) - len(mods.mask_tensors),
        mods.score_mod, mods.mask_mod, spec.dv, spec.mask, spec.softcap, spec.return_lse or trains, scale, softcap,
        left, right, deterministic)
    return _compiled_result(result, lse, out, q, spec.dv, return_lse)


def _launch_with_mods(spec, plan, mods, q, k, v, cu_q, cu_k, max_q, max_k, out):
    """``(out, lse)`` of the forward with mods (``lse`` None unless the spec returns it)."""
    out = _output(plan, q, out, {"k": k, "v": v})
    if out.requires_grad and torch.is_grad_enabled():
        refuse_grad("tilegen.varlen_attention", missing=NO_BACKWARD, out=out)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32) if spec.return_lse else None
    if plan.launches:
        config = _table(spec, q.device).choose(max(max_q, max_k)).config
        launch_args = {**plan.launch_args, **config.to_dict()}
        blocks = {}
        if mods.mask_mod is not None:
            # Over the longest sequences' positions: valid for every shorter one (tilegen.mods.blocks).
            blocks["mod_blocks"] = block_table(mods.mask_mod, mods.mask_tensors, cu_q.numel() - 1, q.shape[1], max_q,
                                               max_k, config.block_m, config.block_n, q.device)
        launcher_for(spec).jit(q, k, v, out, out if lse is None else lse, cu_q, cu_k, max_q,
                               mod_tensors=mods.tensors, **blocks, **launch_args)
    elif lse is not None:
        lse.fill_(-math.inf)
    return out, lse


def _differentiable(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, scale, return_lse, out,
                    deterministic):
    """A call that trains: through the custom op, whose autograd runs the backward; every argument is
    checked before the forward runs. Reads no table (the op plans), so ``torch.compile`` traces it."""
    attention_grad.check_training_args(out, deterministic)
    # As SDPA's flash backward, which reads it: under torch.use_deterministic_algorithms(True), no atomics.
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    check_bool("return_lse", return_lse)  # the forward below always makes the LSE, for the backward
    spec, left, right, scale, softcap = _checked_ragged(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap,
                                                        scale, True)
    check_grid("cu_seqlens_q", (cu_q.numel() - 1) * q.shape[1], "(sequence, head) pairs of the backward")
    attention_grad.backward_spec(q.dtype, spec.head_dim, spec.dv, spec.q_per_kv, spec.mask, spec.softcap, "ragged")
    if env.debug():
        _check_offsets(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    result, lse = torch.ops.tilegen.varlen_attention_fwd(
        q, k, v, cu_q, cu_k, max_q, max_k, spec.dv, spec.mask, spec.softcap, scale, softcap, left, right,
        deterministic)
    return (result, lse) if return_lse else result


def _compiled(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, scale, return_lse, out, deterministic):
    """A call that does not train, under ``torch.compile``: the arguments checked in traced code, then the custom
    op, which plans and launches opaquely (its plans and the dispatch tables are host state Dynamo should not
    trace); it always makes the LSE. A result asked into ``out`` is the op's copied there."""
    check_bool("deterministic", deterministic)
    spec, left, right, scale, softcap = _checked_ragged(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap,
                                                        scale, return_lse)
    result, lse = torch.ops.tilegen.varlen_attention_fwd(
        q, k, v, cu_q, cu_k, max_q, max_k, spec.dv, spec.mask, spec.softcap, scale, softcap, left, right, deterministic)
    return _compiled_result(result, lse, out, q, spec.dv, return_lse)


def _compiled_result(result, lse, out, q, dv, return_lse):
    """A compiled call's return, the op's result copied into an ``out`` given (attention's ``_compiled_result``:
    an ``out`` sharing memory with k or v is written after the op has read them)."""
    if out is not None:
        _check_out_shape(out, q, dv)
        check_distinct("out", out)
        result = out.copy_(result)
    return (result, lse) if return_lse else result


def _check_out_shape(out, q, dv) -> None:
    shape = (q.shape[0], q.shape[1], dv)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {_shape(out)}")
    if out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out: expected {q.dtype} on {q.device}, got {out.dtype} on {out.device}")


_op_plans = dispatch.plan_cache()


def _op_plan(q, k, cu_q, max_q, max_k, head_dim_v, mask, has_softcap, return_lse, scale, softcap, window_left,
             window_right) -> _Plan:
    """The custom ops' plan of a call (their arguments were checked in traced code), kept per shape and value."""
    spec = _spec_for(SPEC_DTYPES[q.dtype], q.shape[2], head_dim_v, q.shape[1] // k.shape[1], mask, has_softcap,
                     return_lse, "ragged", None)
    key = (q.shape, k.shape, q.device, cu_q.shape, spec, max_q, max_k, scale, softcap, window_left, window_right)
    plan = _op_plans.get(key)
    if plan is None:
        fixed = {"scale": scale, "softcap": softcap, "window_left": window_left, "window_right": window_right}
        plan = _planned(spec, q.device, max(max_q, max_k), fixed, heads_q=q.shape[1],
                        launches=max_q > 0 and q.shape[0] > 0)
        _op_plans.put(key, plan)
    return plan


@torch.library.custom_op("tilegen::varlen_attention_fwd", mutates_args=())
def _varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, head_dim_v: int, mask: str, has_softcap: bool, scale: float,
    softcap: float, window_left: int, window_right: int, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Always with the LSE: the op exists for training, whose backward reads it.
    plan = _op_plan(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, head_dim_v, mask, has_softcap, True, scale,
                    softcap, window_left, window_right)
    out = q.new_empty((q.shape[0], q.shape[1], head_dim_v))
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    if plan.launches:
        plan.launch((q.stride(), k.stride(), v.stride(), out.stride()),
                    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    else:
        lse.fill_(-math.inf)
    return out, lse


@_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, head_dim_v, *args):
    return q.new_empty((q.shape[0], q.shape[1], head_dim_v)), q.new_empty(q.shape[:2], dtype=torch.float32)


attention_grad.attach_ragged(_varlen_op)


@torch.library.custom_op("tilegen::varlen_attention_mods_fwd", mutates_args=())
def _varlen_mods_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, mod_tensors: list[torch.Tensor], score_tensors: int, score_mod: str | None,
    mask_mod: str | None, head_dim_v: int, mask: str, has_softcap: bool, return_lse: bool, scale: float,
    softcap: float, window_left: int, window_right: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # As tilegen::attention_mods_fwd: the score mod's tensors first (score_tensors of them), then the mask mod's;
    # deterministic is the backward's, without a default (the dispatcher would drop it from the arguments).
    plan = _op_plan(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, head_dim_v, mask, has_softcap, return_lse, scale,
                    softcap, window_left, window_right)
    spec = with_mod_fields(plan.spec, score_mod, mask_mod)
    mods = ModCall(score_mod, mask_mod, tuple(mod_tensors), tuple(mod_tensors[score_tensors:]))
    out, lse = _launch_with_mods(spec, plan, mods, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 None)
    # A custom op returns tensors only: an empty one stands for "no LSE".
    return out, lse if lse is not None else q.new_empty((0,), dtype=torch.float32)


@_varlen_mods_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mod_tensors, score_tensors, score_mod,
      mask_mod, head_dim_v, mask, has_softcap, return_lse, *args):
    return (q.new_empty((q.shape[0], q.shape[1], head_dim_v)),
            q.new_empty(q.shape[:2] if return_lse else (0,), dtype=torch.float32))


attention_grad.attach_ragged_mods(_varlen_mods_op)


class PagedAttention(Planner):
    """Prefill and append attention against a paged KV cache, FlashInfer's plan/run split.

    ``plan`` takes the batch's layout once per batch (query lengths, the page table, the
    mask and head counts) and is reused by every layer; ``run(q, cache)`` launches on one
    layer's cache. ``run`` neither synchronizes nor reads the page table on the host, so it can
    be captured in a CUDA graph when the planned shapes stay fixed.

    Each sequence's new queries are its last ``n_q`` tokens: the cache must already hold
    them (append their K and V first), and causal masking lets each see the whole prefix.

    An FP8 cache (``float8_e4m3fn``/``float8_e5m2`` pages with their scales) is read as FP8 and
    dequantized in the kernel; the query keeps its own dtype, ``plan(q_dtype=...)`` (bf16 unless
    given).

    Example::

        attn = tilegen.PagedAttention()
        attn.plan(cu_seqlens_q, caches[0], heads_q=32, causal=True, max_seqlen_q=512)
        for layer in range(n_layers):
            out = attn.run(q[layer], caches[layer])
    """

    op = "tilegen.PagedAttention.run"

    _plan: _Plan | None

    def plan(
        self, cu_seqlens_q: torch.Tensor, cache: PagedKVCache, *, heads_q: int, head_dim: int | None = None,
        causal: bool = False, window: tuple[int | None, int | None] | None = None, softcap: float | None = None,
        scale: float | None = None, return_lse: bool = False, max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None, q_dtype: torch.dtype | None = None, score_mod=None, mask_mod=None,
    ) -> None:
        """Fix the batch layout. ``max_seqlen_q``/``max_seqlen_k`` (host ints) spare one synchronization each;
        each must be at least its longest sequence (a smaller one gives the longer sequences wrong answers, never
        a read outside the tensors; ``TILEGEN_DEBUG=1`` checks both).
        ``q_dtype``: the query's dtype, which must be the pages' unless they are FP8 (then float16,
        bfloat16 or float32; bfloat16 when left out).

        ``score_mod``/``mask_mod``: FlexAttention's mods (``tilegen.mods``), fixed with the rest of the
        plan, as FlashInfer's plan fixes the mask and the logits' transforms. ``b`` is the sequence, ``h``
        the query head, ``kv_idx`` the key's position in its sequence and ``q_idx`` the query's: a
        sequence of ``n_k`` keys with ``n_q`` new tokens has its query ``i`` at ``n_k - n_q + i``, as
        ``PagedDecode`` has its one at ``n_k - 1`` (docs/mods.md). The captured tensors are the ones the
        mods reach at plan time; every ``run`` reads their values then, so they may change in place between
        runs (a CUDA graph replay included), while a new tensor needs a new plan. Their indices are
        range-checked here against the batch, ``heads_q`` and ``max_seqlen_k``."""
        self._refuse_plan_compiling()
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected a tilegen.PagedKVCache, got {type(cache).__name__}")
        _check_lengths("cu_seqlens_q", cu_seqlens_q, cache.k_pages.device)
        if cu_seqlens_q.numel() != cache.batch + 1:
            raise ValueError(f"cu_seqlens_q: {cu_seqlens_q.numel()} entries, but the cache's page table has "
                             f"{cache.batch} sequences (expected {cache.batch + 1})")
        check_heads_q(cache, heads_q)
        check_grid("cache", cache.batch, "sequences")
        check_device("cache", cache.k_pages.device, "pages")  # before the lengths are read back from it
        dim = cache.k_pages.shape[3]
        if head_dim is not None and head_dim != dim:
            raise ValueError(f"head_dim: {head_dim!r} differs from the cache's {dim}")
        pages = cache.k_pages
        kv_dtype, q_dtype = page_dtypes(cache, q_dtype)
        seq_lens = cache.seq_lens()
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cache.batch else 0
        if max_seqlen_k is None:
            max_seqlen_k = int(seq_lens.max()) if cache.batch else 0
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            _check_max(name, value)
        if score_mod is not None or mask_mod is not None:  # the positions are the keys': no shift
            causal, window, softcap, score_mod, mask_mod = absorb(score_mod, mask_mod, causal, window, softcap)
        spec, left, right, scale, softcap = _prepare(
            q_dtype, dim, cache.v_pages.shape[3], heads_q // cache.kv_heads, causal, window, softcap,
            scale, return_lse, max_seqlen_q, max_seqlen_k, layout="paged", page_size=cache.page_size,
            kv_dtype=kv_dtype,
        )
        mod_tensors = ()
        if score_mod is not None or mask_mod is not None:
            spec, mod_tensors = paged_mods(spec, score_mod, mask_mod, pages.device, cache.batch, heads_q,
                                           max_seqlen_k, (left, right))
        # Checked before the plan is kept: a refused plan(...) leaves the previous one in place.
        if env.debug():
            cache.validate()
            _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, max_seqlen_q)
            if bool(((cu_seqlens_q[1:] - cu_seqlens_q[:-1]) > seq_lens).any()):
                raise ValueError("cu_seqlens_q: a sequence has more new tokens than the cache holds for it")
            check_max_seqlen_k(cache, max_seqlen_k)
        self._plan = _planned(
            spec, cache.k_pages.device, max(max_seqlen_q, max_seqlen_k),
            {"scale": scale, "softcap": softcap, "window_left": left, "window_right": right},
            heads_q=heads_q, launches=max_seqlen_q > 0 and cache.batch > 0,
            extra=(cu_seqlens_q, cache.indptr, cache.indices, cache.last_page_len, max_seqlen_q, seq_lens,
                   max_seqlen_k),
            q_dtype=q_dtype, scale_kinds=cache._scale_kinds, mod_tensors=mod_tensors,
            cache_layout=cache._layout,
        )

    def run(self, q: torch.Tensor, cache: PagedKVCache, *, out: torch.Tensor | None = None):
        """Attention of ``q`` ``[total_q, heads_q, head_dim]`` against one layer's ``cache``. In an autocast region
        of the plan's dtype, a query of another is cast to it, as SDPA casts its inputs."""
        # Under vmap or a FakeTensorMode q has no storage to launch on: the custom op, as under compile.
        if off_eager():
            return self._compiled_run(q, cache, out)
        plan = self._plan
        if plan is None:
            raise RuntimeError("PagedAttention.run: call plan(...) first, once per batch")
        spec = plan.spec
        # A cache laid out as the planned one's, batch included, passes in one comparison; any other is checked
        # field by field.
        if cache.__class__ is not PagedKVCache or cache._layout != plan.cache_layout:
            if not isinstance(cache, PagedKVCache):
                raise TypeError(f"cache: expected a tilegen.PagedKVCache, got {type(cache).__name__}")
            pages = cache.k_pages
            if (pages.shape[1], pages.shape[3], cache.v_pages.shape[3], SPEC_KV_DTYPES.get(pages.dtype),
                    cache._scale_kinds) != (spec.page_size, spec.head_dim, spec.dv, spec.kv_dtype, plan.scale_kinds) \
                    or (spec.kv_dtype is None and SPEC_DTYPES.get(pages.dtype) != spec.dtype) \
                    or plan.heads_q // spec.q_per_kv != cache.kv_heads:
                raise ValueError(f"cache: page size, heads, dims, dtype or scales differ from the plan's "
                                 f"({spec.name})")
            # run reads the planned page table, so a cache of another batch is a stale plan; its length is on the
            # host, unlike the table's values (TILEGEN_DEBUG compares those).
            planned_batch = plan.extra[1].shape[0] - 1
            if cache.batch != planned_batch:
                raise ValueError(f"cache: a page table of {cache.batch} sequences, but the plan's has {planned_batch}; "
                                 "plan again on this cache")
        pages = cache.k_pages
        cu_q, indptr, indices, last, max_q, _, _ = plan.extra
        if not pages.shape[0] and indices.numel():
            # The kernel clamps page ids into the cache's pages: with none, its reads would start before them.
            raise ValueError("cache: has no pages, but the plan's page table lists some")
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[1:] != (plan.heads_q, spec.head_dim):
            raise ValueError(f"q: expected [total_q, {plan.heads_q}, {spec.head_dim}], got {_shape(q)}")
        if q.dtype != plan.q_dtype or q.device != pages.device:  # cast in an autocast region of the plan's dtype
            q = self._query_as_planned(q, plan.q_dtype, pages.device)
        _check_rows("q", max_q, "cu_seqlens_q", cu_q.shape[0] - 1, "q", q.shape[0], planned=True)
        if env.debug():
            _check_planned_table(cache, plan, q.shape[0])
        out = _new_output(plan, q) if out is None else _output(
            plan, q, out, {"cache.k_pages": pages, "cache.v_pages": cache.v_pages})
        # No backward: an output without a grad_fn would silently cut the graph. Inline, as it runs every call.
        if torch.is_grad_enabled() and (q.requires_grad or out.requires_grad or pages.requires_grad
                                        or cache.v_pages.requires_grad or cache._scales_require_grad()
                                        or (plan.mod_tensors and any(t.requires_grad for t in plan.mod_tensors))):
            refuse_grad("tilegen.PagedAttention.run", q=q, out=out, **cache._named_tensors(),
                        **mod_tensor_names(plan.mod_tensors))
        lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32) if spec.return_lse else None
        if plan.launches and q.shape[0]:
            # The plan and the checks above fix what the launcher reads but the strides, q's token count
            # and the page count (the kernel clamps into both): they complete the replay key. The page
            # table is the plan's, as run() has always used it.
            plan.launch((q.shape[0], cache._pages_key, q.stride(), out.stride()),
                        q, pages, cache.v_pages, out, out if lse is None else lse, cu_q, indptr, indices, last, max_q,
                        *cache._scales, *plan.mod_tensors)
        elif lse is not None:
            lse.fill_(-math.inf)
        return (out, lse) if spec.return_lse else out


def _check_planned_table(cache: PagedKVCache, plan: _Plan, q_rows: int) -> None:
    """``TILEGEN_DEBUG=1``'s check at ``PagedAttention.run`` (synchronizes): q has the rows the planned offsets
    end at (more would go unwritten, fewer would pair rows with other sequences' keys), the cache is valid, its page
    table is the one ``plan`` read (``run`` reads the planned table, not the cache's), no sequence has grown past
    the planned ``max_seqlen_k`` (its later keys would go unread) nor holds fewer keys than it has new tokens."""
    cu_q, indptr, indices, last, _, _, max_k = plan.extra
    end = int(cu_q[-1])
    if end != q_rows:
        raise ValueError(f"q: {q_rows} tokens, but the planned cu_seqlens_q ends at {end}")
    check_run_cache(cache, max_k)
    planned = cache.indptr is indptr and cache.indices is indices and cache.last_page_len is last
    if not planned and not (
            torch.equal(cache.indptr, indptr) and torch.equal(cache.last_page_len, last)
            and torch.equal(cache.indices[:int(indptr[-1])], indices[:int(indptr[-1])])):
        raise ValueError("cache: its page table (indptr, indices, last_page_len) differs from the one plan(...) read, "
                         "which run uses; plan again on this cache")
    if bool(((cu_q[1:] - cu_q[:-1]) > cache.seq_lens()).any()):
        raise ValueError("cache: a sequence has fewer tokens than its new tokens in the planned cu_seqlens_q")


@dataclass(frozen=True)
class _Plan:
    spec: VarlenAttentionSpec
    heads_q: int
    launch: Any  # launch(key, *launcher arguments): a Replay of the launcher with launch_args (dispatch.planned)
    launches: bool
    launch_args: dict[str, Any]
    extra: tuple = ()
    q_dtype: torch.dtype | None = None
    scale_kinds: tuple = ()  # the paged cache's scale sizes (one or per head), which the launch is keyed by
    mod_tensors: tuple = ()  # the mods' captured tensors, bound at plan time (PagedAttention.plan)
    cache_layout: tuple = ()  # the planned cache's PagedKVCache._layout, its batch included (PagedAttention.plan)
    # varlen_attention's plans, whose key fixes q's shape: the fp32 LSE's template ([total_q, heads_q], one element
    # expanded), or None.
    lse_like: torch.Tensor | None = None
    # Every plan is used with q of its heads_q heads of spec.head_dim (its key or run's checks fix them): then the
    # output has q's shape exactly when V's head dim is Q's.
    out_like_q: bool = False


def paged_mods(spec, score_mod, mask_mod, device: torch.device, batch: int, heads_q: int, max_seqlen_k: int,
               window: tuple[int | None, int | None]):
    """A paged plan's mods: the spec with their texts and their captured tensors, indices checked against
    the ranges of the paged positions (``q_idx`` and ``kv_idx`` both below the longest sequence, the key within
    ``window``'s ``(left, right)`` of the query's position)."""
    mods = bind_mods(score_mod, mask_mod, device, CallRanges(batch, heads_q, max_seqlen_k, max_seqlen_k,
                                                             mask_band(*window)))
    return with_mod_fields(spec, mods.score_mod, mods.mask_mod), mods.tensors


def _plan_ragged(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, scale, return_lse,
                 views=None) -> _Plan:
    """varlen_attention's cached plan, which also holds its LSE's template. ``views``: the launch takes those
    arguments through views of the caller's tensors (``Replay``), as ``varlen_attention_padded``'s does."""
    checked = _checked_ragged(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, scale, return_lse)
    lse_like = empty_like_template(q.shape[:2], torch.float32, q.device) if checked[0].return_lse else None
    return _plan_checked(q, max_q, max_k, checked, views=views, lse_like=lse_like)


def _plan_checked(q, max_q, max_k, checked, views=None, **fields) -> _Plan:
    """The plan of a ragged call whose arguments ``_checked_ragged`` checked (``checked``: what it returned)."""
    spec, left, right, scale, softcap = checked
    return _planned(spec, q.device, max(max_q, max_k),
                    {"scale": scale, "softcap": softcap, "window_left": left, "window_right": right},
                    views=views, heads_q=q.shape[1], launches=max_q > 0 and q.shape[0] > 0, **fields)


def _checked_ragged(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, scale, return_lse):
    """Every argument of a ragged call checked (errors name the argument): ``(spec, window_left, window_right,
    scale, softcap)``. Reads no table, so ``torch.compile`` traces it."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected [total_tokens, heads, head_dim], got {_shape(t)}")
    if q.dtype not in SPEC_DTYPES:
        raise TypeError(f"q: expected dtype float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: {t.dtype} on {t.device} differs from q's {q.dtype} on {q.device}")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"v: tokens and heads {tuple(v.shape[:2])} differ from k's {tuple(k.shape[:2])}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k: head_dim {k.shape[2]} differs from q's {q.shape[2]}")
    if q.shape[1] == 0 and k.shape[1]:
        raise ValueError(f"q: no query head; expected a positive multiple of k's {k.shape[1]} KV heads")
    if k.shape[1] == 0:
        raise ValueError(f"k: no KV head (shape {tuple(k.shape)}); expected at least one")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q: {q.shape[1]} query heads is not a multiple of k's {k.shape[1]} KV heads")
    _check_lengths("cu_seqlens_q", cu_q, q.device)
    _check_lengths("cu_seqlens_k", cu_k, q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_k: {cu_k.numel()} entries, cu_seqlens_q has {cu_q.numel()}; both are batch + 1")
    check_grid("cu_seqlens_q", cu_q.numel() - 1, "sequences")
    _check_max("max_seqlen_q", max_q)
    _check_max("max_seqlen_k", max_k)
    _check_rows("max_seqlen_q", max_q, "cu_seqlens_q", cu_q.numel() - 1, "q", q.shape[0])
    _check_rows("max_seqlen_k", max_k, "cu_seqlens_k", cu_k.numel() - 1, "k", k.shape[0])
    return _prepare(q.dtype, q.shape[2], v.shape[2], q.shape[1] // k.shape[1], causal, window, softcap, scale,
                    return_lse, max_q, max_k, layout="ragged", page_size=None)


def _planned(spec: VarlenAttentionSpec, device: torch.device, size: int, fixed: dict[str, Any], views=None,
             **fields) -> _Plan:
    """The plan for ``size``'s choice (``tilegen.dispatch.planned``): the launcher's replay with the
    ``fixed`` launch values and the config's (and ``views``, as ``Launcher.replay`` takes them)."""
    table = _table(spec, device)
    launcher = launcher_for(spec)

    def make(choice: dispatch.Choice) -> _Plan:
        launch_args = {**fixed, **choice.config.to_dict()}
        return _Plan(spec=spec, launch=launcher.replay(launch_args, views), launch_args=launch_args,
                     out_like_q=spec.dv == spec.head_dim, **fields)

    return dispatch.planned(table, size, make)


def _prepare(dtype, dim, dim_v, q_per_kv, causal, window, softcap, scale, return_lse, max_q, max_k, *, layout,
             page_size, kv_dtype=None):
    """The spec and launch values of a call; errors name the argument. ``dtype`` was checked by the caller
    (``_checked_ragged``, ``page_dtypes``), before any mismatch with it is named."""
    scale_value, softcap_value = score_scalars(scale, softcap, dim)
    left, right = window_bounds(window, causal)
    check_bool("return_lse", return_lse)
    mask = mask_kind(left, right)
    spec = _spec_for(SPEC_DTYPES[dtype], dim, dim_v, q_per_kv, mask, softcap is not None, return_lse,
                     layout, page_size, kv_dtype)
    return (spec, *launch_window(mask, left, right, max_q, max_k), scale_value, softcap_value)


@memoized
def _spec_for(dtype, dim, dim_v, q_per_kv, mask, softcap, return_lse, layout, page_size,
              kv_dtype=None) -> VarlenAttentionSpec:
    try:
        return VarlenAttentionSpec(head_dim=dim, head_dim_v=None if dim_v == dim else dim_v, q_per_kv=q_per_kv,
                                   mask=mask, softcap=softcap, dtype=dtype, return_lse=return_lse,
                                   kv_layout=layout, page_size=page_size, kv_dtype=kv_dtype)
    except SpecError as e:
        # A paged call's head dims are its cache's.
        tensors = ("cache", "cache") if layout == "paged" else ("q", "v")
        arg = {"head_dim": tensors[0], "head_dim_v": tensors[1], "page_size": "cache", "kv_dtype": "cache"}.get(
            e.field, e.field)
        raise ValueError(f"{arg}: {e}") from None


def _table(spec: VarlenAttentionSpec, device: torch.device) -> dispatch.Table:
    check_device("q", device)
    return dispatch.table_on(spec, device)


def _new_output(plan: _Plan, q: torch.Tensor) -> torch.Tensor:
    """A call's output: empty_like(q) where it has q's shape (contiguous, as new_empty gives it), about 0.7 us
    less host time than new_empty (CPU machine)."""
    if plan.out_like_q and q.is_contiguous():
        return torch.empty_like(q)
    return q.new_empty((q.shape[0], plan.heads_q, plan.spec.dv))


def _output(plan: _Plan, q: torch.Tensor, out: torch.Tensor | None, kv: dict[str, torch.Tensor]) -> torch.Tensor:
    """``out`` checked (``kv``: the other inputs it must not overlap, by name), or a new output."""
    shape = (q.shape[0], plan.heads_q, plan.spec.dv)
    if out is None:
        return _new_output(plan, q)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {_shape(out)}")
    if out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out: expected {q.dtype} on {q.device}, got {out.dtype} on {out.device}")
    # A program reads only its own query rows, before it writes their output: out may be q itself.
    check_out("out", out, {"q": q, **kv}, may_be=("q",))
    return out


def _check_lengths(name: str, t: Any, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32 or t.numel() < 1:
        raise ValueError(f"{name}: expected a 1-d int32 tensor of batch + 1 offsets, got {_shape(t)}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device} while the inputs are on {device}")
    if not t.is_contiguous():
        # The kernel reads offset b at address + b: a strided or expanded view would be read past its storage.
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def _check_max(name: str, value: Any) -> None:
    # The kernels count a sequence's positions (and its query tiles' first rows) in int32: past that they wrap.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_TOKENS:
        raise ValueError(f"{name}: expected a host int from 0 to {_MAX_TOKENS} (the longest sequence), got {value!r}")


def _check_rows(name: str, max_len: int, cu_name: str, batch: int, packed: str, total: int,
                planned: bool = False) -> None:
    """Sequences of at most ``max_len`` tokens must be able to hold the ``total`` packed rows; the
    error names ``name``, the max length (or, ``planned``, the packed tensor against a plan's)."""
    if batch == 0 and total:
        raise ValueError(f"{cu_name}: no sequence, but {packed} has {total} rows")
    if batch * max_len < total:
        expected = f"at most {batch * max_len} rows, as planned" if planned else f"at least {-(-total // batch)}"
        raise ValueError(f"{name}: {batch} sequences of at most {max_len} tokens cannot hold {packed}'s {total} "
                         f"rows; expected {expected}")


def _check_offsets(cu_q, cu_k, total_q: int, total_k: int, max_q: int, max_k: int) -> None:
    """Both offsets of a ragged call checked on the device (``TILEGEN_DEBUG=1``)."""
    _check_cu_seqlens("cu_seqlens_q", cu_q, total_q, max_q)
    _check_cu_seqlens("cu_seqlens_k", cu_k, total_k, max_k)


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int | None, max_len: int) -> None:
    """Device-side checks of TILEGEN_DEBUG=1 (one synchronization)."""
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}: must start at 0, starts at {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name}: must not decrease")
    if total is not None and values[-1] != total:
        raise ValueError(f"{name}: ends at {values[-1]}, but the packed tensor has {total} tokens")
    if lengths and max(lengths) > max_len:
        raise ValueError(f"{name}: a sequence of {max(lengths)} tokens exceeds max_seqlen {max_len}")


def _shape(t: Any) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
