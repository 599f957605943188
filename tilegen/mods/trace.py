"""Trace a mod with ``torch.fx`` into the canonical text the spec holds, and bind its tensors to a call.

The canonical text is the mod's identity: argument names become their roles, captured tensors
``t0, t1, ...`` described by dtype and ndim, every value ``v0, v1, ...`` carries its dtype, and
constants are kept. Two functions that trace to the same graph share a spec; a changed constant
makes a new one. Format (``;``-separated, parsed back by ``tilegen.mods.lower.parse``)::

    score_mod;t0=float32[1];v0:float32=getitem(t0,h);v1:int32=sub(kv_idx,q_idx);...;return v3
"""

from __future__ import annotations

import enum
import functools
import inspect
import numbers
import operator
import sys
import types
import warnings
import weakref
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, NamedTuple

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tilegen.mods.lower import ModTypeError, check_types

__all__ = ["trace", "traced", "TracedMod", "ModCall", "CallRanges", "bind_mods", "bind_traced", "locate", "fetch",
           "wants_grad", "index_spans", "number_paths",
           "ROLES", "DTYPE_NAMES"]

#: The arguments of each kind of mod, by position (their names in the user's function do not matter).
ROLES = {"score_mod": ("score", "b", "h", "q_idx", "kv_idx"), "mask_mod": ("b", "h", "q_idx", "kv_idx")}
# FlexAttention traces with an fp32 score and int32 indices; so does the kernel.
_ROLE_DTYPES = {"score": torch.float32, "b": torch.int32, "h": torch.int32, "q_idx": torch.int32,
                "kv_idx": torch.int32}

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.int32: "int32", torch.int64: "int64", torch.int16: "int16", torch.int8: "int8",
               torch.uint8: "uint8", torch.bool: "bool"}
# What .to() may cast to: the types Triton computes in.
_CASTS = ("float32", "float16", "bfloat16", "int32", "int64", "bool")

_FUNCTIONS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.neg: "neg", operator.abs: "abs", operator.floordiv: "floordiv", operator.mod: "mod",
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge", operator.eq: "eq",
    operator.ne: "ne", operator.and_: "and", operator.or_: "or", operator.invert: "not",
    operator.getitem: "getitem",
    torch.where: "where", torch.tanh: "tanh", torch.exp: "exp", torch.log: "log", torch.sqrt: "sqrt",
    torch.minimum: "minimum", torch.maximum: "maximum", torch.clamp: "clamp", torch.abs: "abs",
    torch.neg: "neg",
}
_METHODS = {"abs": "abs", "neg": "neg", "exp": "exp", "log": "log", "sqrt": "sqrt", "tanh": "tanh",
            "clamp": "clamp", "to": "to", "__getitem__": "getitem", "float": "to", "int": "to", "long": "to",
            "bool": "to",
            # The operators as fx records them when a tensor's element (temperature[0] * x) is their left operand.
            "add": "add", "sub": "sub", "mul": "mul", "div": "div", "__floordiv__": "floordiv", "remainder": "mod",
            "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne", "__and__": "and", "__or__": "or"}
# The cast methods, as the .to() they are.
_CAST_METHODS = {"float": torch.float32, "int": torch.int32, "long": torch.int64, "bool": torch.bool}
SUPPORTED = ("+ - * / // % unary-, abs, < <= > >= == !=, & | ~, torch.where, torch.tanh, torch.exp, torch.log, "
             "torch.sqrt, torch.minimum, torch.maximum, torch.clamp, .to(dtype), indexing a captured tensor")


@dataclass(frozen=True)
class TracedMod:
    """A traced mod: its canonical text, its captured tensors (in ``t0, t1, ...`` order) and their names,
    and the index expressions the host can range-check: ``(tensor, dim, bound)``, ``bound`` an integer
    expression over the roles and constants (``_bound``) whose range the host computes at every call."""

    kind: str
    canonical: str
    tensors: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    checks: tuple[tuple[int, int, tuple], ...]

    def check_ranges(self, ranges: CallRanges) -> None:
        """Raise a ``ValueError`` naming the tensor and dimension that an index can leave at a position the call
        computes (``CallRanges``)."""
        # Under torch.compile, traced as the code it is (the sizes may be symbolic), not past the cache.
        spans = _index_spans if torch.compiler.is_compiling() else index_spans
        for (t, dim, bound), span in zip(self.checks, spans(self.checks, ranges)):
            if span is None:  # no position reads the tensor there, or one the host cannot bound
                continue
            size = self.tensors[t].shape[dim]
            low, high = span
            if low < 0 or high >= size:
                index = _text(bound)
                where = f"{index} = {low}" if low == high and bound[0] == "const" else (
                    f"{index} ranges over [{low}, {high}]")
                shape = tuple(self.tensors[t].shape)
                raise ValueError(f"{self.kind}: captured tensor {self.names[t]!r} (shape {shape}), dim {dim}: {where}, "
                                 f"outside [0, {size - 1}]")


class CallRanges(NamedTuple):
    """What a call's positions range over, for ``TracedMod.check_ranges``: each role's count, and as ``band`` the
    built-in mask's ``(low, high)`` bounds on ``kv_idx - q_idx`` (``mask_band``; None: unbounded), whose masked
    positions the mod's value does not reach, or ``"unknown"`` where the call's (query, key) pairs are not known
    on the host (a ragged batch of sequences with diagonals of their own): then an index that reads both positions
    is left unchecked."""

    b: int
    h: int
    q_idx: int
    kv_idx: int
    band: tuple[int | None, int | None] | str | None = None


def _index_spans(checks: tuple, ranges: CallRanges) -> tuple:
    """Each check's index range over the call's positions (``TracedMod.check_ranges``)."""
    domain = _Domain(ranges)
    return tuple(None if domain.empty else _interval(bound, domain) for _, _, bound in checks)


#: ``_index_spans`` kept per mod and call shape: a call with the shapes of an earlier one reads them back.
index_spans = functools.lru_cache(maxsize=1024)(_index_spans)


def _fail(kind: str, message: str, error=TypeError):
    raise error(f"{kind}: {message}")


def trace(fn: Callable, kind: str) -> TracedMod:
    """Trace ``fn`` as a ``score_mod`` or ``mask_mod``; a ``TypeError``/``ValueError`` names what is refused."""
    roles = ROLES[kind]
    if not callable(fn):
        _fail(kind, f"expected a function, got {type(fn).__name__}")
    try:
        target = _with_roles(fn, kind)
        tracer = _Tracer(fn)
        graph = tracer.trace(target)
        graph_module = fx.GraphModule(tracer.root, graph)
    except Exception as e:  # control flow on a traced value, an unsupported Python function, a wrong arity
        _fail(kind, f"cannot be traced with torch.fx ({type(e).__name__}: {e}); mods must be straight-line code over "
                    f"the supported operations: {SUPPORTED}")
    graph = graph_module.graph
    graph.eliminate_dead_code()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(roles):
        _fail(kind, f"expected {len(roles)} arguments ({', '.join(roles)}), got {len(placeholders)}")
    names: dict[fx.Node, str] = dict(zip(placeholders, roles))
    tensors: list[torch.Tensor] = []
    attr_index: dict[str, int] = {}
    meta: dict[fx.Node, Any] = {n: torch.empty((), dtype=_ROLE_DTYPES[r], device="meta")
                                for n, r in names.items()}
    lines: list[str] = []
    checks: list[tuple[int, int, tuple]] = []
    # The integer values whose range the host can bound (_bound): indices built from them are checked per call.
    bounds: dict[fx.Node, tuple] = {n: ("role", r) for n, r in names.items() if r != "score"}
    # Per bool value, the comparison it is when the host can split positions on it (_condition), else None.
    conditions: dict[fx.Node, tuple | None] = {}
    values = 0

    def arg(a, node) -> str:
        if isinstance(a, fx.Node):
            return names[a]
        if isinstance(a, bool):
            return repr(a)
        if isinstance(a, (int, float)):
            return repr(a)
        if isinstance(a, torch.dtype):
            if DTYPE_NAMES.get(a) not in _CASTS:
                _fail(kind, f".to({a}): expected one of {', '.join(_CASTS)}")
            return DTYPE_NAMES[a]
        if a is None:
            return "None"
        _fail(kind, f"argument {a!r} of {node.target} is not supported (Python numbers and dtypes only)")

    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            t = operator.attrgetter(node.target)(graph_module)  # "sub.bias": a submodule's tensor
            if not isinstance(t, torch.Tensor):
                _fail(kind, f"captured {type(t).__name__} {node.target!r} is not a tensor")
            if t.dtype not in DTYPE_NAMES:
                _fail(kind, f"captured tensor {_name_of(fn, t)!r}: dtype {t.dtype} is not supported")
            if t.layout != torch.strided:
                _fail(kind, _not_strided(_name_of(fn, t), t), ValueError)
            if node.target not in attr_index:
                attr_index[node.target] = len(tensors)
                tensors.append(t)
            names[node] = f"t{attr_index[node.target]}"
            meta[node] = torch.empty(t.shape, dtype=t.dtype, device="meta")
            continue
        op = _op_of(node)
        if op is None:
            target = getattr(node.target, "__name__", node.target)
            _fail(kind, f"{'.' if node.op == 'call_method' else ''}{target} is not supported; supported: {SUPPORTED}")
        args, kwargs = list(node.args), dict(node.kwargs)
        if op == "clamp":
            args = [args[0], *args[1:], *[None] * (3 - len(args))]
            args[1] = kwargs.pop("min", args[1])
            args[2] = kwargs.pop("max", args[2])
        elif op == "to":
            if node.target in _CAST_METHODS and len(args) == 1:
                args.append(_CAST_METHODS[node.target])
            if "dtype" in kwargs:
                args.append(kwargs.pop("dtype"))
            if len(args) != 2 or not isinstance(args[1], torch.dtype):
                _fail(kind, ".to() takes a dtype only (no device, no other tensor)")
        elif op == "getitem":
            base, index = args
            if not (isinstance(base, fx.Node) and base.op == "get_attr"):
                _fail(kind, "only captured tensors may be indexed", ValueError)
            index = index if isinstance(index, tuple) else (index,)
            t = tensors[attr_index[base.target]]
            if len(index) != t.dim() or not all(isinstance(i, (fx.Node, int)) and not isinstance(i, bool)
                                                for i in index):
                _fail(kind, f"captured tensor {_name_of(fn, t)!r} ({t.dim()} dims) must be indexed by one integer "
                            f"expression per dimension, got {len(index)}", ValueError)
            for dim, i in enumerate(index):
                if isinstance(i, fx.Node) and meta[i].dtype.is_floating_point or (
                        isinstance(i, fx.Node) and meta[i].dtype == torch.bool):
                    _fail(kind, f"captured tensor {_name_of(fn, t)!r}, dim {dim}: the index is {meta[i].dtype}, "
                                "not an integer", ValueError)
                bound = ("const", i) if isinstance(i, int) else bounds.get(i)
                if bound is not None:
                    checks.append((attr_index[base.target], dim, bound))
            args = [base, *index]
        if kwargs:
            _fail(kind, f"{node.target}: keyword arguments {sorted(kwargs)} are not supported")
        for a in args[1:] if op == "getitem" else args:
            if isinstance(a, fx.Node) and a.op == "get_attr":
                t = tensors[attr_index[a.target]]
                if t.dim() == 0 and (_name_of(fn, t) != "<captured tensor>" or t._base is not None):
                    # z itself, or z[()]: a view of z, not an element of a tensor the kernel can index
                    _fail(kind, f"captured tensor {_name_of(fn, t)!r} has no dimension, and captured tensors are "
                                "read by index: capture it with one element (z.reshape(1)) and read z[0]", ValueError)
                if t.dim() == 0:
                    _fail(kind, "a 0-dim tensor made while the mod was traced (torch.tensor(0.5), or t[0] * 2 in "
                                "t[0] * 2 * score: Python runs it before the score takes part) is no tensor the kernel "
                                "can read; use a Python number, or let the arguments take part first "
                                "(score * t[0] * 2)", ValueError)
                _fail(kind, f"captured tensor {_name_of(fn, t)!r} is used without indexing; index it with one "
                            "expression per dimension", ValueError)
        if op == "clamp" and len(args) == 3 and any(isinstance(a, fx.Node) for a in args[1:]) and any(
                isinstance(a, (int, float)) for a in args[1:]):
            # torch reads both bounds as numbers then, calling .item() on the tensor: no per-score bound.
            _fail(kind, "clamp: one bound is a tensor and the other a number; torch takes both as tensors or both as "
                        "numbers: clamp one side at a time (torch.clamp(x, min=lo).clamp(max=1.0)) or use "
                        "torch.minimum/torch.maximum", ValueError)
        try:
            result = _run_meta(op, [meta[a] if isinstance(a, fx.Node) else a for a in args])
        except Exception as e:
            _fail(kind, f"{op} fails on its arguments ({type(e).__name__}: {e})")
        if not isinstance(result, torch.Tensor) or result.shape != ():
            _fail(kind, f"{op} gives shape {tuple(getattr(result, 'shape', ()))}, not a scalar per score", ValueError)
        if result.dtype not in DTYPE_NAMES:
            _fail(kind, f"{op} gives dtype {result.dtype}, which the kernel does not compute in")
        meta[node] = result
        if result.dtype == torch.bool:
            conditions[node] = _condition(op, args, bounds)
        elif not result.dtype.is_floating_point:
            bound = _bound(op, args, bounds, conditions)
            if bound is not None:
                bounds[node] = bound
        names[node] = f"v{values}"
        values += 1
        lines.append(f"{names[node]}:{DTYPE_NAMES[result.dtype]}={op}({','.join(arg(a, node) for a in args)})")

    output = next(n for n in graph.nodes if n.op == "output").args[0]
    if isinstance(output, fx.Node):
        if output.op == "get_attr":
            _fail(kind, "returns a captured tensor itself", ValueError)
        dtype = meta[output].dtype
        returned = names[output]
    elif isinstance(output, (bool, int, float)):
        dtype = torch.bool if isinstance(output, bool) else torch.float32 if isinstance(output, float) else torch.int64
        returned = repr(output)
    else:
        _fail(kind, f"returns {type(output).__name__}, expected a scalar tensor")
    if kind == "mask_mod" and dtype != torch.bool:
        _fail(kind, f"returns {dtype}, expected torch.bool (True keeps the score)")
    if kind == "score_mod" and not dtype.is_floating_point:
        _fail(kind, f"returns {dtype}, expected a floating score")
    header = [kind] + [f"t{i}={DTYPE_NAMES[t.dtype]}[{t.dim()}]" for i, t in enumerate(tensors)]
    canonical = ";".join(header + lines + [f"return {returned}"])
    try:
        check_types(canonical)
    except ModTypeError as e:
        _fail(kind, str(e), ValueError)
    return TracedMod(kind, canonical, tuple(tensors), tuple(_name_of(fn, t) for t in tensors), tuple(checks))


def _not_strided(name: str, t: torch.Tensor) -> str:
    """Why a captured tensor of another layout is refused: the kernel reads an element at its pointer and strides."""
    return (f"captured tensor {name!r} has layout {t.layout}; captured tensors must be strided (dense) tensors, "
            "which the kernel reads by pointer and strides: capture its .to_dense()")


def _op_of(node: fx.Node) -> str | None:
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


class _Tracer(fx.Tracer):
    """fx's tracer, for a mod's captured values: an ``nn.Parameter`` the mod closes over (learned ALiBi slopes, a
    bias table) is a captured tensor like any other, where fx takes parameters from the traced module alone;
    a NumPy or enum number is the Python number it stands for; an element of a captured tensor read at constant
    indices (``temperature[0]``, which Python evaluates before fx sees it: a 0-dim view) is that tensor read there,
    at every call."""

    def __init__(self, fn: Callable | None = None):
        super().__init__()
        self._fn, self._reached = fn, None

    def create_arg(self, a):
        if isinstance(a, torch.Tensor) and a.dim() == 0 and a._base is not None:
            found = self._element_of(a)
            if found is not None:
                base, index = found
                return self.create_node("call_function", operator.getitem, (self.create_arg(base), index), {})
        if isinstance(a, torch.nn.Parameter) and all(a is not p for p in self.root.parameters()):
            name = self.tensor_attrs.get(a)
            if name is None:
                name = f"_captured_parameter{len(self.tensor_attrs)}"
                while hasattr(self.root, name):
                    name += "_"
                self.root.register_parameter(name, a)
                self.tensor_attrs[a] = name
            return self.create_node("get_attr", name, (), {})
        return super().create_arg(_python_number(a))

    def _element_of(self, a: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """The tensor of at least one dimension that the 0-dim view ``a`` is an element of, and its index: one the mod
        reaches (the tensor it indexed) first, else the view's base."""
        if self._reached is None:
            self._reached = _reachable_tensors(self._fn) if self._fn is not None else []
        root = a._base
        for t in (*self._reached, root):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.layout != torch.strided or t.dtype != a.dtype:
                continue
            if t is not root and t._base is not root:  # not the view's memory
                continue
            index = _index_of(t, a.storage_offset() - t.storage_offset())
            if index is not None:
                return t, index
        return None


def _index_of(t: torch.Tensor, offset: int) -> tuple[int, ...] | None:
    """The index of ``t`` whose element lies ``offset`` elements past its first, if one does."""
    if offset < 0:
        return None
    index = [0] * t.dim()
    for d in sorted(range(t.dim()), key=lambda d: -t.stride(d)):
        if t.stride(d) > 0 and t.shape[d] > 1:
            index[d] = min(offset // t.stride(d), t.shape[d] - 1)
            offset -= index[d] * t.stride(d)
    return tuple(index) if offset == 0 else None


def _reachable_tensors(fn) -> list[torch.Tensor]:
    """The tensors a mod reaches: through its closure, globals and defaults (``_captured_values``), and a module's
    parameters and buffers."""
    found = [value for _, value, _ in _captured_values(fn) if isinstance(value, torch.Tensor)]
    owner = fn.__self__ if isinstance(fn, types.MethodType) else fn
    if isinstance(owner, torch.nn.Module):
        found += [*owner.parameters(), *owner.buffers()]
    return found


def _python_number(a):
    """A NumPy scalar or an enum member as the Python int or float it stands for, so the text writes it as a
    number (``repr`` of an ``IntEnum`` is not one) and torch promotes it as a Python number."""
    if type(a) in (bool, int, float) or not isinstance(a, numbers.Number):
        return a
    if isinstance(a, numbers.Integral):
        return int(a)
    return float(a) if isinstance(a, numbers.Real) else a


def _with_roles(fn: Callable, kind: str) -> Callable:
    """What ``torch.fx`` traces: ``fn`` itself, or, for a function whose parameters after the roles all have
    defaults (``lambda s, b, h, q, k, t=table: ...``, the idiom that binds a loop variable), a function of the
    roles alone that calls it, so the defaults are read as a closure's values are (FlexAttention calls a mod with
    the roles alone too)."""
    if isinstance(fn, types.MethodType):  # fx traces functions and modules; a bound method through a call of it
        return _score_call(fn) if kind == "score_mod" else _mask_call(fn)
    if not isinstance(fn, types.FunctionType):
        return fn
    roles = ROLES[kind]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in inspect.signature(fn).parameters.values() if p.kind in kinds]
    extra = positional[len(roles):]
    if not extra or any(p.default is inspect.Parameter.empty for p in extra):
        return fn
    return _score_call(fn) if kind == "score_mod" else _mask_call(fn)


def _score_call(fn: Callable) -> Callable:
    return lambda score, b, h, q_idx, kv_idx: fn(score, b, h, q_idx, kv_idx)


def _mask_call(fn: Callable) -> Callable:
    return lambda b, h, q_idx, kv_idx: fn(b, h, q_idx, kv_idx)


def _bound(op: str, args: list, bounds: dict, conditions: dict) -> tuple | None:
    """An integer value as an expression the host can bound (``_interval``): roles and integer constants under
    + - * // % (by a positive constant), unary -, abs, minimum, maximum, clamp, where, casts of integers, and bools
    (0 or 1). None for anything else (a value read from a captured tensor, a float cast back): an index built from
    it is not checked on the host, and the kernel masks its reads."""
    def of(a):
        if isinstance(a, fx.Node):
            return ("bool", conditions[a]) if a in conditions else bounds.get(a)
        return ("const", a) if isinstance(a, int) and not isinstance(a, bool) else None

    if op == "clamp":
        x, low, high = (of(a) if a is not None else ("none",) for a in args)
        return None if None in (x, low, high) else ("clamp", x, low, high)
    if op == "where":
        operands = (of(args[1]), of(args[2]))
        condition = conditions.get(args[0]) if isinstance(args[0], fx.Node) else None
        return None if None in operands else ("where", condition, *operands)
    if op == "to":
        return of(args[0])  # an integer result: of an integer or a bool (a float cast has no bound)
    operands = tuple(of(a) for a in args)
    if None in operands:
        return None
    if op in ("add", "sub", "mul", "minimum", "maximum", "neg", "abs"):
        return (op, *operands)
    if op in ("floordiv", "mod") and operands[1][0] == "const" and operands[1][1] > 0:
        return (op, *operands)
    return None


_COMPARISONS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def _condition(op: str, args: list, bounds: dict) -> tuple | None:
    """A bool value that compares two bounded integers (``q_idx >= kv_idx``), which ``where`` splits positions
    on; None for any other bool."""
    if op not in _COMPARISONS:
        return None
    sides = [bounds.get(a) if isinstance(a, fx.Node) else ("const", a) if type(a) is int else None for a in args]
    return None if None in sides else ("cmp", op, *sides)


class _Domain:
    """The positions of a call that a mod's value reaches: ``b`` and ``h`` over their counts, and (``q_idx``,
    ``kv_idx``) over a polygon, the rectangle of their counts cut by half-planes ``u q + v kv <= c`` whose
    ``(u, v)`` are (+-1, 0), (0, +-1) or +-(1, -1) (the built-in masks, a ``where`` condition), so that its
    vertices are integer positions and a linear function's extremes over it are reached."""

    def __init__(self, ranges: CallRanges, vertices=None):
        self.sizes = ranges
        self.empty = min(ranges.b, ranges.h, ranges.q_idx, ranges.kv_idx) <= 0
        self.pairs = ranges.band != "unknown"  # whether the (q_idx, kv_idx) pairs are the polygon's
        if vertices is None and not self.empty:
            n_q, n_k = ranges.q_idx - 1, ranges.kv_idx - 1
            vertices = [(0, 0), (n_q, 0), (n_q, n_k), (0, n_k)]
            low, high = ranges.band if self.pairs and ranges.band else (None, None)
            for cut in ((-1, 1, high), (1, -1, None if low is None else -low)):
                if cut[2] is not None:
                    vertices = _clip(vertices, *cut)
        self.vertices = vertices or []
        self.empty = self.empty or not self.vertices

    def cut(self, u: int, v: int, c: int) -> _Domain:
        return _Domain(self.sizes, _clip(self.vertices, u, v, c) or [])


def _clip(vertices: list, u: int, v: int, c: int) -> list:
    """The polygon ``vertices`` (in order) cut to ``u q + v kv <= c`` (Sutherland and Hodgman)."""
    out = []
    for i, p in enumerate(vertices):
        nxt = vertices[(i + 1) % len(vertices)]
        fp, fn = u * p[0] + v * p[1], u * nxt[0] + v * nxt[1]
        if fp <= c:
            out.append(p)
        if (fp <= c) != (fn <= c):
            # Every edge lies on a line q = c, kv = c or q - kv = c, as the cut does: two such lines that cross
            # meet at an integer position, so the fraction is a whole number.
            t = Fraction(c - fp, fn - fp)
            out.append((int(p[0] + t * (nxt[0] - p[0])), int(p[1] + t * (nxt[1] - p[1]))))
    return out


def _affine(bound: tuple) -> dict[str, int] | None:
    """``bound`` as ``{role: coefficient, "": constant}`` when it is linear in the roles, else None."""
    op, *args = bound
    if op == "const":
        return {"": args[0]}
    if op == "role":
        return {args[0]: 1, "": 0}
    if op == "neg":
        a = _affine(args[0])
        return None if a is None else {key: -value for key, value in a.items()}
    if op in ("add", "sub", "mul"):
        a, b = _affine(args[0]), _affine(args[1])
        if a is None or b is None:
            return None
        if op == "mul":
            if set(b) == {""}:
                a, b = b, a
            return {key: a[""] * value for key, value in b.items()} if set(a) == {""} else None
        sign = 1 if op == "add" else -1
        return {key: a.get(key, 0) + sign * b.get(key, 0) for key in {*a, *b}}
    return None


def _half_plane(condition: tuple | None) -> tuple[int, int, int] | None:
    """``(u, v, c)`` with ``u q_idx + v kv_idx <= c`` exactly where ``condition`` holds, when it is such a cut."""
    if condition is None:
        return None
    _, op, left, right = condition
    a, b = _affine(left), _affine(right)
    if a is None or b is None:
        return None
    # left - right as u q + v kv + k; ">" and ">=" as right - left.
    sign = 1 if op in ("lt", "le") else -1
    diff = {key: sign * (a.get(key, 0) - b.get(key, 0)) for key in {*a, *b}}
    if any(diff.get(role, 0) for role in ("b", "h")):
        return None
    u, v, k = diff.get("q_idx", 0), diff.get("kv_idx", 0), diff.get("", 0)
    bound = -k - (1 if op in ("lt", "gt") else 0)  # integers: x < y is x <= y - 1
    g = max(abs(u), abs(v))
    if g == 0 or (u, v) not in ((g, 0), (-g, 0), (0, g), (0, -g), (g, -g), (-g, g)):
        return None
    return u // g, v // g, bound // g


def _interval(bound: tuple, domain: _Domain) -> tuple[int, int] | None:
    """``bound``'s smallest and largest value over ``domain`` (not empty); None when it cannot be told (a
    ``where`` whose branches are not both bounded over the positions that take them)."""
    affine = _affine(bound)
    if affine is not None:
        low = high = affine.get("", 0)
        for role in ("b", "h"):
            reach = affine.get(role, 0) * (getattr(domain.sizes, role) - 1)
            low, high = low + min(0, reach), high + max(0, reach)
        u, v = affine.get("q_idx", 0), affine.get("kv_idx", 0)
        if u and v and not domain.pairs:
            return None
        if u or v:
            values = [u * q + v * kv for q, kv in domain.vertices]
            low, high = low + min(values), high + max(values)
        return low, high
    op, *args = bound
    if op == "bool":
        return 0, 1
    if op == "where":
        cut = _half_plane(args[0])
        if cut is None or (cut[0] and cut[1] and not domain.pairs):
            return None  # the branches' positions cannot be told apart: no check rather than a wrong refusal
        spans = []
        for branch, part in ((args[1], domain.cut(*cut)), (args[2], domain.cut(-cut[0], -cut[1], -cut[2] - 1))):
            if not part.empty:
                span = _interval(branch, part)
                if span is None:
                    return None
                spans.append(span)
        return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None
    if op == "clamp":
        x, low, high = (None if a == ("none",) else _interval(a, domain) for a in args)
        if x is None or (args[1] != ("none",) and low is None) or (args[2] != ("none",) and high is None):
            return None
        lo, hi = x
        if low is not None:
            lo, hi = max(lo, low[0]), max(hi, low[1])
        if high is not None:
            lo, hi = min(lo, high[0]), min(hi, high[1])
        return lo, hi
    spans = [_interval(a, domain) for a in args]
    if None in spans:
        return None
    a = spans[0]
    if op == "neg":
        return -a[1], -a[0]
    if op == "abs":
        return (a[0], a[1]) if a[0] >= 0 else (-a[1], -a[0]) if a[1] <= 0 else (0, max(-a[0], a[1]))
    b = spans[1]
    if op == "add":
        return a[0] + b[0], a[1] + b[1]
    if op == "sub":
        return a[0] - b[1], a[1] - b[0]
    if op == "mul":
        products = [x * y for x in a for y in b]
        return min(products), max(products)
    if op in ("minimum", "maximum"):
        pick = min if op == "minimum" else max
        return pick(a[0], b[0]), pick(a[1], b[1])
    c = b[0]  # floordiv, mod: a positive constant
    if op == "floordiv":
        return a[0] // c, a[1] // c
    return (a[0] % c, a[1] % c) if a[0] // c == a[1] // c else (0, c - 1)


def _text(bound: tuple) -> str:
    """``bound`` as the mod's source would write it (roles by their names), for errors."""
    op, *args = bound
    if op in ("const", "role"):
        return str(args[0])
    if op == "bool":
        return "a bool" if args[0] is None else _text(args[0])
    if op == "cmp":
        return f"{_text(args[1])} {_COMPARISONS[args[0]]} {_text(args[2])}"
    if op == "where":
        condition = "a bool" if args[0] is None else _text(args[0])
        return f"where({condition}, {_text(args[1])}, {_text(args[2])})"
    parts = [_text(a) if a[0] in ("const", "role") else f"({_text(a)})" for a in args]
    if op == "add" and args[1][0] == "const" and args[1][1] < 0:
        return f"{parts[0]} - {-args[1][1]}"
    infix = {"add": "+", "sub": "-", "mul": "*", "floordiv": "//", "mod": "%"}
    if op in infix:
        left = _text(args[0]) if op in ("add", "sub") else parts[0]
        return f"{left} {infix[op]} {parts[1]}"
    if op == "neg":
        return f"-{parts[0]}"
    if op == "clamp":
        return f"clamp({', '.join('None' if a == ('none',) else _text(a) for a in args)})"
    return f"{op}({', '.join(_text(a) for a in args)})"


def _run_meta(op: str, args: list) -> Any:
    """The op on meta tensors: its result's dtype and shape with torch's own promotion rules."""
    simple = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
              "neg": operator.neg, "abs": operator.abs, "floordiv": operator.floordiv, "mod": operator.mod,
              "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
              "ne": operator.ne, "and": operator.and_, "or": operator.or_, "not": operator.invert,
              "where": torch.where, "tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
              "minimum": torch.minimum, "maximum": torch.maximum}
    if op in simple:
        return simple[op](*args)
    if op == "clamp":
        return torch.clamp(args[0], min=args[1], max=args[2])
    if op == "to":
        return args[0].to(args[1])
    if op == "getitem":
        # One integer per dimension (checked by the caller): a scalar of the tensor's type. Meta tensors
        # cannot be indexed by tensors (that reads their values).
        return torch.empty((), dtype=args[0].dtype, device="meta")
    raise AssertionError(op)


def _name_of(fn, t: torch.Tensor) -> str:
    """The name the function knows a captured tensor by (a closure variable or a global)."""
    for name, value, _ in _captured_values(fn):
        if value is t:
            return name
    owner = fn.__self__ if isinstance(fn, types.MethodType) else fn
    found = (*owner.named_parameters(), *owner.named_buffers()) if isinstance(owner, torch.nn.Module) else ()
    for name, value in (*found, *getattr(owner, "__dict__", {}).items()):
        if value is t:
            return f"self.{name}"
    return "<captured tensor>"


def _captured_values(fn, depth: int = 0, path: tuple = ()):
    """``(name, value, path)`` of every value ``fn`` reaches: its closure cells (and, for helpers it calls, theirs),
    the globals it names, its defaults; ``path``: the steps from ``fn`` that ``fetch`` follows."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for i, (name, cell) in enumerate(zip(code.co_freevars, fn.__closure__ or ())):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        step = (*path, ("closure", i))
        yield name, value, step
        if callable(value) and depth < 2:  # helpers the mod calls may capture tensors of their own
            yield from _captured_values(value, depth + 1, step)
    for name in code.co_names:
        if name in fn.__globals__:
            value = fn.__globals__[name]
            step = (*path, ("global", name))
            yield name, value, step
            yield from _numbers_inside(value, code, step)
            if callable(value) and depth < 2:  # a helper named as a global: its own globals and cells
                yield from _captured_values(value, depth + 1, step)
    defaults = fn.__defaults__ or ()
    for i, value in enumerate(defaults):
        step = (*path, ("default", i))
        yield code.co_varnames[code.co_argcount - len(defaults) + i], value, step
        yield from _numbers_inside(value, code, step)


_NUMBERS = (bool, int, float, str)


def _numbers_inside(value, code, path: tuple):
    """The numbers ``code`` may read one step inside ``value``: an attribute it names of an object or a class
    (``cfg.scale``, ``Config.C``), an item of a dict at a key among its constants (``table["c"]``); read without
    running a property or ``__getattr__``. Only numbers: a tensor reached so stays unfollowed (``locate``)."""
    if isinstance(value, (torch.Tensor, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)) or (
            type(value) in _NUMBERS or value is None):
        return
    if type(value) is dict:
        for key in code.co_consts:
            if type(key) in (int, str) and key in value and type(value[key]) in _NUMBERS:
                yield repr(key), value[key], (*path, ("item", key))
        return
    if isinstance(value, type):
        if value.__module__.partition(".")[0] in _LIBRARIES:
            return
        attributes = {}
    else:
        attributes = getattr(value, "__dict__", None)
        if not isinstance(attributes, dict):
            return
    for name in code.co_names:
        found = _attribute(value, attributes, name)
        if found is _MISSING:
            found = inspect.getattr_static(value if isinstance(value, type) else type(value), name, _MISSING)
        if type(found) in _NUMBERS:
            yield name, found, (*path, ("attr", name))


def locate(fn, t: torch.Tensor) -> tuple | None:
    """Where ``fn`` reaches the captured tensor ``t``, as steps ``fetch`` follows (``("closure", i)``,
    ``("module", (module, name))`` or ``("global", name)``, ``("default", i)``); None if elsewhere (an attribute
    of a captured object, an element of a list)."""
    for _, value, path in _captured_values(fn):
        if value is t:
            return _followable(fn, path)
    return None


def number_paths(fn) -> tuple[tuple[tuple, Any], ...]:
    """``(path, value)`` of each Python number, bool or string ``fn`` reads as a module's global or a default, or one
    step inside one (``_numbers_inside``): values its text holds as constants, which a compiled graph is guarded on
    (``tilegen.mods.compiled``). What a closure holds is left out: Dynamo cannot read the cells of a function made
    inside the compiled region."""
    found = ((_followable(fn, path), value) for _, value, path in _captured_values(fn) if type(value) in _NUMBERS)
    return tuple((path, value) for path, value in found if _root(path)[-1][0] in ("module", "default"))


def _root(path: tuple) -> tuple:
    """``path`` up to the value an attribute or item is read from."""
    end = len(path)
    while end and path[end - 1][0] in ("attr", "item"):
        end -= 1
    return path[:end]


def _followable(fn, path: tuple) -> tuple:
    """``path``, a global reached through its module where there is one: torch.compile follows sys.modules for a
    function made inside the compiled region too, where it has no __globals__ to follow."""
    root = _root(path)
    if root != path:
        return (*_followable(fn, root), *path[len(root):])
    *before, (step, name) = path
    if step == "global":
        owner = fetch(fn, tuple(before))
        module = sys.modules.get(getattr(owner, "__module__", None) or "")
        if module is not None and vars(module) is owner.__globals__:
            return (*before, ("module", (owner.__module__, name)))
    return path


def fetch(fn, path: tuple) -> torch.Tensor:
    """The tensor at ``locate``'s ``path`` from ``fn``. Under ``torch.compile`` this is traced: Dynamo reads the
    cell, global or default as a graph input, so each call of the compiled graph passes its tensor of the moment."""
    for step, key in path:
        if step == "closure":
            fn = fn.__closure__[key].cell_contents
        elif step == "module":
            fn = sys.modules[key[0]].__dict__[key[1]]
        elif step == "global":
            fn = fn.__globals__[key]
        elif step == "attr":
            fn = getattr(fn, key)
        elif step == "item":
            fn = fn[key]
        else:
            fn = fn.__defaults__[key]
    return fn


class _Opaque(Exception):
    """The mod reaches state ``_state`` does not follow."""


class _Same:
    """An object in a signature, equal to another only when it is the same live object. Held by a weak
    reference where the object takes one: a signature is the value of a cache keyed weakly by the mod, which
    it must not keep alive, and a dead reference equals nothing, so a new object at a freed one's address is
    never taken for it."""

    __slots__ = ("ref",)

    def __init__(self, obj):
        try:
            self.ref = weakref.ref(obj)
        except TypeError:  # code objects, ints: held (they hold no mod)
            self.ref = lambda obj=obj: obj

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and (mine := self.ref()) is not None and mine is other.ref()

    def __hash__(self) -> int:
        return id(self.ref())


# How much of what a mod reaches ``_state`` walks at a call before it gives up (then the mod is traced anew at
# every call): enough for a module's parameters and a configuration object, little host time per call.
_STATE_BUDGET = 512
_IDENTITIES = (torch.dtype, torch.device, types.BuiltinFunctionType, types.BuiltinMethodType,
               torch._ops.OpOverloadPacket, torch._ops.OpOverload, enum.Enum)
_SCALARS = (bool, int, float, complex, str, bytes)
# Packages whose classes' attributes are not the mod's state (and would exhaust the budget).
_LIBRARIES = ("builtins", "torch", "typing", "abc", "numpy", "enum", "functools", "collections", "math",
              "operator", "triton")


class _Walk:
    """One reading of what a mod reaches: the budget left, the ids of the tensors the kernel is handed, and the
    ids of every tensor reached."""

    __slots__ = ("budget", "kernel", "reached", "modules")

    def __init__(self, kernel: frozenset):
        self.budget, self.kernel, self.reached, self.modules = _STATE_BUDGET, kernel, set(), set()


def _signature(fn, walk: _Walk) -> tuple | None:
    """What a trace depends on, read at every call: every tensor ``fn`` reaches (the object, its shape and dtype,
    and its version but for one the kernel is handed whose values the trace did not read, ``walk.kernel`` holding
    their ids: the trace may have read its values, as ``t.item()`` does), the value of every Python number, string
    or dtype (the trace writes numbers into the text), and every function it calls, through closure cells, the
    globals each function's code names (nested code included), the attributes of modules it names, defaults, the
    attributes of objects and ``nn.Module``s and of their classes (``self.bias``, a class constant, a property),
    and containers. None when ``fn`` reaches something this does not follow (or too much): such a mod is traced
    at every call."""
    try:
        return _state(fn, 0, walk)
    except (_Opaque, RecursionError):
        return None


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has none
        return -1


@functools.lru_cache(maxsize=1024)
def _code_names(code: types.CodeType) -> tuple[str, ...]:
    """The names a function's code reads as globals or attributes, its nested code's (a comprehension, an inner
    function) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_code_names(const))
        elif isinstance(const, str) and const.isidentifier():  # getattr(self, "scale")
            names.add(const)
    return tuple(sorted(names))


def _reach_names(fn: types.FunctionType, depth: int = 0) -> tuple[str, ...]:
    """The names ``fn``'s code reads, and those of the functions it calls by a global or closure name: a helper
    that reads an attribute of an object the mod hands it (``scale_of(cfg)`` reading ``cfg.scale``) makes that
    attribute part of what the walk reads on ``cfg``."""
    names = set(_code_names(fn.__code__))
    if depth < 2:
        helpers = [fn.__globals__.get(name) for name in names]
        for cell in fn.__closure__ or ():
            try:
                helpers.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        for helper in helpers:
            if isinstance(helper, types.FunctionType) and helper is not fn:
                names.update(_reach_names(helper, depth + 1))
    return tuple(sorted(names))


def _state(value, depth: int, walk: _Walk, names: tuple[str, ...] = ()) -> Any:
    walk.budget -= 1
    if walk.budget < 0 or depth > 8:
        raise _Opaque
    deeper = depth + 1
    if isinstance(value, torch.Tensor):
        walk.reached.add(id(value))
        return _Same(value), value.shape, value.dtype, None if id(value) in walk.kernel else _version(value)
    if value is None or isinstance(value, _SCALARS) or type(value).__module__ == "numpy" and isinstance(
            value, numbers.Number):
        return value.__class__, value
    if isinstance(value, _IDENTITIES):
        return _Same(value)
    if isinstance(value, type):  # a class the code names (Config.scale): its own attributes, torch's by identity
        return _class_state(value, deeper, walk, names)
    if isinstance(value, types.ModuleType):
        # A module by the attributes the code names (``helpers.scale``, ``torch.where``), once a walk (a module may
        # name itself: torch.torch).
        if id(value) in walk.modules or value.__name__.partition(".")[0] in _LIBRARIES:
            return _Same(value)  # torch.where, math.pi: a library's attributes are not the mod's state
        walk.modules.add(id(value))
        return _Same(value), tuple((name, _state(value.__dict__[name], deeper, walk, names))
                                   for name in names if name in value.__dict__)
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return value.__class__, tuple(_state(x, deeper, walk, names) for x in items)
    if isinstance(value, dict):
        return dict, tuple((_state(k, deeper, walk), _state(v, deeper, walk, names)) for k, v in value.items())
    if isinstance(value, types.FunctionType):
        code = value.__code__
        read = _reach_names(value)
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(_state(cell.cell_contents, deeper, walk, read))
            except ValueError:  # an empty cell
                cells.append(None)
        named = tuple((name, _state(value.__globals__[name], deeper, walk, read)) for name in read
                      if name in value.__globals__)
        return (_Same(value), _Same(code), tuple(cells), named, _state(value.__defaults__, deeper, walk, read),
                _state(value.__kwdefaults__, deeper, walk, read))
    if isinstance(value, types.MethodType):
        return _state(value.__func__, deeper, walk), _state(value.__self__, deeper, walk)
    if isinstance(value, functools.partial):
        return (_state(value.func, deeper, walk), _state(value.args, deeper, walk, names),
                _state(value.keywords, deeper, walk, names))
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and not hasattr(value.__class__, "__slots__"):
        # An object (an nn.Module, a configuration): the attributes its readers' code and its class's methods
        # name (a buffer no code reads, counting steps, changes nothing), and its classes' (constants,
        # properties, what its call runs).
        read = tuple(sorted({*names, *_method_names(value.__class__)}))
        found = tuple((name, _state(attribute, deeper, walk, read)) for name in read
                      if (attribute := _attribute(value, attributes, name)) is not _MISSING)
        return _Same(value), found, _class_state(value.__class__, deeper, walk, read)
    raise _Opaque


_MISSING = object()


def _attribute(value, attributes: dict, name: str):
    """``value.name`` as an instance holds it (an ``nn.Module``'s parameters, buffers and submodules too), without
    running a property or ``__getattr__``; ``_MISSING`` where it holds none."""
    if name in attributes:
        return attributes[name]
    if isinstance(value, torch.nn.Module):
        for table in ("_parameters", "_buffers", "_modules"):
            if name in attributes.get(table, ()):
                return attributes[table][name]
    return _MISSING


_METHOD_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per class, kept only while it lives


def _method_names(cls: type) -> tuple[str, ...]:
    """The names the code of a class's methods (and properties, and an ``nn.Module``'s ``forward``) reads."""
    found = _METHOD_NAMES.get(cls)
    if found is None:
        found = _METHOD_NAMES[cls] = _class_code_names(cls)
    return found


def _class_code_names(cls: type) -> tuple[str, ...]:
    # Not the special methods' (__init__ names every buffer it registers; none of them runs in a call of the mod).
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or klass is torch.nn.Module:
            continue
        for name, member in vars(klass).items():
            if name.startswith("__") and name != "__call__":
                continue
            member = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if isinstance(member, types.FunctionType):
                names.update(_code_names(member.__code__))
    return tuple(sorted(names))


def _class_state(cls: type, depth: int, walk: _Walk, names: tuple[str, ...] = ()) -> tuple:
    """The attributes a class and its bases define, but for library classes (``nn.Module``'s machinery, NumPy's)
    and dunder names, each read with ``names`` (the code reading the class); what ``_state`` does not follow
    there counts as the object itself."""
    found = []
    for klass in cls.__mro__:
        if klass.__module__.partition(".")[0] in _LIBRARIES:
            continue
        for name, value in vars(klass).items():
            if name.startswith("__"):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            try:
                found.append((name, _state(value, depth, walk, names)))
            except _Opaque:
                if walk.budget < 0:
                    raise
                found.append((name, _Same(value)))
    return _Same(cls), tuple(found)


def _storage(t: torch.Tensor):
    """The memory ``t`` views (shared with its base and the other views of it, as the version counter is)."""
    try:
        return t.device, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage: taken as read
        return None


class _ValuesRead(TorchDispatchMode):
    """The storages whose values torch operations read while a mod is traced: Python runs an operation that involves
    no traced argument (``docs + 1``, ``slopes[0].item()``) on the tensor itself. A view reads no value."""

    # A CPU tensor's values are read by these with no torch operation (a GPU tensor's through a copy to the host, which
    # is one): they are watched while the mod is traced.
    _READERS = ("tolist", "numpy", "__array__", "__dlpack__")

    def __init__(self):
        super().__init__()
        self.storages: set = {None}
        self._readers: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.storages.update(_storage(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))

    def _watched(self, read):
        def reader(t, *args, **kwargs):
            self.storages.add(_storage(t))
            return read(t, *args, **kwargs)
        return reader

    def __enter__(self):
        entered = super().__enter__()
        for name in self._READERS:
            # Restored as found: most are torch._C.TensorBase's, inherited, not torch.Tensor's own.
            self._readers[name] = vars(torch.Tensor).get(name)
            setattr(torch.Tensor, name, self._watched(getattr(torch.Tensor, name)))
        return entered

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, read in self._readers.items():
                if read is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, read)
            self._readers.clear()


_traced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_untraceable: weakref.WeakSet = weakref.WeakSet()  # functions warned of


def traced(fn: Callable, kind: str) -> TracedMod:
    """``trace``, cached per function object while ``_signature`` reads the same; a function it cannot follow is
    traced at every call (with one warning: milliseconds of host time a call). A bound method is cached per
    instance and function: ``self.score_mod`` is a new method object at every read."""
    owner, key = (fn.__self__, (fn.__func__, kind)) if isinstance(fn, types.MethodType) else (fn, kind)
    entries = _entries(owner)
    if entries is None:  # not weak-referenceable: trace every call
        return trace(fn, kind)
    cached = entries.get(key)
    if cached is not None:
        signature, result, kernel = cached
        if signature == _signature(fn, _Walk(kernel)):
            return result
    with _ValuesRead() as read:
        result = trace(fn, kind)
    # A tensor the trace read values of (slopes[0].item(), docs + 1) as well as handing it to the kernel keeps its
    # version in the signature: the text's numbers and the tensors computed from it hold its values of that trace.
    kernel = frozenset(id(t) for t in result.tensors if _storage(t) not in read.storages)
    walk = _Walk(kernel)
    signature = _signature(fn, walk)
    if signature is None:
        _warn_untraceable(owner, fn, kind)
        return result
    for name, t in zip(result.names, result.tensors):
        if id(t) not in walk.reached and t.grad_fn is not None:
            # Made from other tensors while fx traced (torch.exp(t)[h] runs torch.exp then): its gradient would
            # flow through that one computation, already freed at the next call's backward.
            what = "a captured tensor" if name == "<captured tensor>" else f"captured tensor {name!r}"
            _fail(kind, f"{what} was computed from other tensors when the mod was traced "
                        f"({t.grad_fn.name()}), outside the kernel, so gradients through it are not supported; "
                        "index the tensor first and compute inside the mod (torch.exp(log_slopes[h]), not "
                        "torch.exp(log_slopes)[h])", ValueError)
    entries[key] = (signature, result, kernel)  # kernel: the ids a cache hit's walk versions apart
    return result


_by_id: dict[int, tuple[weakref.ref, dict]] = {}  # the traces of mods that take weak references but no hash


def _entries(owner) -> dict | None:
    """The cached traces of a mod (or of a bound method's instance), kept while it lives; None for an object
    without weak references."""
    try:
        return _traced.setdefault(owner, {})
    except TypeError:  # unhashable (a dataclass instance): kept by its id while a weak reference says it lives
        pass
    held = _by_id.get(id(owner))
    if held is not None and held[0]() is owner:
        return held[1]
    try:
        ref = weakref.ref(owner, lambda _, key=id(owner): _by_id.pop(key, None))
    except TypeError:
        return None
    _by_id[id(owner)] = (ref, {})
    return _by_id[id(owner)][1]


def _warn_untraceable(owner, fn, kind: str) -> None:
    """One warning per mod (per instance, for a bound method)."""
    try:
        if owner in _untraceable:
            return
        _untraceable.add(owner)
    except TypeError:
        pass
    warnings.warn(f"{kind}: {getattr(fn, '__qualname__', type(fn).__name__)} reaches objects tilegen does not follow "
                  "between calls (or too many), so it is traced again at every call (milliseconds each): capture its "
                  "tensors and numbers in variables it closes over, globals or defaults", stacklevel=4)


@dataclass(frozen=True)
class ModCall:
    """A call's mods: the canonical texts for the spec and the tensors the launcher passes (score mod's first)."""

    score_mod: str | None
    mask_mod: str | None
    tensors: tuple[torch.Tensor, ...]
    mask_tensors: tuple[torch.Tensor, ...] = ()  # the mask mod's, the last of ``tensors``


def bind_mods(score_mod, mask_mod, device: torch.device, ranges: CallRanges) -> ModCall:
    """Trace (or reuse) both mods and check them against a call: device of every captured tensor, index ranges."""
    return bind_traced([traced(fn, kind) if fn is not None else None
                        for fn, kind in ((score_mod, "score_mod"), (mask_mod, "mask_mod"))], device, ranges)


def bind_traced(mods: list[TracedMod | None], device: torch.device, ranges: CallRanges) -> ModCall:
    """``bind_mods`` of mods traced already (the score mod's, then the mask mod's; None where there is none)."""
    tensors: list[torch.Tensor] = []
    for mod in mods:
        if mod is None:
            continue
        for name, t in zip(mod.names, mod.tensors):
            if t.device != device:
                # A tensor the mod's factory built (relative_bias's buckets) stays where it was made: name that too.
                raise ValueError(f"{mod.kind}: captured tensor {name!r} is on {t.device}, the inputs on {device} (a "
                                 "mod's captured tensors stay where they were when it was made: make it after moving "
                                 "them)")
            if t.layout != torch.strided:  # a TracedMod made elsewhere than trace, or under torch.compile
                raise ValueError(f"{mod.kind}: {_not_strided(name, t)}")
        mod.check_ranges(ranges)
        tensors.extend(mod.tensors)
    return ModCall(mods[0].canonical if mods[0] else None, mods[1].canonical if mods[1] else None, tuple(tensors),
                   mods[1].tensors if mods[1] else ())


def wants_grad(q, k, v, tensors) -> bool:
    """Whether a call with mods is differentiated: grad mode on and an input or a captured tensor requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tensors))
