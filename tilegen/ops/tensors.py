"""What several ops do with the arguments they are handed: check that the kernels can run on
their device and fit a launch grid, check their flags, refuse inputs that require grad, and write
through a view of them."""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _fwad

from tilegen.env import interpreting

__all__ = ["MAX_GRID_YZ", "NO_BACKWARD", "autocast_inputs", "autocasting", "check_bool", "check_device",
           "check_distinct", "check_grid", "check_out", "count_writes", "empty_like_template", "first_overlap",
           "off_eager", "refuse_grad", "refuse_tangents", "transformed", "writable"]

#: What the refusal of an ``out`` that requires grad says is missing, for ops that otherwise differentiate.
NO_BACKWARD = "a result written into `out` cannot be differentiated"

#: CUDA's bound on a launch grid's second and third axes.
MAX_GRID_YZ = 65535


def empty_like_template(shape, dtype, device) -> torch.Tensor:
    """One element expanded to ``shape``: ``empty_like`` of it is a contiguous tensor of that shape, in about
    half ``new_empty``'s host time, and the template holds no storage of that size."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def check_device(name: str, device: torch.device, what: str = "tensors") -> None:
    """Raise, naming ``name`` (and ``what`` of it lies there), unless tilegen's kernels can run on ``device`` in this
    process."""
    if device.type == "cpu" and not interpreting():
        raise ValueError(f"{name}: {what} are on the CPU; tilegen kernels run on CUDA, or on the CPU under "
                         "TRITON_INTERPRET=1")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {device} is not supported; expected cuda")


def check_bool(name: str, value: object) -> None:
    """Raise, naming ``name``, unless ``value`` is a bool: a truthy string or number would silently choose."""
    # isinstance, not ``__class__``: Dynamo (torch 2.11) does not read a constant's ``__class__`` as its type.
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")


def check_grid(name: str, count: int, what: str) -> None:
    """Raise, naming ``name``, when ``count`` programs (``what``: a sequence's, or a head's of one) would sit on a
    launch grid's second or third axis, past CUDA's bound there: the launch would fail with Triton's bare
    "invalid argument"."""
    if count > MAX_GRID_YZ:
        raise ValueError(f"{name}: {count} {what} exceed the {MAX_GRID_YZ} one launch takes; split the batch")


def refuse_grad(op: str, /, *, missing: str | None = None, fix: str = "call it under torch.no_grad() or detach "
                "the input", **tensors: object) -> None:
    """Raise ``NotImplementedError`` naming ``op`` and the first of ``tensors`` (None and non-tensors
    skipped) that requires grad, when grad mode is on; else return. The kernels write through raw
    pointers, so without this an output would silently have no ``grad_fn``. Callers on a hot path
    test ``torch.is_grad_enabled() and (a.requires_grad or ...)`` inline first and call this only
    then, to build the message; ``missing`` replaces "<op> has no backward"."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            why = missing or f"{op.removeprefix('tilegen.')} has no backward"
            raise NotImplementedError(f"{op}: {name} requires grad, but {why}; {fix}")


def refuse_tangents(op: str, /, **tensors: object) -> None:
    """Raise ``NotImplementedError`` naming ``op`` and the first of ``tensors`` that carries a forward-mode tangent
    (``torch.autograd.forward_ad``, ``torch.func.jvp``, ``jacfwd``); else return. No op has a forward-mode derivative,
    and a custom op, or a kernel launched on the primal, drops the tangent silently (None, or zeros under jvp).
    Hot paths read ``_fwad._current_level`` themselves first and call it only while a dual level is open."""
    if _fwad._current_level < 0:
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and _fwad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(f"{op}: {name} has a forward-mode tangent (torch.func.jvp, jacfwd or "
                                      "torch.autograd.forward_ad), but forward-mode AD is not implemented; "
                                      "differentiate in reverse mode (backward, torch.func.vjp)")


# Bound once: every eager call asks these, and each attribute chain costs as much as the C call it reaches.
_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack
_dispatch_mode = torch._C._get_dispatch_mode
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def transformed() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp) or a ``FakeTensorMode`` is active: the tensors are then
    wrappers or fakes without storage that a kernel could be launched on, so calls take their custom op (a vmap by
    torch's per-sample fallback, fakes by its fake implementation). Not for traced code: Dynamo need not know
    these functions, and its calls take the custom ops anyway."""
    # The stack's length first: without any dispatch mode (the hot paths' case) it costs half the FAKE lookup.
    return _functorch_active() or (_dispatch_modes() > 0 and _dispatch_mode(_FAKE) is not None)


def off_eager() -> bool:
    """Whether a call takes its custom op rather than launching: under ``torch.compile`` (Dynamo traces the op) or
    ``transformed()``. One call for the hot paths, which asked ``torch.compiler.is_compiling()`` alone before."""
    return _compiling() or _functorch_active() or (_dispatch_modes() > 0 and _dispatch_mode(_FAKE) is not None)


def writable(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``t`` viewed as ``shape`` without a copy, or None when its strides do not allow one."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[first, last + 1)`` that ``t``'s elements lie in; None when it has none."""
    if t.numel() == 0:
        return None
    first = last = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride * t.element_size()
        if reach < 0:
            first += reach
        else:
            last += reach
    return first, last + t.element_size()


def check_distinct(name: str, out: torch.Tensor) -> None:
    """Raise, naming ``name``, when elements of ``out`` share memory (a stride of 0, as from expand). Reads shapes
    and strides only, so it runs in traced code too, where storage addresses cannot be read."""
    if 0 in out.stride():
        for dim, (size, stride) in enumerate(zip(out.shape, out.stride())):
            if stride == 0 and size > 1:
                raise ValueError(f"{name}: overlaps itself (stride 0 in dimension {dim}, as from expand); "
                                 "pass a tensor whose elements are distinct")


def check_out(name: str, out: torch.Tensor, inputs: dict[str, torch.Tensor | None], may_be: tuple[str, ...] = ()) -> None:
    """Raise, naming ``name``, when ``out`` overlaps itself or one of ``inputs`` in memory, unless
    it is exactly one of the ``may_be`` inputs (same address, shape and strides): the kernels
    read an input's row and write the output's in one program, and another program's write to
    memory still to be read, or two writes to one element, would be a silently wrong answer.
    Spans are compared, so a view interleaved with an input (every other element each) is
    refused too, though the two share no element. Only tensors of one storage can overlap, so
    most calls pay for reading each tensor's storage address and no more (3 µs in all for
    ``out`` and three inputs on the 2-core CPU machine).

    Checked, ``out`` has the write the caller makes next counted in its version (``count_writes``)."""
    check_distinct(name, out)
    other = first_overlap(out, inputs, may_be)
    if other is not None:
        allowed = " or ".join(may_be)
        raise ValueError(f"{name}: overlaps {other} in memory; pass " + (f"{allowed} itself, or " if allowed else "")
                         + "a tensor of its own")
    count_writes((out,))


#: Counts a write into each of a tuple of tensors in their version counters, as torch's in-place ops count theirs:
#: the kernels write through pointers, which autograd does not see, so a graph that saved such a tensor for its
#: backward would silently run on the overwritten values, where it now refuses them. A C call (a fraction of a µs);
#: a tensor made under torch.inference_mode, which has no counter, is skipped.
count_writes = torch._C._increment_version


def first_overlap(t: torch.Tensor, others: dict[str, torch.Tensor | None], may_be: tuple[str, ...] = ()) -> str | None:
    """The name of the first of ``others`` whose span overlaps ``t``'s, but one of ``may_be`` that is exactly ``t``
    (same address, shape and strides); None when none does. Only tensors of one storage can overlap: most calls
    read each tensor's storage address and no more."""
    storage = t.untyped_storage().data_ptr()
    span = None
    for other, u in others.items():
        if u is None or u.untyped_storage().data_ptr() != storage:
            continue
        if other in may_be and (u.data_ptr(), u.shape, u.stride()) == (t.data_ptr(), t.shape, t.stride()):
            continue
        span = span or _span(t)
        there = _span(u)
        if span is not None and there is not None and span[0] < there[1] and there[0] < span[1]:
            return other
    return None


# Whether an autocast region is open where the kernels run: CUDA's alone where they run compiled (a third of the cost
# of asking every device type, on every call), any device's under the interpreter, whose tensors are the CPU's.
autocasting = torch._C._is_any_autocast_enabled if interpreting() else torch._C.is_autocast_enabled


def autocast_inputs(q, k, v):
    """``q, k, v`` as SDPA takes them in an autocast region for their device: each floating tensor of another
    dtype cast to the region's (so fp32 or mixed inputs run in bf16 or fp16, the result coming out in it, and an
    fp32 leaf's gradient flows back through the cast); as given outside one, or when they are not tensors."""
    try:
        device = q.device.type
    except AttributeError:  # not a tensor: the checks say which
        return q, k, v
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype
                 and t.dtype != torch.float64 else t for t in (q, k, v))
