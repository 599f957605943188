"""Launching compiled Triton kernels without ``JITFunction.run``'s per-call work.

``kernel[grid](*args)`` binds the arguments, computes every argument's specialization (type,
16-byte alignment, ``== 1``, divisibility by 16), builds a cache key string and checks the
kernel's globals on every call: on the H200's host that is most of a tiny call's time. Once a
kernel has run through the JIT, the compiled kernel for that specialization is known, so
later calls can hand their arguments to its launcher directly, as ``JITFunction.run`` does.

Two levels:

- ``DirectKernel`` stands in for a ``JITFunction`` inside a generated launcher. Each call
  computes a fingerprint of what decides the specialization (each tensor's dtype and 16-byte
  alignment, each int's class: ``== 1``, divisible by 16, 32 or 64 bits; each TMA tensor
  descriptor's dtype, block shape and padding, and a Gluon one's shared layout; constexpr values
  and options exactly) and
  the global state ``JITFunction.run`` reads (current device, Triton's debug and
  instrumentation knobs). A fingerprint seen before launches the kernel
  compiled for it; anything new or unusual goes through the JIT. A new entry is kept only
  after checking it against the JIT's own binding: the same arguments in the same order,
  the specialization the fingerprint predicts, the JIT's cache holding this very kernel.
- ``Replay`` serves one op plan: it records the kernel launches of one call of the generated
  launcher and replays them for later calls with new tensors, skipping the launcher's Python
  too. Its caller supplies a key covering every non-pointer input the launcher reads (the
  strides; the plan fixes shapes, dtypes and scalars); each replay re-checks the alignment
  of every tensor and the global state.

Only the Triton versions whose ``JITFunction.run`` this module was written against are
handled (3.6.0, 3.7.0, 3.7.1, 3.8.0, 3.9.0, recognised by the source of that method: see
``tilegen.triton_internals.gate``); on any other, under the interpreter, or with
``TILEGEN_DIRECT_LAUNCH=0``, every launch goes through the JIT as before.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import threading
import types
from typing import Any

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

try:  # read on every direct launch, so bound here; a Triton without them is not recognised (gate)
    from triton import knobs
    from triton.knobs import HookChain
    from triton.runtime.driver import driver
except ImportError:
    knobs = HookChain = driver = None

from tilegen import env
from tilegen.triton_internals import OPTIONS, gate, kernel_index, warmup
from tilegen.triton_internals.gate import Variant

__all__ = ["DirectKernel", "Launcher", "Replay", "replayable", "support"]

log = logging.getLogger("tilegen.launch")

#: Entries kept per kernel or replay before the table starts over (shapes that never repeat
#: would otherwise grow it without bound).
_LIMIT = 512


def support() -> str | None:
    """``None`` when kernels can be launched directly here, else the reason they cannot."""
    if env.interpreting():
        return "Triton's interpreter runs the kernels"
    if os.environ.get("TILEGEN_DIRECT_LAUNCH", "1") in ("0", ""):
        return "TILEGEN_DIRECT_LAUNCH=0"
    return gate.reason()


def _state(variant: Variant):
    """What ``JITFunction.run`` reads from the process on each call, as one hashable tuple;
    ``None`` when something it reads takes us off the direct path."""
    active = driver.active
    runtime = knobs.runtime
    if variant.stages_hook and runtime.add_stages_inspection_hook is not None:
        return None  # it adds to the specialization: leave that to the JIT
    compilation = knobs.compilation
    if variant.fpsan:
        return (active, active.get_current_device(), runtime.debug, compilation.instrumentation_mode,
                compilation.fpsan_homomorphic_casts)
    return active, active.get_current_device(), runtime.debug, compilation.instrumentation_mode


def _idle(hook) -> bool:
    """Whether a launch hook does nothing: unset, or an empty ``HookChain`` (Triton's default)."""
    return hook is None or (hook.__class__ is HookChain and not hook.calls)


_I32 = 1 << 31
_I64 = 1 << 63
_U64 = 1 << 64


def _int_class(value: int):
    """What Triton's specialization of a (non-constexpr) int depends on."""
    if value == 1:
        return "one"
    if -_I32 <= value < _I32:
        width = 32
    elif -_I64 <= value < _I64:
        width = 64
    elif 0 <= value < _U64:
        width = 65  # u64
    else:
        return None  # Triton refuses it: let the JIT say so
    return width if value & 15 else -width


_SCALARS = (int, float, bool, str, type(None))

#: Where Gluon's Hopper descriptor class lives; recognised by name, as importing Gluon costs a cold
#: process about 0.13 s that a process launching no Gluon kernel need not pay.
_GLUON_DESCRIPTOR = ("triton.experimental.gluon.nvidia.hopper", "TensorDescriptor")


def _gluon_descriptor(kind: type) -> bool:
    return kind.__name__ == _GLUON_DESCRIPTOR[1] and kind.__module__ == _GLUON_DESCRIPTOR[0]


class _Entry:
    """A kernel compiled for one fingerprint, and how to lay out a call's arguments for it."""

    __slots__ = ("fn", "globals", "kernel", "tail")

    def __init__(self, fn, kernel, tail, globals_):
        self.fn = fn
        self.kernel = kernel
        self.tail = tail  # per parameter after the positional ones: (True, name) from kwargs, (False, default)
        self.globals = globals_  # (dict, name, object seen, its .value or None)

    def ready(self) -> bool:
        """The checks ``JITFunction.run`` makes before launching: no pre-run hooks, globals unchanged."""
        if self.fn.pre_run_hooks:
            return False
        for namespace, name, seen, value in self.globals:
            now = namespace.get(name, _Entry)
            if now is not seen or (value is not None and getattr(now, "value", None) is not value):
                return False  # the JIT compares the values and raises if they changed
        return True

    def arguments(self, args: tuple, kwargs: dict) -> tuple:
        if not self.tail:
            return args
        return args + tuple(kwargs[item] if from_kwargs else item for from_kwargs, item in self.tail)

    def launch(self, grid, stream, arguments) -> None:
        runtime = knobs.runtime
        enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
        quiet = _idle(enter) and _idle(exit_)
        grid_size = len(grid)
        _launch(self.kernel, grid, grid[0], grid[1] if grid_size > 1 else 1, grid[2] if grid_size > 2 else 1,
                stream, quiet, enter, exit_, arguments)


def _launch(kernel, grid, grid_0, grid_1, grid_2, stream, quiet, enter, exit_, arguments) -> None:
    """The launch ``JITFunction.run`` makes; with idle hooks (``quiet``) it passes ``None`` for them,
    which the launcher skips as it would run the empty ones, and their metadata is then unused."""
    if quiet:
        kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *arguments)
    else:
        kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *arguments), enter, exit_, *arguments)


class DirectKernel:
    """A ``JITFunction`` whose repeated launches skip argument binding: ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, fn, variant: Variant):
        self.fn = fn
        self.variant = variant
        self.params = list(fn.params)
        self.constexpr = frozenset(p.num for p in self.params if p.is_constexpr)
        self.entries: dict[Any, _Entry] = {}
        self.broken: str | None = None  # set when the JIT disagreed with a fingerprint: JIT only, for good

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs):
        """Launch on ``grid`` and return the entry used, or ``None`` when it went through the JIT unchecked."""
        state = _state(self.variant) if self.broken is None else None
        key = None if state is None else self._fingerprint(grid, args, kwargs)
        if key is not None:
            key = (state, key)
            entry = self.entries.get(key)
            if entry is None:
                entry = self._indexed(state, key)
            if entry is not None and entry.ready():
                entry.launch(grid, state[0].get_current_stream(state[1]), entry.arguments(args, kwargs))
                return entry
        warmup.wait()  # the JIT's first call would otherwise redo the warm-up's work beside it
        kernel = self.fn.run(*args, grid=grid, warmup=False, **{**OPTIONS, **kwargs})
        if key is None:
            return None
        entry = self._check(state, kernel, args, kwargs)
        if entry is not None:
            self._keep(key, entry)
            kernel_index.store(self.fn, state[1], key[1], kernel, entry.tail)
        return entry

    def _keep(self, key, entry: _Entry) -> None:
        if len(self.entries) >= _LIMIT:
            self.entries.clear()
        self.entries[key] = entry

    def _indexed(self, state, key) -> _Entry | None:
        """The entry of a launch checked in an earlier process, its kernel loaded from Triton's cache."""
        found = kernel_index.load(self.fn, state[1], key[1])
        if found is None:
            return None
        entry = _Entry(self.fn, found[0], found[1], ())
        self._keep(key, entry)
        return entry

    def _fingerprint(self, grid, args, kwargs):
        if grid.__class__ is not tuple or not 1 <= len(grid) <= 3:
            return None  # a callable grid sees the bound arguments: the JIT's business
        parts = []
        constexpr = self.constexpr
        for i, arg in enumerate(args):
            kind = arg.__class__
            if i in constexpr:
                if kind not in _SCALARS:
                    return None
                parts.append((kind, arg))
            elif kind is torch.Tensor:
                parts.append((arg.dtype, not arg.data_ptr() & 15))
            elif kind is TensorDescriptor:
                # The launcher encodes the descriptor's base, shape and strides on every launch; Triton
                # specializes on its dtype and block shape (the base is 16-byte aligned by construction).
                if arg.base.__class__ is not torch.Tensor:
                    return None
                parts.append(("descriptor", arg.base.dtype, tuple(arg.block_shape), arg.padding,
                              getattr(arg, "round_f32_to_tf32", False)))
            elif kind is int:
                parts.append(_int_class(arg))
            elif kind is float or kind is bool or arg is None:
                parts.append(kind)
            elif _gluon_descriptor(kind):  # after the scalars, which every launch passes many of
                # A Gluon kernel's descriptor: specialized on its shared-memory layout too.
                if arg.base.__class__ is not torch.Tensor:
                    return None
                parts.append(("gluon descriptor", arg.base.dtype, tuple(arg.block_shape), arg.layout, arg.padding))
            else:
                return None
        for value in kwargs.values():
            if value.__class__ not in _SCALARS:
                return None
        return (grid.__class__, self.fn.debug, *parts, *[(k, v.__class__, v) for k, v in kwargs.items()])

    def _check(self, state, kernel, args, kwargs) -> _Entry | None:
        """An entry for this call if the JIT's own binding confirms every assumption, else ``None``."""
        from triton.backends.compiler import BaseBackend
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import compute_cache_key

        fn = self.fn
        if kernel.__class__ is not CompiledKernel or fn.pre_run_hooks:
            return None  # an asynchronous compile's future, or hooks that must see each call
        caches = fn.device_caches.get(state[1])
        if caches is None:
            return None
        kernel_cache, key_cache, _, backend, binder = caches
        for name in ("get_int_specialization", "get_tensor_specialization"):
            if getattr(type(backend), name, None) is not getattr(BaseBackend, name):
                return self._break(f"the {type(backend).__name__} backend specializes arguments its own way")
        # The options JITFunction.run adds before binding, read as it reads them.
        options = {**OPTIONS, **kwargs, "debug": kwargs.get("debug", fn.debug) or knobs.runtime.debug}
        for name in self.variant.options:
            options[name] = getattr(knobs.compilation, name)
        bound, specialization, options = binder(*args, **options)
        if kernel_cache.get(compute_cache_key(key_cache, specialization, options)) is not kernel:
            return None
        tail = []
        for p in self.params[len(args):]:
            if p.name in kwargs:
                tail.append((True, p.name))
            elif p.has_default:
                tail.append((False, p.default))
            else:
                return None
        entry = _Entry(fn, kernel, tuple(tail), ())
        values = list(bound.values())
        arguments = entry.arguments(args, kwargs)
        if len(values) != len(arguments) or any(a is not b for a, b in zip(values, arguments)):
            return self._break("the JIT binds the arguments in another order")
        for p, arg, spec in zip(self.params, arguments, specialization):
            if not _agrees(p, arg, spec):
                return self._break(f"the JIT specializes {p.name} ({type(arg).__name__}) as {spec!r}, not as expected")
        seen = []
        for (name, _), (value, namespace) in fn.used_global_vals.items():
            now = namespace.get(name, _Entry)
            if now is _Entry or now != value:
                return None
            inner = getattr(now, "value", None)
            if hasattr(now, "value") and inner.__class__ not in _SCALARS:
                return None  # a mutable payload the JIT compares by value: leave those calls to it
            seen.append((namespace, name, now, inner if hasattr(now, "value") else None))
        entry.globals = tuple(seen)
        return entry

    def _break(self, reason: str) -> None:
        self.broken = reason
        self.entries.clear()
        log.warning("tilegen: launching %s through Triton's JIT from now on: %s", self.fn.__name__, reason)


def _agrees(param, arg, spec) -> bool:
    """Whether Triton's specialization ``spec`` of ``arg`` is determined by what the fingerprint keeps."""
    kind, attr = spec[0], spec[1] if len(spec) > 1 else None
    if param.is_constexpr:
        return kind == "constexpr"
    specialize = not param.do_not_specialize
    align = specialize and not param.do_not_specialize_on_alignment
    if arg.__class__ is torch.Tensor:
        want = None if not specialize else ("D" if align and not arg.data_ptr() & 15 else "")
        return isinstance(kind, str) and kind.startswith("*") and attr == want
    if arg.__class__ is TensorDescriptor or _gluon_descriptor(arg.__class__):
        block = "[" + ", ".join(map(str, arg.block_shape)) + "]"
        layout = repr(arg.layout) if arg.__class__ is not TensorDescriptor else ""
        return isinstance(kind, str) and kind.startswith("tensordesc<") and block in kind and layout in kind \
            and attr is None
    if arg.__class__ is int:
        cls = _int_class(arg)
        if cls == "one":
            return spec == ("constexpr", 1) if specialize else spec == ("i32", None)
        name = {32: "i32", 64: "i64", 65: "u64"}[abs(cls)]
        want = None if not specialize else ("D" if align and cls < 0 else "")
        return kind == name and attr == want
    if arg.__class__ is float:
        return spec == ("fp32", None)
    if arg.__class__ is bool:
        return spec == ("u1", None)
    return arg is None and spec == ("constexpr", None)


class _WithOptions:
    """A kernel that launches through the JIT, with ``OPTIONS`` unless the launch names them."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        launch = self.fn[grid]
        return lambda *args, **kwargs: launch(*args, **{**OPTIONS, **kwargs})


class Launcher:
    """A generated module's ``launch``: through the JIT (``jit``), or with its kernels launched
    directly (``direct``, the same signature, also named ``launch``); ``replay`` makes a plan's recorder."""

    def __init__(self, module: types.ModuleType, direct: bool = True):
        from triton.runtime.jit import JITFunction

        self.module = module
        launch = module.launch
        names = _names(launch.__code__)  # nested code too: a kernel called from a comprehension is captured
        # Gluon kernels too (a JITFunction subclass with the same run): their launches are captured like the
        # others, and go through the JIT where no fingerprint describes their arguments.
        kernels = {name: value for name, value in vars(module).items()
                   if name in names and isinstance(value, JITFunction)}
        # The launcher through the JIT, its kernels passing OPTIONS (the interpreter compiles nothing).
        self.jit = launch if env.interpreting() else _rebind(
            launch, {name: _WithOptions(kernel) for name, kernel in kernels.items()})
        self.reason = support() if direct else "asked for launches through the JIT"
        self.direct = self.jit
        self._kernels: dict[str, DirectKernel] = {}
        self._lock = threading.Lock()
        self._sink: list | None = None
        if self.reason is not None:
            warmup.wait()  # every launch goes through the JIT, whose first call needs what the warm-up computes
            return
        variant = gate.internals()
        for name, value in kernels.items():
            self._kernels[name] = DirectKernel(value, variant)
        self.direct = _rebind(launch, self._kernels)
        self._capture = _rebind(launch, {name: _Capture(self, kernel) for name, kernel in self._kernels.items()})
        self._replayable = replayable(module)

    @property
    def launch(self):
        """``direct``, under the generated module's name for its launcher: a ``Launcher`` stands in for
        the module where ``module.launch(...)`` is called (a family's ``Problem.launch``, which the
        tuner hands the launcher the ops replay)."""
        return self.direct

    def replay(self, kwargs: dict[str, Any], views: dict[int, Any] | None = None) -> Replay:
        """A recorder of this launcher's calls with keyword arguments ``kwargs`` (see ``Replay``)."""
        return Replay(self, kwargs, views or {})

    def capture(self, args: tuple, kwargs: dict) -> list:
        """Run the launcher's Python without launching: its kernel calls, in order."""
        with self._lock:
            self._sink = []
            try:
                self._capture(*args, **kwargs)
                return self._sink
            finally:
                self._sink = None


def replayable(module: types.ModuleType) -> bool:
    """Whether a generated module's ``launch`` may be replayed. A launcher that calls module functions of its
    own could launch kernels out of sight of the capture: such a launcher is never replayed, unless every
    such function provably reaches no kernel (a causal launcher's tile-schedule arithmetic, say)."""
    return all(
        _host_only(module, value)
        for name in _names(module.launch.__code__) - {"launch"}
        if isinstance(value := getattr(module, name, None), types.FunctionType)
    )


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and its nested code (comprehensions, generator expressions, lambdas) read."""
    codes, names = [code], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def _host_only(module: types.ModuleType, function: types.FunctionType, seen: frozenset = frozenset()) -> bool:
    """Whether ``function`` (of ``module``) can only compute on the host: every global it or its nested code
    (comprehensions, lambdas) names is a builtin, plain data (numbers, strings, tuples of them), or another
    function of the module that is host-only too. Modules, classes and kernels fail it, so nothing it
    calls can launch a kernel behind the capture's back."""
    if function.__code__ in seen:
        return True  # a recursive call: judged by the visit in progress
    if function.__module__ != module.__name__:
        return False  # imported from elsewhere: not the generated code this proof reads
    seen = seen | {function.__code__}
    namespace = vars(module)
    for name in _names(function.__code__):
        if name in namespace:
            value = namespace[name]
            if isinstance(value, types.FunctionType):
                if not _host_only(module, value, seen):
                    return False
            elif not _plain(value):
                return False
        elif name in _REACHING_BUILTINS:
            return False
        # Else a builtin, or an attribute's name (``.append``) on the values allowed above.
    return True


def _plain(value) -> bool:
    """Numbers, strings, None, and tuples of them: data no call can go through."""
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return isinstance(value, (int, float, str, bool, type(None)))


#: Builtins through which a function could reach any object, a kernel included.
_REACHING_BUILTINS = frozenset({"getattr", "globals", "vars", "locals", "eval", "exec", "compile", "__import__"})


class _Capture:
    def __init__(self, launcher: Launcher, kernel: DirectKernel):
        self.launcher = launcher
        self.kernel = kernel

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.launcher._sink.append((self.kernel, grid, args, kwargs))

        return call


def _rebind(function: types.FunctionType, replacements: dict[str, Any]) -> types.FunctionType:
    """``function`` reading ``replacements`` in place of its module's globals of those names; the
    module itself, where the kernels read their globals, is left alone."""
    namespace = {**function.__globals__, **replacements}
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__doc__ = function.__doc__
    return copy


class _Recording:
    """One call's launches, to replay with the tensors of a later call."""

    __slots__ = ("aliases", "align", "calls", "entries")

    def __init__(self, align, aliases, calls, n_args):
        self.align = align  # (argument index, 16-byte aligned)
        self.aliases = aliases  # (i, j): arguments i and j were one tensor, which a kernel argument may be either
        # Per launch: (kernel, grid, its three sizes, the launch's values after the call's arguments, and a
        # getter laying out the launch's arguments from the call's arguments followed by those values).
        self.calls = []
        for entry, grid, template, slots in calls:
            values, order = [], []
            tensor_at = dict(slots)
            for slot, value in enumerate(template):
                if slot in tensor_at:
                    order.append(tensor_at[slot])
                else:
                    order.append(n_args + len(values))
                    values.append(value)
            self.calls.append((entry.kernel, grid, grid[0], grid[1] if len(grid) > 1 else 1,
                               grid[2] if len(grid) > 2 else 1, tuple(values), _getter(order)))
        self.calls = tuple(self.calls)
        self.entries = tuple(call[0] for call in calls)

    def replay(self, state, args) -> bool:
        """Launch with ``args`` if nothing that decides the kernels changed; ``False`` when something did."""
        for i, aligned in self.align:
            if (not args[i].data_ptr() & 15) is not aligned:
                return False
        for i, j in self.aliases:
            if args[i] is not args[j]:
                return False
        for entry in self.entries:
            if not entry.ready():
                return False
        runtime = knobs.runtime
        enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
        quiet = (enter is None or (enter.__class__ is HookChain and not enter.calls)) and (
            exit_ is None or (exit_.__class__ is HookChain and not exit_.calls))
        stream = state[0].get_current_stream(state[1])
        for kernel, grid, grid_0, grid_1, grid_2, values, layout in self.calls:
            arguments = layout(args + values)
            if quiet:  # as in _launch
                kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, None, None,
                           None, *arguments)
            else:
                _launch(kernel, grid, grid_0, grid_1, grid_2, stream, False, enter, exit_, arguments)
        return True


def _getter(order: list[int]):
    """``pool -> tuple(pool[i] for i in order)``, at C speed."""
    if len(order) == 1:
        return lambda pool: (pool[order[0]],)
    return operator.itemgetter(*order)


class Replay:
    """Records one plan's launches and replays them: ``replay(key, *args)``.

    ``args`` are the generated launcher's positional arguments and ``kwargs`` (fixed) its
    keyword ones. ``key`` must determine everything but the tensors' data that the launcher
    reads: the plan behind a replay fixes the shapes, dtypes and non-tensor arguments, and the
    caller passes the strides (say) as ``key``. A recording is kept only when each kernel
    argument is one of ``args`` itself or a value (never a tensor the launcher made), each
    launch was checked against the JIT (``DirectKernel``) and no unknown function runs in
    between. ``views`` maps an argument index to a function that makes the tensor the launcher
    takes (``t.unsqueeze(2)``, say) from the one the caller passes; it must not move the
    data pointer, and replays pass the caller's tensor, whose pointer is the same.
    """

    def __init__(self, launcher: Launcher, kwargs: dict[str, Any], views: dict[int, Any]):
        self.launcher = launcher
        self.kwargs = kwargs
        self.views = views
        self.variant = None if launcher.reason is not None or not launcher._replayable else gate.internals()
        self.recordings: dict[Any, _Recording | None] = {}

    def __call__(self, key, *args) -> None:
        variant = self.variant
        if variant is None:
            self._launch(self.launcher.direct, args)
            return
        state = _state(variant)
        if state is None:
            self._launch(self.launcher.jit, args)
            return
        key = (state, key)
        recording = self.recordings.get(key, self)
        if recording is None:  # not replayable: the launcher's Python with direct kernels
            self._launch(self.launcher.direct, args)
            return
        if recording is not self and recording.replay(state, args):
            return
        self._record(key, state, args)
    def _launch(self, launch, args) -> None:
        views = self.views
        launch(*[views[i](a) if i in views else a for i, a in enumerate(args)] if views else args, **self.kwargs)

    def _record(self, key, state, args) -> None:
        views = self.views
        given = [views[i](a) if i in views else a for i, a in enumerate(args)] if views else list(args)
        captured = self.launcher.capture(tuple(given), self.kwargs)
        entries = [kernel.launch(grid, *kargs, **kkwargs) for kernel, grid, kargs, kkwargs in captured]
        if len(self.recordings) >= _LIMIT:
            self.recordings.clear()
        self.recordings[key] = self._recording(state, args, given, captured, entries)

    def _recording(self, state, args, given, captured, entries) -> _Recording | None:
        if not captured or any(entry is None for entry in entries) or _state(self.variant) != state:
            return None
        ids = {}
        aliases = []
        for i, t in enumerate(given):
            if t.__class__ is torch.Tensor:
                if id(t) in ids:
                    aliases.append((ids[id(t)], i))
                else:
                    ids[id(t)] = i
        used = set()
        calls = []
        for (kernel, grid, kargs, kkwargs), entry in zip(captured, entries):
            arguments = entry.arguments(kargs, kkwargs)
            slots = []
            for slot, value in enumerate(arguments):
                if value.__class__ is torch.Tensor:
                    i = ids.get(id(value))
                    if i is None:
                        return None  # a tensor the launcher made: it would be shared between calls
                    slots.append((slot, i))
                    used.add(i)
                elif value.__class__ not in _SCALARS:
                    return None
            template = tuple(None if value.__class__ is torch.Tensor else value for value in arguments)
            calls.append((entry, grid, template, tuple(slots)))
        for i in used:
            if i in self.views and (args[i].__class__ is not torch.Tensor or args[i].data_ptr() != given[i].data_ptr()
                                    or args[i].dtype != given[i].dtype):
                return None
        # An alias's pointer is its twin's: checked once.
        align = tuple((i, not args[i].data_ptr() & 15) for i in sorted(used - {j for _, j in aliases}))
        return _Recording(align, tuple(aliases), tuple(calls), len(args))
