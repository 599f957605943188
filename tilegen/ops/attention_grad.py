"""Training: the backward of ``tilegen.attention`` and ``tilegen.varlen_attention``.

Each forward is a ``torch.library`` custom op, and ``register_autograd`` attaches a backward op
from here to it (``attach_dense``, ``attach_ragged``), so eager autograd,
``torch.compile(fullgraph=True)`` and ``torch.library.opcheck`` see one op pair. A forward
that trains saves Q, K, V, O and the fp32 LSE, nothing of size n_q x n_k. The backward ops,
``tilegen::attention_bwd`` and ``tilegen::varlen_attention_bwd``, plan and launch as every op
does (``tilegen.dispatch.planned``) with the ``attention_bwd`` family's own tuned rows;
``deterministic=True`` takes the row's config without atomics. A second derivative raises
``NotImplementedError`` naming the op.

Eager calls with score or mask mods (``tilegen.mods``) differentiate through a ``torch.autograd.Function``
(``apply_with_mods``) instead; their captured tensors are inputs of the graph too, so a learned bias table or
ALiBi slopes get gradients. The backward spec holds the mods, and its kernels recompute the scores through them
(``tilegen.mods.grad``). Under ``torch.compile`` such calls are the mods' custom ops
(``tilegen::attention_mods_fwd``, ``tilegen::varlen_attention_mods_fwd``), made differentiable here
(``attach_mods``, ``attach_ragged_mods``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tilegen import dispatch
from tilegen.dispatch import launcher_for
from tilegen.dtypes import SPEC_DTYPES, TORCH_DTYPES
from tilegen.families.attention_bwd import AttentionBwdSpec
from tilegen.families.attention_bwd.config import deterministic as deterministic_config
from tilegen.mods.blocks import backward_tables
from tilegen.mods.grad import ATOMICS, check_differentiable, grad_tensors, warned_of_atomics
from tilegen.mods.trace import ModCall, wants_grad
from tilegen.ops.memo import memoized, with_mod_fields
from tilegen.ops.tensors import check_bool

__all__ = ["attach_dense", "attach_ragged", "attach_ragged_mods", "apply_with_mods", "backward_spec",
           "check_compiled_mods", "check_training_args", "explain_backward", "mod_backward_spec", "run_with_mods"]


@memoized
def backward_spec(dtype: torch.dtype, head_dim: int, head_dim_v: int, q_per_kv: int, mask: str, softcap: bool,
                  layout: str) -> AttentionBwdSpec:
    return AttentionBwdSpec(head_dim=head_dim, head_dim_v=None if head_dim_v == head_dim else head_dim_v,
                            q_per_kv=q_per_kv, mask=mask, softcap=softcap, dtype=SPEC_DTYPES[dtype], layout=layout)


def mod_backward_spec(spec, layout: str, mods: ModCall, deterministic: bool) -> tuple[AttentionBwdSpec, bool]:
    """The backward of a forward spec with mods, and whether it runs without atomics (``deterministic_with_mods``);
    a ``ModGradError`` names an operation of the score mod whose derivative cannot be formed (with respect to the
    score, or to a captured tensor that requires grad), before anything runs."""
    check_differentiable(spec.score_mod, _wanted(mods))
    deterministic = deterministic_with_mods(mods, deterministic)
    bwd = backward_spec(TORCH_DTYPES[spec.dtype], spec.head_dim, spec.dv, spec.q_per_kv, spec.mask, spec.softcap,
                        layout)
    return with_mod_fields(bwd, spec.score_mod, spec.mask_mod), deterministic


def check_compiled_mods(q, k, v, mods, out, deterministic) -> tuple[bool, bool]:
    """A compiled call with mods (``tilegen.mods.compiled``): whether it trains, and the backward's
    ``deterministic`` (``deterministic_with_mods``); its training arguments checked and its score mod's derivative
    formed at trace time when it trains, ``deterministic`` checked when it does not."""
    trains = wants_grad(q, k, v, mods.tensors)
    if trains:
        check_training_args(out, deterministic)
        from tilegen.mods import compiled  # imports Dynamo: only a compiled call gets here

        compiled.check_differentiable(mods.score_mod, _wanted(mods))
        return True, deterministic_with_mods(mods, deterministic, compiled.warned_of_atomics)
    check_bool("deterministic", deterministic)
    return False, deterministic


def deterministic_with_mods(mods: ModCall, deterministic: bool, warned_of_atomics=warned_of_atomics) -> bool:
    """Whether the backward of a call with mods runs without atomics: when asked, or under
    ``torch.use_deterministic_algorithms(True)`` as a call without mods does. A captured tensor that requires grad
    gets its gradient from atomic adds: refused when asked for by the argument, and under the global switch refused
    as torch refuses its own nondeterministic ops (a warning under ``warn_only=True``, the backward then as fast as
    it comes)."""
    _check_deterministic(mods, deterministic)
    if deterministic or not torch.are_deterministic_algorithms_enabled():
        return deterministic
    if not _wanted(mods):
        return True
    if not warned_of_atomics():
        raise RuntimeError(f"tilegen: {ATOMICS} forbids; freeze the captured tensors (requires_grad=False) or call "
                           "torch.use_deterministic_algorithms(True, warn_only=True)")
    return False


def _check_deterministic(mods: ModCall, deterministic: bool) -> None:
    """``deterministic=True`` promises the same bits on every run; a captured tensor's gradient is a sum of atomic
    adds in whatever order the programs run, so that promise cannot be kept for it."""
    if deterministic and _wanted(mods):
        raise NotImplementedError("deterministic: the gradients of a score mod's captured tensors are accumulated "
                                  "with atomic adds, in no fixed order; deterministic=True covers q, k and v only. "
                                  "Pass deterministic=False, or freeze the captured tensors (requires_grad=False)")


def _wanted(mods: ModCall) -> tuple[int, ...]:
    """The score mod's captured tensors that require grad, by their index among its own."""
    return tuple(i for i, t in enumerate(mods.tensors[:len(mods.tensors) - len(mods.mask_tensors)]) if t.requires_grad)


def check_training_args(out, deterministic) -> None:
    """What a forward that will be differentiated must not take: raised before anything runs."""
    if out is not None:
        raise TypeError("out: an input requires grad, and a result written into `out` cannot be differentiated; "
                        "drop `out`, or call under torch.no_grad()")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {deterministic!r}")


@dataclass(frozen=True, slots=True)
class _Plan:
    """A backward call's checked decisions: its launch, which brings the fp32 dQ sum its config's atomics need."""

    launch: Callable[..., Any]
    choice: dispatch.Choice
    launch_args: dict[str, Any]


_plans = dispatch.plan_cache()


def _table(spec: AttentionBwdSpec, device: torch.device) -> dispatch.Table:
    # A ragged call without rows of its own takes the dense spec's where the ragged kernels run them (rows_from).
    return dispatch.table_on(spec, device)


def _plan(spec: AttentionBwdSpec, device: torch.device, size: int, fixed: dict[str, Any], deterministic: bool) -> _Plan:
    launcher = launcher_for(spec)
    table = _table(spec, device)

    def make(choice: dispatch.Choice) -> _Plan:
        config = deterministic_config(choice.config, table.spec, table.device) if deterministic else choice.config
        launch_args = {**fixed, **config.to_dict()}
        replay = launcher.replay(launch_args)
        atomic = bool(config.atomic_dq)

        # The sum is allocated here, per config: a failed tuned row's fallback relaunches with the call's arguments,
        # and a buffer chosen for the failed row (dQ itself, without atomics) would take the next row's atomics.
        def launch(key, q, k, v, out, dout, lse, dlse, dq, dk, dv, delta, lse2, cu_q, cu_k, max_q, max_k):
            acc = torch.empty(q.shape, dtype=torch.float32, device=q.device) if atomic else dq
            replay((*key, acc.stride()), q, k, v, out, dout, lse, dlse, dq, dk, dv, delta, lse2, acc, cu_q, cu_k,
                   max_q, max_k)

        return _Plan(launch=launch, choice=choice, launch_args=launch_args)

    return dispatch.planned(table, size, make)


def _stats_layout(lse: torch.Tensor, dlse: torch.Tensor | None, ragged: bool):
    """``lse`` and ``dlse`` laid out as the kernels read them: with one stride set, which the scratch made with
    ``empty_like(lse)`` (Delta and the base-2 LSE) shares. Dense, contiguous ``[batch, heads, n]``. Ragged, head-major
    ``[heads, total]`` storage seen as ``[total, heads]``: a block's rows of one head are then adjacent, where
    token-major rows lie a head count apart, 64 scattered loads for a block (the ragged dK/dV kernel took 1.5x the
    dense one's time with them, an H100, d128 causal GQA 32/8, 4 x 4096; the new layout is not yet timed)."""
    if ragged:
        if lse.stride(0) != 1 or lse.stride(1) != max(lse.shape[0], 1):
            lse = lse.t().contiguous().t()
    elif not lse.is_contiguous():
        lse = lse.contiguous()
    if dlse is not None and dlse.stride() != lse.stride():
        dlse = dlse.t().contiguous().t() if ragged else dlse.contiguous()
    return lse, dlse


def _run(spec, dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, scale, softcap, left, right, deterministic):
    """``(dq, dk, dv)`` in the inputs' dtypes and memory layouts."""
    ragged = cu_q is not None
    # Ragged rows that no sequence owns (past the last offset) get no program: zeros, as their gradient is.
    new = torch.zeros_like if ragged else torch.empty_like
    dq, dk, dv = new(q), new(k), new(v)
    if q.numel() == 0 or k.numel() == 0 or max_q == 0 or max_k == 0:
        # No score anywhere: every gradient is zero (an output that sees no key is the constant 0).
        return dq.zero_(), dk.zero_(), dv.zero_()
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, spec, None if cu_q is None else cu_q.shape, max_q, max_k,
           scale, softcap, left, right, deterministic)
    plan = _plans.get(key)
    if plan is None:
        fixed = {"scale": scale, "softcap": softcap, "window_left": left, "window_right": right}
        plan = _plan(spec, q.device, max(max_q, max_k), fixed, deterministic)
        _plans.put(key, plan)
    lse, dlse = _stats_layout(lse, dlse, ragged)
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    strides = tuple(None if t is None else t.stride() for t in (q, k, v, out, dout, lse, dlse, dq, dk, dv))
    plan.launch(strides, q, k, v, out, dout, lse, dlse, dq, dk, dv, delta, lse2, cu_q, cu_k, max_q, max_k)
    return dq, dk, dv


def run_with_mods(spec, mods: ModCall, wants, dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, fixed,
                  deterministic):
    """``(dq, dk, dv, grads)`` of a call with mods, ``grads`` per captured tensor (``mods.tensors``): its gradient
    in its dtype where ``wants`` says so and the score mod reads it as a float, else None. Launched through the
    JIT, as the forward with mods is: the captured tensors are arguments of every call."""
    ragged = cu_q is not None
    new = torch.zeros_like if ragged else torch.empty_like
    dq, dk, dv = new(q), new(k), new(v)
    # Zeroed: the dK/dV kernel adds into them, and a call with no score leaves them 0.
    sums = [torch.zeros(mods.tensors[i].shape, dtype=torch.float32, device=q.device) if wants[i] else None
            for i in grad_tensors(spec.score_mod)]
    if q.numel() == 0 or k.numel() == 0 or max_q == 0 or max_k == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
    else:
        table = _table(spec, q.device)
        config = table.choose(max(max_q, max_k)).config
        config = deterministic_config(config, table.spec, table.device) if deterministic else config
        lse, dlse = _stats_layout(lse, dlse, ragged)
        acc = torch.empty(q.shape, dtype=torch.float32, device=q.device) if config.atomic_dq else dq
        tables = {} if mods.mask_mod is None else backward_tables(
            mods.mask_mod, mods.mask_tensors, q.shape[0] if cu_q is None else cu_q.numel() - 1, q.shape[1], max_q,
            max_k, config, q.device)
        launcher_for(spec).jit(q, k, v, out, dout, lse, dlse, dq, dk, dv, torch.empty_like(lse),
                               torch.empty_like(lse), acc, cu_q, cu_k, max_q, max_k, **fixed, mod_tensors=mods.tensors,
                               mod_grads=sums, **tables, **config.to_dict())
    grads: list[torch.Tensor | None] = [None] * len(mods.tensors)
    for i, g in zip(grad_tensors(spec.score_mod), sums):
        if g is not None:
            grads[i] = g.to(mods.tensors[i].dtype)
    return dq, dk, dv, grads


class _WithMods(torch.autograd.Function):
    """Attention with mods as one autograd node over Q, K, V and the mods' captured tensors."""

    @staticmethod
    def forward(ctx, name, forward, backward, q, k, v, *tensors):
        out, lse = forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.backward_fn, ctx.name = backward, name
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        if dout is None and dlse is None:
            return (None,) * len(ctx.needs_input_grad)
        dout = torch.zeros_like(out) if dout is None else dout
        # Through a node of its own, so that with create_graph=True the gradients are outputs of a node whose
        # backward refuses by name (as the ops without mods do), not tensors without a grad_fn whose second
        # derivative would silently be taken as zero.
        grads = _ModGradients.apply(ctx.name, ctx.backward_fn, ctx.needs_input_grad[6:], dout, dlse, q, k, v, out, lse,
                                    *tensors)
        return None, None, None, *grads


class _ModGradients(torch.autograd.Function):
    """The gradients of a call with mods, as a node that has no derivative of its own."""

    @staticmethod
    def forward(ctx, name, backward, wants, dout, dlse, q, k, v, out, lse, *tensors):
        ctx.name = name
        dq, dk, dv, grads = backward(dout, dlse, q, k, v, out, lse, wants)
        return dq, dk, dv, *grads

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(f"{ctx.name}: the second derivative (double backward) of attention with mods is not "
                                  "implemented; differentiate once (create_graph=False)")


def apply_with_mods(name: str, forward, backward, q, k, v, tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward(q, k, v) -> (out, lse)`` as a differentiable node; ``backward(dout, dlse, q, k, v, out, lse,
    wants)`` returns ``(dq, dk, dv, grads)``, ``grads`` per captured tensor (``wants``: which require grad).
    ``name``: the op, as a refused second derivative names it."""
    return _WithMods.apply(name, forward, backward, q, k, v, *tensors)


def explain_backward(spec: AttentionBwdSpec, device: torch.device, size: int,
                     deterministic: bool = False) -> dispatch.Choice:
    """The backward's choice for a call of ``size`` (the longer sequence); ``deterministic``: with the config
    such a call runs in the row's place."""
    table = _table(spec, device)
    choice = table.choose(size)
    if not deterministic:
        return choice
    return dataclasses.replace(choice, config=deterministic_config(choice.config, table.spec, table.device))


@torch.library.custom_op("tilegen::attention_bwd", mutates_args=())
def _attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, mask: str, has_softcap: bool, scale: float, softcap: float, window_left: int,
    window_right: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = backward_spec(q.dtype, q.shape[3], v.shape[3], q.shape[1] // k.shape[1], mask, has_softcap, "dense")
    return _run(spec, dout, q, k, v, out, lse, dlse, None, None, q.shape[2], k.shape[2], scale, softcap,
                window_left, window_right, deterministic)


@torch.library.custom_op("tilegen::varlen_attention_bwd", mutates_args=())
def _varlen_attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
    max_seqlen_k: int, mask: str, has_softcap: bool, scale: float, softcap: float, window_left: int,
    window_right: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = backward_spec(q.dtype, q.shape[2], v.shape[2], q.shape[1] // k.shape[1], mask, has_softcap, "ragged")
    return _run(spec, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                softcap, window_left, window_right, deterministic)


@_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@_varlen_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _refuse_double_backward(name: str):
    def backward(ctx, *grads):
        raise NotImplementedError(f"{name}: the second derivative (double backward) of attention is not implemented; "
                                  "differentiate once (create_graph=False)")
    return backward


def _grads(ctx, dout, dlse, out):
    """The output gradients as the backward ops take them; ``None`` when neither output got one."""
    if dout is None and dlse is None:
        return None
    # The forward's return_lse, not the LSE's size: comparing sizes guarded a compiled graph on every length.
    if not ctx.has_lse:
        raise RuntimeError(f"{ctx.name}: the forward ran without its LSE (return_lse=False through the raw op), "
                           "which the backward needs; call the public function, which keeps it")
    return (torch.zeros_like(out) if dout is None else dout), dlse


def attach_dense(forward_op) -> None:
    """Make ``tilegen::attention_fwd`` differentiable. Its arguments: ``(q, k, v, head_dim_v, mask,
    has_softcap, return_lse, scale, softcap, window_left, window_right, deterministic)``."""

    def setup_context(ctx, inputs, output):
        q, k, v, _, mask, has_softcap, ctx.has_lse, scale, softcap, left, right, deterministic = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (mask, has_softcap, scale, softcap, left, right, deterministic)
        ctx.name = "tilegen.attention"
        ctx.set_materialize_grads(False)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _grads(ctx, dout, dlse, out)
        if grads is None:
            return (None,) * 12
        dout, dlse = grads
        dq, dk, dv = _attention_bwd(dout, q, k, v, out, lse, dlse, *ctx.args)
        return (dq, dk, dv) + (None,) * 9

    torch.library.register_autograd(forward_op, backward, setup_context=setup_context)


@torch.library.custom_op("tilegen::attention_mods_bwd", mutates_args=())
def _attention_mods_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, mod_tensors: list[torch.Tensor], wants: list[bool], score_tensors: int,
    score_mod: str | None, mask_mod: str | None, mask: str, has_softcap: bool, scale: float, softcap: float,
    window_left: int, window_right: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    spec = with_mod_fields(backward_spec(q.dtype, q.shape[3], v.shape[3], q.shape[1] // k.shape[1], mask, has_softcap,
                                         "dense"), score_mod, mask_mod)
    mods = ModCall(score_mod, mask_mod, tuple(mod_tensors), tuple(mod_tensors[score_tensors:]))
    fixed = {"scale": scale, "softcap": softcap, "window_left": window_left, "window_right": window_right}
    dq, dk, dv, grads = run_with_mods(spec, mods, wants, dout, q, k, v, out, lse, dlse, None, None, q.shape[2],
                                      k.shape[2], fixed, deterministic)
    return dq, dk, dv, _mod_grads(grads, mod_tensors)


@_attention_mods_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, mod_tensors, wants, score_tensors, score_mod, mask_mod, mask, has_softcap, scale,
      softcap, window_left, window_right, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), [_contiguous_like(t) for t in mod_tensors]


def _mod_grads(grads, mod_tensors) -> list[torch.Tensor]:
    """The captured tensors' gradients as the ops return them: contiguous whatever the tensors' strides, as the fake
    implementations say they are, and zeros where a tensor gets none (the autograd's backward drops those)."""
    return [_contiguous_like(t).zero_() if g is None else g.contiguous() for g, t in zip(grads, mod_tensors)]


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def attach_mods(forward_op) -> None:
    """Make ``tilegen::attention_mods_fwd`` differentiable (``torch.compile``'s calls with mods). Its arguments:
    ``(q, k, v, mod_tensors, score_tensors, score_mod, mask_mod, head_dim_v, mask, has_softcap, return_lse, scale,
    softcap, window_left, window_right, deterministic)``."""

    def setup_context(ctx, inputs, output):
        q, k, v, tensors, score_tensors, score_mod, mask_mod, _, mask, has_softcap, ctx.has_lse, *rest = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.args = (score_tensors, score_mod, mask_mod, mask, has_softcap, *rest)
        ctx.name = "tilegen.attention"
        ctx.set_materialize_grads(False)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        grads = _grads(ctx, dout, dlse, out)
        if grads is None:
            return (None, None, None, [None] * len(tensors)) + (None,) * 12
        dout, dlse = grads
        wants = list(ctx.needs_input_grad[3])  # per captured tensor: the Tensor[] argument's
        dq, dk, dv, dts = _attention_mods_bwd(dout, q, k, v, out, lse, dlse, tensors, wants, *ctx.args)
        return (dq, dk, dv, [g if w else None for g, w in zip(dts, wants)]) + (None,) * 12

    torch.library.register_autograd(forward_op, backward, setup_context=setup_context)


@torch.library.custom_op("tilegen::varlen_attention_mods_bwd", mutates_args=())
def _varlen_attention_mods_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
    max_seqlen_k: int, mod_tensors: list[torch.Tensor], wants: list[bool], score_tensors: int, score_mod: str | None,
    mask_mod: str | None, mask: str, has_softcap: bool, scale: float, softcap: float, window_left: int,
    window_right: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    spec = with_mod_fields(backward_spec(q.dtype, q.shape[2], v.shape[2], q.shape[1] // k.shape[1], mask, has_softcap,
                                         "ragged"), score_mod, mask_mod)
    mods = ModCall(score_mod, mask_mod, tuple(mod_tensors), tuple(mod_tensors[score_tensors:]))
    fixed = {"scale": scale, "softcap": softcap, "window_left": window_left, "window_right": window_right}
    dq, dk, dv, grads = run_with_mods(spec, mods, wants, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k, fixed, deterministic)
    return dq, dk, dv, _mod_grads(grads, mod_tensors)


@_varlen_attention_mods_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mod_tensors, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), [_contiguous_like(t) for t in mod_tensors]


def attach_ragged_mods(forward_op) -> None:
    """Make ``tilegen::varlen_attention_mods_fwd`` differentiable (``torch.compile``'s ragged calls with mods). Its
    arguments: ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mod_tensors, score_tensors,
    score_mod, mask_mod, head_dim_v, mask, has_softcap, return_lse, scale, softcap, window_left, window_right,
    deterministic)``."""

    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, tensors, score_tensors, score_mod, mask_mod, _, mask, has_softcap, \
            ctx.has_lse, *rest = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, *tensors)
        ctx.args = (max_q, max_k, score_tensors, score_mod, mask_mod, mask, has_softcap, *rest)
        ctx.name = "tilegen.varlen_attention"
        ctx.set_materialize_grads(False)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k, *tensors = ctx.saved_tensors
        grads = _grads(ctx, dout, dlse, out)
        if grads is None:
            return (None,) * 7 + ([None] * len(tensors),) + (None,) * 12
        dout, dlse = grads
        wants = list(ctx.needs_input_grad[7])  # per captured tensor: the Tensor[] argument's
        max_q, max_k, *rest = ctx.args
        dq, dk, dv, dts = _varlen_attention_mods_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, tensors,
                                                     wants, *rest)
        return (dq, dk, dv) + (None,) * 4 + ([g if w else None for g, w in zip(dts, wants)],) + (None,) * 12

    torch.library.register_autograd(forward_op, backward, setup_context=setup_context)


def attach_ragged(forward_op) -> None:
    """Make ``tilegen::varlen_attention_fwd`` differentiable. Its arguments: ``(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, head_dim_v, mask, has_softcap, scale, softcap, window_left,
    window_right, deterministic)``."""

    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, _, mask, has_softcap, scale, softcap, left, right, deterministic = inputs
        out, lse = output
        ctx.has_lse = True  # the op always makes it
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, mask, has_softcap, scale, softcap, left, right, deterministic)
        ctx.name = "tilegen.varlen_attention"
        ctx.set_materialize_grads(False)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        grads = _grads(ctx, dout, dlse, out)
        if grads is None:
            return (None,) * 15
        dout, dlse = grads
        dq, dk, dv = _varlen_attention_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.args)
        return (dq, dk, dv) + (None,) * 12

    torch.library.register_autograd(forward_op, backward, setup_context=setup_context)


for _op, _name in (("attention_bwd", "tilegen.attention"), ("varlen_attention_bwd", "tilegen.varlen_attention"),
                   ("attention_mods_bwd", "tilegen.attention"),
                   ("varlen_attention_mods_bwd", "tilegen.varlen_attention")):
    torch.library.register_autograd(f"tilegen::{_op}", _refuse_double_backward(_name))
