"""``tilegen.attention``: a drop-in for ``F.scaled_dot_product_attention`` on [batch, heads, seq, dim].

Eager calls go straight to their plan's launch; under ``torch.compile`` the call goes through
the ``tilegen::attention_fwd`` custom op, whose fake implementation lets Dynamo trace
it with ``fullgraph=True``, and which launches through the same plans. The custom-op layer
costs microseconds that eager callers need not pay.

A plan is made as every op's is (``tilegen.dispatch.planned``: choose, launcher, replay): a
call of at most a few query rows takes the decode family's kernel (decided before the dense
table is even loaded), any other the dense one; a tuned row that fails to compile or launch
is skipped at the plan's first launch, with one warning, and the next choice runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as _fwad

from tilegen import dispatch
from tilegen.codegen import module_for
from tilegen.device import device_info
from tilegen.dtypes import SPEC_DTYPES
from tilegen.env import interpreting
from tilegen.families.attention_decode import DecodeSpec
from tilegen.families.attention_decode.config import split_count
from tilegen.families.attention_decode.problem import decode_buffers
from tilegen.families.attention_decode.spec import MAX_Q_TOKENS
from tilegen.families.attention_fwd import AttentionSpec
from tilegen.families.attention_fwd.masks import (
    launch_window,
    mask_band,
    mask_kind,
    score_scalars,
    window_bounds,
)
from tilegen.ir import SpecError
from tilegen.mods.blocks import block_table
from tilegen.mods.trace import CallRanges, ModCall, bind_mods, bind_traced, wants_grad
from tilegen.dispatch import launcher_for
from tilegen.ops import attention_grad
from tilegen.ops.memo import memoized, with_mod_fields
from tilegen.ops.mods import absorb
from tilegen.ops.tensors import (MAX_GRID_YZ, NO_BACKWARD, autocast_inputs, autocasting, check_bool, check_distinct,
                                  check_grid, check_out, empty_like_template, off_eager, refuse_grad, refuse_tangents,
                                  transformed)

__all__ = ["attention", "attention_seq_major", "explain", "prepare_call", "run_with_config"]
# Lengths past this could overflow the kernel's int32 index arithmetic around the diagonal.
_MAX_SEQLEN = 1 << 29


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    deterministic: bool = False,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused attention; differentiable when an input requires grad.

    Args:
        q: ``[batch, heads_q, n_q, head_dim]``.
        k: ``[batch, heads_kv, n_k, head_dim]``; ``heads_q`` must be a multiple of ``heads_kv``
            (GQA; one KV head is MQA).
        v: ``[batch, heads_kv, n_k, head_dim_v]``.
        causal: mask keys after the diagonal, aligned bottom-right when ``n_q != n_k``
            (query ``i`` sees keys ``<= i + n_k - n_q``), as FlashAttention does.
        window: ``(left, right)``: keys at most ``left`` before and ``right`` after the
            diagonal; ``None`` on a side leaves it unbounded. Rows that see no key give zeros.
        softcap: logits become ``softcap * tanh(logits / softcap)``.
        scale: softmax scale, ``1/sqrt(head_dim)`` by default.
        return_lse: also return the natural-log log-sum-exp, fp32 ``[batch, heads_q, n_q]``
            (``-inf`` for rows that see no key).
        out: write the output here instead of a new tensor: ``[batch, heads_q, n_q, head_dim_v]``
            in the input dtype, on the input device, any strides; ``q`` itself (in place), but
            nothing else that shares memory with itself, ``q``, ``k`` or ``v``. Not when an input
            requires grad (a result written in place cannot be differentiated).
        deterministic: the backward gives the same bits on every run (no atomic adds), at some speed; always so
            under ``torch.use_deterministic_algorithms(True)``, as SDPA's flash backward is (with mods, a captured
            tensor that requires grad is then refused: its gradient is summed by atomic adds).
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)``, applied to the scaled logit
            before the softmax; ``mask_mod(b, h, q_idx, kv_idx) -> bool`` ANDs into the mask (``causal``
            and ``window`` still apply). Traced once per function (``tilegen.mods``: the supported
            operations, and how captured tensors are passed and range-checked). Differentiable: the
            gradients reach Q, K, V and the mods' captured tensors that require grad (a learned bias table),
            through the score mod's derivative (``tilegen.mods.grad``).

    When ``q``, ``k`` or ``v`` requires grad (and grad mode is on), the result backpropagates through
    the ``attention_bwd`` family's kernels, to the LSE too when it is returned; the forward keeps
    Q, K, V, the output and the fp32 LSE for it, nothing of size n_q x n_k.

    Returns:
        ``out`` of shape ``[batch, heads_q, n_q, head_dim_v]`` in the input dtype (laid out as
        ``q`` when it has ``q``'s shape, as ``torch.empty_like(q)`` lays it out), and ``lse``
        when asked for. In an autocast region for the inputs' device, the inputs are cast to its dtype
        as SDPA casts them, and ``out`` comes out in it.

    Example:
        >>> out = tilegen.attention(q, k, v, causal=True)  # doctest: +SKIP
    """
    if autocasting():  # as SDPA: the region's dtype, before anything reads q, k and v
        q, k, v = autocast_inputs(q, k, v)
    try:
        trains = (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()
    except AttributeError:  # not tensors: the checks say which
        trains = False
    if _fwad._current_level >= 0:  # a dual level is open: a tangent would be dropped silently on every route
        refuse_tangents("tilegen.attention", q=q, k=k, v=v)
    if score_mod is not None or mask_mod is not None:
        return _with_mods(q, k, v, causal, window, softcap, scale, return_lse, out, deterministic, score_mod, mask_mod)
    if trains:
        return _differentiable(q, k, v, causal, window, softcap, scale, return_lse, out, deterministic)
    if type(deterministic) is not bool:
        raise TypeError(f"deterministic: expected a bool, got {deterministic!r}")
    # Under vmap or a FakeTensorMode the tensors have no storage to launch on: the custom op, as under compile.
    if off_eager():
        spec, left, right, scale, softcap = prepare_call(q, k, v, causal, window, softcap, scale, return_lse)
        # The spec travels as plain fields: Dynamo traces these, not JSON encoding.
        result, lse = torch.ops.tilegen.attention_fwd(
            q, k, v, spec.dv, spec.mask, spec.softcap, spec.return_lse, scale, softcap, left, right
        )
        return _compiled_result(result, lse, out, q, return_lse)

    # The hot path. A call whose shapes, dtypes, devices and arguments match an earlier
    # valid call reuses that call's checked plan: one tuple, one dictionary lookup, the
    # output allocation and the launch. The argument types are part of the key so that
    # True never passes where 1 was checked (True == 1 in Python).
    try:
        key = (
            q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            causal.__class__, causal, softcap.__class__, softcap, scale.__class__, scale, return_lse.__class__,
            return_lse,
            window if window is None else (window.__class__, *map(type, window), *window),
        )
        plan = _plans.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: the checks say which
        key = plan = None
    if plan is None:
        plan = _plan(q, k, v, causal, window, softcap, scale, return_lse)
        if key is not None:
            _plans.put(key, plan)
    if out is None:
        # On the H200's host, empty_like(q) costs 1.6 us, new_empty 2.4 us with a tuple and 5.1 us
        # with a torch.Size: the allocation is a large part of a short call's host time.
        out = torch.empty_like(q) if plan.out_like_q else q.new_empty(plan.out_shape)
    else:
        if out.__class__ is not torch.Tensor or out.shape != plan.out_shape or out.dtype != q.dtype or (
            out.device != q.device
        ):
            _check_out(out, plan.out_shape, q)  # raises naming what differs; a tensor subclass passes
        # A program reads only its own query rows, before it writes their output: out may be q itself.
        check_out("out", out, {"q": q, "k": k, "v": v}, may_be=("q",))
        if out.requires_grad and torch.is_grad_enabled():
            refuse_grad("tilegen.attention", missing=NO_BACKWARD, out=out)
    # empty_like of the plan's storage-free template: about half new_empty's host time with a shape and dtype.
    lse = torch.empty_like(plan.lse_like) if plan.lse_like is not None else None
    if plan.launches:
        # The plan fixes every shape, dtype and scalar the launcher reads; the strides complete the key
        # under which its launches are replayed (tilegen.triton_internals.launch.Replay). lse, when made here, is contiguous.
        plan.launch((q.stride(), k.stride(), v.stride(), out.stride()), q, k, v, out, out if lse is None else lse)
    return (out, lse) if return_lse else out


def _compiled_mods():
    """``tilegen.mods.compiled``, imported by the first call under ``torch.compile``: its decorators import Dynamo
    (1.5 s on a 2-core CPU, 3 to 5 s on the H200's host), which a process that never compiles need not pay."""
    from tilegen.mods import compiled

    return compiled


def _with_mods(q, k, v, causal, window, softcap, scale, return_lse, out, deterministic, score_mod, mask_mod):
    """A call with mods: always the dense kernel (never the decode route; a score mod may run in the Gluon kernels,
    a mask mod only in the Triton one), its config from the mod spec's own table, the mods' tensors passed at every
    launch, and a mask mod's block table for that config's blocks (tilegen.mods.blocks, cached). Differentiated (Q,
    K, V or a captured tensor requires grad) through ``attention_grad.apply_with_mods``. A mod that means a built-in
    option (``tilegen.mods.builtin``: a band mask, a softcap) becomes that option first, so the call takes the
    built-in's kernels (and routes, and rows). Under ``torch.compile``, the ``tilegen::attention_mods_fwd`` op
    (``_compiled_with_mods``)."""
    given = scale, softcap
    spec, left, right, scale, softcap = prepare_call(q, k, v, causal, window, softcap, scale, return_lse)
    # Under torch.compile the mods are read at trace time (tilegen.mods.compiled), their tensors being graph inputs.
    found = _compiled_mods().entries(score_mod, mask_mod) if torch.compiler.is_compiling() else None
    if found is None and transformed():  # the mods' op is made at trace time: none to run outside torch.compile
        raise NotImplementedError("tilegen.attention: score_mod/mask_mod under a torch.func transform (vmap, grad) "
                                  "or a FakeTensorMode are not supported; call it outside, or under torch.compile")
    absorbed = absorb(score_mod, mask_mod, causal, window, given[1], k.shape[2] - q.shape[2],
                      known=None if found is None else tuple(e and e.builtin for e in found))
    if absorbed[3:] != (score_mod, mask_mod):
        causal, window, softcap, score_mod, mask_mod = absorbed
        return attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=given[0], return_lse=return_lse,
                         out=out, deterministic=deterministic, score_mod=score_mod, mask_mod=mask_mod)
    batch, heads, n_q, _ = q.shape
    check_grid("q", batch * heads, "(batch, head) pairs with mods")  # mods launch directly, without the slices
    n_k = k.shape[2]
    ranges = _mod_ranges(q, k, left, right)
    if found is not None:
        mods = bind_traced(_compiled_mods().bind(score_mod, mask_mod, found), q.device, ranges)
        return _compiled_with_mods(q, k, v, spec, mods, left, right, scale, softcap, return_lse, out, deterministic)
    mods, spec, trains = _eager_mods(spec, q, k, v, score_mod, mask_mod, ranges)
    launch = {"scale": scale, "softcap": softcap, "window_left": left, "window_right": right}
    if trains:
        attention_grad.check_training_args(out, deterministic)
        bwd, deterministic = attention_grad.mod_backward_spec(spec, "dense", mods, deterministic)

        def backward(dout, dlse, q, k, v, out, lse, wants):
            return attention_grad.run_with_mods(bwd, mods, wants, dout, q, k, v, out, lse, dlse, None, None, n_q, n_k,
                                                launch, deterministic)

        out, lse = attention_grad.apply_with_mods(
            "tilegen.attention", lambda q, k, v: _launch_with_mods(spec, mods, q, k, v, None, launch), backward, q, k,
            v, mods.tensors)
    else:
        check_bool("deterministic", deterministic)
        out, lse = _launch_with_mods(spec, mods, q, k, v, out, launch)
    return (out, lse) if return_lse else out


def _mod_ranges(q, k, left, right) -> CallRanges:
    """What a mod's indices range over in a dense call: batch, heads, positions and the mask's band."""
    n_q, n_k = q.shape[2], k.shape[2]
    return CallRanges(q.shape[0], q.shape[1], n_q, n_k, mask_band(left, right, n_k - n_q))


def _eager_mods(spec, q, k, v, score_mod, mask_mod, ranges):
    """``(mods, spec, trains)`` of an eager call with mods: the mods bound (indices checked against ``ranges``), the
    mod spec it runs (with the LSE when it trains: the backward reads it), and whether it trains."""
    mods = bind_mods(score_mod, mask_mod, q.device, ranges)
    spec = with_mod_fields(spec, mods.score_mod, mods.mask_mod)
    trains = wants_grad(q, k, v, mods.tensors)
    return mods, spec.replace(return_lse=True) if trains else spec, trains


def _mod_choice(spec, q, k) -> dispatch.Choice:
    """The config a call with mods runs: the mod spec's own table, by the longer of its query and key lengths."""
    return dispatch.table_on(spec, q.device).choose(max(q.shape[2], k.shape[2]))


def _compiled_with_mods(q, k, v, spec, mods, left, right, scale, softcap, return_lse, out, deterministic):
    """A call with mods under ``torch.compile``: the ``tilegen::attention_mods_fwd`` custom op, which launches as an
    eager call does, differentiable through ``tilegen::attention_mods_bwd`` (``attention_grad.attach_mods``)."""
    trains, deterministic = attention_grad.check_compiled_mods(q, k, v, mods, out, deterministic)
    score_count = len(mods.tensors) - len(mods.mask_tensors)
    result, lse = torch.ops.tilegen.attention_mods_fwd(
        q, k, v, list(mods.tensors), score_count, mods.score_mod, mods.mask_mod, spec.dv, spec.mask, spec.softcap,
        spec.return_lse or trains, scale, softcap, left, right, deterministic)
    return _compiled_result(result, lse, out, q, return_lse)


def _compiled_result(result, lse, out, q, return_lse):
    """A compiled call's return: a custom op allocates its own output, so one given as ``out`` gets a copy. Traced
    code cannot read storage addresses: an ``out`` sharing memory with k or v is not refused here, as it is in
    eager calls, and is written after the op has read them."""
    if out is not None:
        _check_out(out, result.shape, q)
        check_distinct("out", out)
        result = out.copy_(result)
    return (result, lse) if return_lse else result


def _launch_with_mods(spec, mods, q, k, v, out, launch):
    """``(out, lse)`` of the forward with mods (``lse`` None unless the spec returns it)."""
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    out_shape = (batch, heads, n_q, spec.dv)
    if out is None:  # laid out as a call without mods lays it out
        out = torch.empty_like(q) if out_shape == tuple(q.shape) else q.new_empty(out_shape)
    else:
        _check_out(out, out_shape, q)
        check_out("out", out, {"q": q, "k": k, "v": v}, may_be=("q",))
        if out.requires_grad and torch.is_grad_enabled():
            refuse_grad("tilegen.attention", missing=NO_BACKWARD, out=out)
    lse = q.new_empty((batch, heads, n_q), dtype=torch.float32) if spec.return_lse else None
    if math.prod(out_shape) > 0:
        config = _mod_choice(spec, q, k).config
        blocks = {}
        if mods.mask_mod is not None:
            blocks["mod_blocks"] = block_table(mods.mask_mod, mods.mask_tensors, batch, heads, n_q, n_k,
                                               config.block_m, config.block_n, q.device)
        launcher_for(spec).jit(q, k, v, out, out if lse is None else lse, **launch, mod_tensors=mods.tensors,
                               **blocks, **config.to_dict())
    elif lse is not None:
        lse.fill_(-math.inf)
    return out, lse


def attention_seq_major(q, k, v, *, causal=False, window=None, softcap=None, scale=None) -> torch.Tensor:
    """``attention(q, k, v, ...)`` with its output laid out ``[batch, n_q, heads, head_dim_v]``, contiguous: the
    layout transformers' attention functions return, and FlashAttention's. The kernel writes that layout
    directly (its launch takes the output through a transposing view, ``Replay``'s ``views``), where transposing
    the op's output would cost a dispatcher call, about a microsecond of host time a call. Under autograd or
    ``torch.compile`` it is the op's output transposed (and made contiguous where it is not). In an autocast region
    the inputs are cast as ``attention`` casts them."""
    if autocasting():  # as attention and varlen_attention_padded: before the plan's key reads the dtypes
        q, k, v = autocast_inputs(q, k, v)
    try:
        plain = not ((q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled())
        key = (
            q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            causal.__class__, causal, softcap.__class__, softcap, scale.__class__, scale,
            window if window is None else (window.__class__, *map(type, window), *window),
        )
        planned = _seq_major_plans.get(key) if plain else None
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: the op's checks say which
        plain, key, planned = False, None, None
    if not plain or torch.compiler.is_compiling():
        out = attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale).transpose(1, 2)
        return out if out.is_contiguous() else out.contiguous()
    if planned is None:
        plan = _plan(q, k, v, causal, window, softcap, scale, False, out_view=_heads_first)
        batch, heads, n_q, dv = plan.out_shape
        planned = plan, empty_like_template((batch, n_q, heads, dv), q.dtype, q.device)
        _seq_major_plans.put(key, planned)
    plan, out_like = planned
    out = torch.empty_like(out_like)
    if plan.launches:
        plan.launch((q.stride(), k.stride(), v.stride(), out.stride()), q, k, v, out, out)
    return out


def _heads_first(out: torch.Tensor) -> torch.Tensor:
    """The launcher's ``[batch, heads, n, dim]`` view of a ``[batch, n, heads, dim]`` output (same data pointer)."""
    return out.transpose(1, 2)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything a checked call decided: its output shapes and launch arguments."""

    out_shape: tuple[int, int, int, int]
    lse_shape: tuple[int, int, int] | None
    launches: bool  # False when the output is empty: nothing to compute
    # launch(key, q, k, v, out, lse): a Replay of the launcher with launch_args (dispatch.planned)
    launch: Callable[..., Any]
    launch_args: dict[str, Any]
    choice: dispatch.Choice | None = None
    out_like_q: bool = False  # the output has q's shape: allocated as empty_like(q), in q's memory layout
    # A contiguous fp32 LSE's shape on q's device, as one element expanded (no storage of its size); None: no LSE.
    lse_like: torch.Tensor | None = None


_plans = dispatch.plan_cache()
_seq_major_plans = dispatch.plan_cache()  # attention_seq_major's: (plan, output template)
_op_plans = dispatch.plan_cache()  # the compiled custom op's, keyed by its (already checked) arguments


def _plan(q, k, v, causal, window, softcap, scale, return_lse, out_view=None) -> _Plan:
    return _plan_for(q, k, v, *prepare_call(q, k, v, causal, window, softcap, scale, return_lse), out_view=out_view)


def _plan_for(q, k, v, spec: AttentionSpec, left, right, scale, softcap, out_view=None) -> _Plan:
    """The plan of checked arguments: eager calls and the compiled custom op both launch through it.
    ``out_view``: the launch takes its caller's output through this view (``attention_seq_major``)."""
    batch, heads, n_q, _ = q.shape
    out_shape = (batch, heads, n_q, spec.dv)
    views = {} if out_view is None else {3: out_view}
    # The route first: a decode-sized call never loads the dense table nor renders the dense module.
    decode = n_q <= MAX_Q_TOKENS and k.shape[2] > 0 and math.prod(out_shape) > 0 and spec.q_per_kv * n_q <= 64
    # The launch grid's second axis has a program per (batch, head), per batch row on the decode route, where CUDA
    # takes at most MAX_GRID_YZ: past it, slices of the batch are launched one after another.
    if (batch if decode else batch * heads) > MAX_GRID_YZ and math.prod(out_shape) > 0:
        return _sliced_plan(q, k, v, spec, out_shape, left, right, scale, softcap, out_view)
    if decode:
        return _decode_plan(q, k, spec, out_shape, left, right, scale, softcap, views)
    lse_shape = (batch, heads, n_q) if spec.return_lse else None
    launches = math.prod(out_shape) > 0
    out_like_q = out_shape == tuple(q.shape)
    fixed = {"scale": scale, "softcap": softcap, "window_left": left, "window_right": right}
    launcher = launcher_for(spec)

    def make(choice: dispatch.Choice) -> _Plan:
        launch_args = {**fixed, **choice.config.to_dict()}
        return _Plan(out_shape=out_shape, lse_shape=lse_shape, launches=launches, out_like_q=out_like_q,
                     lse_like=_lse_like(lse_shape, q.device),
                     launch=launcher.replay(launch_args, views=views), launch_args=launch_args, choice=choice)

    return dispatch.planned(dispatch.table_on(spec, q.device), max(n_q, k.shape[2]), make)


def _sliced_plan(q, k, v, spec: AttentionSpec, out_shape, left, right, scale, softcap, out_view) -> _Plan:
    """A batch past the launch grid's bound, planned as slices of ``MAX_GRID_YZ // heads`` batch rows (and the
    rest), each slice a plan of its own (the batch is the first dimension of every layout ``out_view`` reads)."""
    batch, heads = q.shape[:2]
    step = MAX_GRID_YZ // heads
    if step == 0:
        raise ValueError(f"q: {heads} query heads exceed the {MAX_GRID_YZ} one launch takes")
    parts = {n: _plan_for(q[:n], k[:n], v[:n], spec, left, right, scale, softcap, out_view)
             for n in (step, batch % step) if n}

    def launch(key, q, k, v, out, lse):
        for start in range(0, batch, step):
            rows = slice(start, start + step)
            q_, k_, v_, out_ = q[rows], k[rows], v[rows], out[rows]
            parts[q_.shape[0]].launch((q_.stride(), k_.stride(), v_.stride(), out_.stride()), q_, k_, v_, out_,
                                      out_ if lse is out else lse[rows])

    lse_shape = (batch, heads, q.shape[2]) if spec.return_lse else None
    return _Plan(out_shape=out_shape, lse_shape=lse_shape, launches=True, launch=launch,
                 launch_args=parts[step].launch_args, choice=parts[step].choice,
                 out_like_q=out_shape == tuple(q.shape), lse_like=_lse_like(lse_shape, q.device))


def _lse_like(shape, device) -> torch.Tensor | None:
    return None if shape is None else empty_like_template(shape, torch.float32, device)


def _decode_plan(q, k, spec: AttentionSpec, out_shape, left, right, scale, softcap, views) -> _Plan:
    """A few query rows (decode, speculative decoding): the decode family's kernel, whose
    query-head groups and key splits fill the GPU where the prefill kernel would run one
    mostly empty query tile per head."""
    decode_spec = DecodeSpec(head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, q_per_kv=spec.q_per_kv,
                             mask=spec.mask, softcap=spec.softcap, dtype=spec.dtype, kv_layout="dense",
                             return_lse=spec.return_lse, q_tokens=q.shape[2])
    info = device_info(_device_index(q.device))
    batch, kv_heads, n_k = q.shape[0], k.shape[1], k.shape[2]
    rows = q.shape[1] * q.shape[2]
    lse_shape = tuple(q.shape[:3]) if spec.return_lse else None
    out_like_q = out_shape == tuple(q.shape)
    device, dv = q.device, spec.dv
    launcher = launcher_for(decode_spec)

    def make(choice: dispatch.Choice) -> _Plan:
        config = choice.config
        splits = split_count(config, info, batch, kv_heads, n_k)
        launch_args = {"chunk": math.ceil(n_k / splits / config.block_n) * config.block_n, "num_splits": splits,
                       "scale": scale, "softcap": softcap, "window_left": left, "window_right": right,
                       "block_n": config.block_n, "num_warps": config.num_warps, "num_stages": config.num_stages}
        replay = launcher.replay(launch_args, views=views)
        if splits == 1:  # no partials to write: the empty placeholders serve every call
            unused = decode_buffers(batch, rows, dv, 1, device)

            def launch(key, q, k, v, out, lse):
                replay(key, q, k, v, out, lse, *unused)
        else:
            def launch(key, q, k, v, out, lse):
                # Split partials per call, not per plan: two streams may run one plan at once. Their shapes are
                # the plan's and they are contiguous, so the key holds for them too.
                replay(key, q, k, v, out, lse, *decode_buffers(q.shape[0], rows, dv, splits, q.device))

        return _Plan(out_shape=out_shape, lse_shape=lse_shape, launches=True, launch=launch, choice=choice,
                     lse_like=_lse_like(lse_shape, q.device),
                     launch_args=launch_args, out_like_q=out_like_q)

    return dispatch.planned(dispatch.table_for(decode_spec, info), (n_k, batch), make)


def _check_out(out, shape, q) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != q.dtype:
        raise TypeError(f"out: expected dtype {q.dtype} (the inputs'), got {out.dtype}")
    if out.device != q.device:
        raise ValueError(f"out: on {out.device} while the inputs are on {q.device}")


def explain(q, k, v, *, causal=False, window=None, softcap=None, scale=None, return_lse=False,
            backward=False, deterministic=False, score_mod=None, mask_mod=None) -> dispatch.Choice:
    """Which config a call with these arguments runs, and where it comes from (tuned row or default);
    ``backward=True``: the config its backward runs (with ``deterministic=True`` or under
    ``torch.use_deterministic_algorithms(True)``, a dQ kernel of its own in place of a row's atomics, as such a
    call runs it). A call that trains (an input requires grad, grad mode on)
    runs the forward that also writes the LSE its backward reads: that variant's config is the one shown.
    With mods, the mod spec's (or, for a mod that is a built-in option, the built-in's). In an autocast region, the
    spec of the inputs cast as the call casts them."""
    if autocasting():
        q, k, v = autocast_inputs(q, k, v)
    check_bool("backward", backward)
    check_bool("deterministic", deterministic)
    check_bool("return_lse", return_lse)
    try:
        return_lse = return_lse or ((q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled())
    except AttributeError:  # not tensors: the checks say which
        pass
    if score_mod is not None or mask_mod is not None:
        return _explain_mods(q, k, v, causal, window, softcap, scale, return_lse, backward, deterministic, score_mod,
                             mask_mod)
    if backward:
        spec = prepare_call(q, k, v, causal, window, softcap, scale, return_lse)[0]
        bwd = attention_grad.backward_spec(q.dtype, spec.head_dim, spec.dv, spec.q_per_kv, spec.mask, spec.softcap,
                                           "dense")
        return attention_grad.explain_backward(bwd, q.device, max(q.shape[2], k.shape[2]),
                                               deterministic or torch.are_deterministic_algorithms_enabled())
    return _plan(q, k, v, causal, window, softcap, scale, return_lse).choice


def _explain_mods(q, k, v, causal, window, softcap, scale, return_lse, backward, deterministic, score_mod, mask_mod):
    """``explain`` of a call with mods, choosing as ``_with_mods`` and ``_launch_with_mods`` do."""
    given = scale, softcap
    spec, left, right, scale, softcap = prepare_call(q, k, v, causal, window, softcap, scale, return_lse)
    absorbed = absorb(score_mod, mask_mod, causal, window, given[1], k.shape[2] - q.shape[2])
    if absorbed[3:] != (score_mod, mask_mod):
        causal, window, softcap, score_mod, mask_mod = absorbed
        return explain(q, k, v, causal=causal, window=window, softcap=softcap, scale=given[0], return_lse=return_lse,
                       backward=backward, deterministic=deterministic, score_mod=score_mod, mask_mod=mask_mod)
    mods, spec, _ = _eager_mods(spec, q, k, v, score_mod, mask_mod, _mod_ranges(q, k, left, right))
    if backward:
        bwd, deterministic = attention_grad.mod_backward_spec(spec.replace(return_lse=True), "dense", mods,
                                                              deterministic)
        return attention_grad.explain_backward(bwd, q.device, max(q.shape[2], k.shape[2]), deterministic)
    return _mod_choice(spec, q, k)


def _differentiable(q, k, v, causal, window, softcap, scale, return_lse, out, deterministic):
    """A call that trains: through the custom op, whose autograd runs the backward; every argument is
    checked before the forward runs."""
    attention_grad.check_training_args(out, deterministic)
    # As SDPA's flash backward, which reads it: under torch.use_deterministic_algorithms(True), no atomics.
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    check_bool("return_lse", return_lse)  # the forward below always makes the LSE, for the backward
    spec, left, right, scale, softcap = prepare_call(q, k, v, causal, window, softcap, scale, True)
    check_grid("q", q.shape[0] * q.shape[1], "(batch, head) pairs of the backward")
    attention_grad.backward_spec(q.dtype, spec.head_dim, spec.dv, spec.q_per_kv, spec.mask, spec.softcap, "dense")
    result, lse = torch.ops.tilegen.attention_fwd(
        q, k, v, spec.dv, spec.mask, spec.softcap, True, scale, softcap, left, right, deterministic)
    return (result, lse) if return_lse else result


def run_with_config(spec, config, q, k, v, scale, softcap, left, right, out=None, launch=None):
    """Launch the generated kernel for ``spec`` with an explicit config (the tests' entry point), with no
    table and so no fallback: the config is the caller's. It calls the module's own ``launch``
    (``launch`` replaces it), which reads the module's globals as they are now: tests patch them
    (``TMA_MIN_WORK``, say), where a ``Launcher`` launching directly keeps the values it was made with.

    The arguments after ``v`` are ``prepare_call``'s launch values; ``out`` may be a
    preallocated (poisoned) output. Returns ``(out, lse)``, ``lse`` being ``None`` when the
    spec does not return it.
    """
    batch, heads, n_q, _ = q.shape
    if out is None:
        out = q.new_empty(batch, heads, n_q, v.shape[3])
    # No LSE buffer unless asked for: an allocation is microseconds on the hot path.
    lse = q.new_empty((batch, heads, n_q), dtype=torch.float32) if spec.return_lse else None
    if out.numel() == 0:
        return out, lse
    (launch or module_for(spec).launch)(
        q, k, v, out, out if lse is None else lse,
        scale=scale, softcap=softcap, window_left=left, window_right=right, **config.to_dict(),
    )
    return out, lse


def _device_index(device: torch.device) -> int | None:
    return device.index if device.type == "cuda" else None


@torch.library.custom_op("tilegen::attention_fwd", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim_v: int, mask: str, has_softcap: bool,
    return_lse: bool, scale: float, softcap: float, window_left: int, window_right: int, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic is the backward's (the forward has no atomics): autograd's context reads it here.
    spec = _spec_for(q.dtype, q.shape[3], head_dim_v, q.shape[1] // k.shape[1], mask, has_softcap, return_lse)
    # The eager path's plans, so a compiled graph runs the same kernels (short queries: the decode family's).
    key = (q.shape, k.shape, v.shape, q.device, spec, window_left, window_right, scale, softcap)
    plan = _op_plans.get(key)
    if plan is None:
        plan = _plan_for(q, k, v, spec, window_left, window_right, scale, softcap)
        _op_plans.put(key, plan)
    # Laid out as an eager call's (and the fake's): empty_like(q) when it has q's shape, so code that views the
    # result by q's layout works in training and compiled as it does in eager inference.
    out = torch.empty_like(q) if plan.out_like_q else q.new_empty(plan.out_shape)
    # A custom op returns tensors only: an empty one stands for "no LSE".
    lse = q.new_empty(plan.lse_shape if plan.lse_shape is not None else (0,), dtype=torch.float32)
    if plan.launches:
        plan.launch((q.stride(), k.stride(), v.stride(), out.stride()), q, k, v, out,
                    out if plan.lse_shape is None else lse)
    return out, lse


@_attention_op.register_fake
def _(q, k, v, head_dim_v, mask, has_softcap, return_lse, scale, softcap, window_left, window_right,
      deterministic=False):
    batch, heads, n_q, dim = q.shape
    # As the op lays it out: q's layout when it has q's shape.
    out = torch.empty_like(q) if head_dim_v == dim else q.new_empty(batch, heads, n_q, head_dim_v)
    return out, q.new_empty((batch, heads, n_q) if return_lse else (0,), dtype=torch.float32)


attention_grad.attach_dense(_attention_op)


@torch.library.custom_op("tilegen::attention_mods_fwd", mutates_args=())
def _attention_mods_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod_tensors: list[torch.Tensor], score_tensors: int,
    score_mod: str | None, mask_mod: str | None, head_dim_v: int, mask: str, has_softcap: bool, return_lse: bool,
    scale: float, softcap: float, window_left: int, window_right: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # mod_tensors: the score mod's captured tensors (the first score_tensors), then the mask mod's. deterministic is
    # the backward's, read by autograd's context; it has no default, which the dispatcher would drop from the
    # arguments, and the backward's gradients of a Tensor[] op must match the arguments as passed.
    spec = with_mod_fields(_spec_for(q.dtype, q.shape[3], head_dim_v, q.shape[1] // k.shape[1], mask, has_softcap,
                                     return_lse), score_mod, mask_mod)
    mods = ModCall(score_mod, mask_mod, tuple(mod_tensors), tuple(mod_tensors[score_tensors:]))
    launch = {"scale": scale, "softcap": softcap, "window_left": window_left, "window_right": window_right}
    out, lse = _launch_with_mods(spec, mods, q, k, v, None, launch)
    # A custom op returns tensors only: an empty one stands for "no LSE".
    return out, lse if lse is not None else q.new_empty((0,), dtype=torch.float32)


@_attention_mods_op.register_fake
def _(q, k, v, mod_tensors, score_tensors, score_mod, mask_mod, head_dim_v, mask, has_softcap, return_lse, scale,
      softcap, window_left, window_right, deterministic):
    batch, heads, n_q, dim = q.shape
    out = torch.empty_like(q) if head_dim_v == dim else q.new_empty(batch, heads, n_q, head_dim_v)  # as the op's
    return out, q.new_empty((batch, heads, n_q) if return_lse else (0,), dtype=torch.float32)


attention_grad.attach_mods(_attention_mods_op)


def prepare_call(q, k, v, causal, window, softcap, scale, return_lse):
    """Check every argument; return ``(spec, window_left, window_right, scale, softcap)`` for the launcher."""
    # One compound test for the common case; only a failing call pays for the
    # step-by-step checks that name the offending argument.
    try:
        batch, heads_q, n_q, dim = q.shape
        batch_k, heads_kv, n_k, dim_k = k.shape
        batch_v, heads_v, n_v, dim_v = v.shape
        dtype, device = q.dtype, q.device
        ok = (
            batch_k == batch == batch_v and dim_k == dim and heads_v == heads_kv and n_v == n_k
            and heads_kv > 0 and heads_q > 0 and heads_q % heads_kv == 0 and n_q < _MAX_SEQLEN and n_k < _MAX_SEQLEN
            and dtype in SPEC_DTYPES and k.dtype == dtype and v.dtype == dtype
            and (device.type == "cuda" or (device.type == "cpu" and interpreting()))
            and k.device == device and v.device == device
        )
    except (AttributeError, TypeError, ValueError):
        ok = False
    if not ok:
        _check_tensors(q, k, v)
        batch, heads_q, n_q, dim = q.shape
        heads_kv, n_k = k.shape[1], k.shape[2]
        dim_v, dtype = v.shape[3], q.dtype

    scale_value, softcap_value = score_scalars(scale, softcap, dim)
    left, right = window_bounds(window, causal)
    check_bool("return_lse", return_lse)
    mask = mask_kind(left, right)
    spec = _spec_for(dtype, dim, dim_v, heads_q // heads_kv, mask, softcap is not None, return_lse)
    return (spec, *launch_window(mask, left, right, n_q, n_k), scale_value, softcap_value)


@memoized
def _spec_for(dtype, dim, dim_v, q_per_kv, mask, softcap, return_lse) -> AttentionSpec:
    # Memoized: building and validating a spec costs microseconds every call would pay.
    try:
        return AttentionSpec(
            head_dim=dim,
            head_dim_v=None if dim_v == dim else dim_v,
            q_per_kv=q_per_kv,
            mask=mask,
            softcap=softcap,
            dtype=SPEC_DTYPES[dtype],
            return_lse=return_lse,
        )
    except SpecError as e:
        arg = {"head_dim": "q", "head_dim_v": "v"}.get(e.field, e.field)
        raise ValueError(f"{arg}: {e}") from None


def _check_tensors(q, k, v) -> None:
    """The checks one by one, raising with the argument's name at the first that fails."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if q.dtype not in SPEC_DTYPES:
        raise TypeError(f"q: expected dtype float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device} while q is on {q.device}; all inputs must share a device")
    if q.device.type == "cpu" and not interpreting():
        raise ValueError(
            "q: tensors are on the CPU; tilegen kernels run on CUDA, or on the CPU under Triton's interpreter: "
            "set TRITON_INTERPRET=1 before the first import of tilegen or triton"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: device {q.device} is not supported; expected cuda")
    batch, heads_q, n_q, dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"k, v: batch sizes {k.shape[0]}, {v.shape[0]} differ from q's {batch}")
    if k.shape[3] != dim:
        raise ValueError(f"k: head_dim {k.shape[3]} differs from q's {dim}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        raise ValueError(f"v: heads and seq {tuple(v.shape[1:3])} differ from k's {tuple(k.shape[1:3])}")
    heads_kv = k.shape[1]
    if heads_q == 0 and heads_kv:
        raise ValueError(f"q: no query head; expected a positive multiple of k's {heads_kv} KV heads")
    if heads_kv == 0:
        raise ValueError(f"k: no KV head (shape {tuple(k.shape)}); expected at least one")
    if heads_q % heads_kv:
        raise ValueError(f"q: {heads_q} query heads is not a multiple of k's {heads_kv} KV heads")
    n_k = k.shape[2]
    if max(n_q, n_k) >= _MAX_SEQLEN:
        raise ValueError(f"q, k: sequence lengths {n_q}, {n_k} exceed the supported {_MAX_SEQLEN - 1}")
