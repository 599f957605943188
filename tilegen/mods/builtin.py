"""Mods that say what a built-in option says, handed to that option instead.

A mask mod that keeps a band of diagonals (``q_idx >= kv_idx``, a sliding window, ``abs(q_idx -
kv_idx) <= w``) is the op's ``causal``/``window``, and a score mod ``c * tanh(score / c)`` is its
``softcap``: the built-ins run the fastest kernels (the Gluon ones on Hopper, which take no mods),
skip masked blocks in closed form and tune apart, so a mod that means the same gets them. The
decision reads the canonical text alone, so it is exact: a band is recognised only as comparisons of
integer affine forms of the two positions, each a function of ``q_idx - kv_idx``, joined by ``&``.
Anything else stays a mod.

FlexAttention's positions are aligned top-left, the built-ins' bottom-right: with ``n_q != n_k`` a
band moves by ``n_k - n_q`` diagonals, and one that then reaches right of the diagonal where the
built-ins cannot say it (a negative side) stays a mod.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

from tilegen.mods.lower import _is_number, parse

__all__ = ["Reduced", "builtin_of", "reduce_builtins", "reduce_mods"]

_INTS = ("int32", "int64", "int16", "int8")


@dataclass(frozen=True)
class Reduced:
    """A call's mask and softcap once the mods that say the same are absorbed; the mods left over."""

    window: tuple[int | None, int | None]  # (left, right) around the bottom-right diagonal, None unbounded
    softcap: float | None
    score_mod: str | None
    mask_mod: str | None


def reduce_mods(score_mod: str | None, mask_mod: str | None, left: int | None, right: int | None,
                softcap: float | None, n_q: int, n_k: int) -> Reduced:
    """``left``/``right``: the call's own window bounds (``window_bounds``); the rest as the op takes them."""
    window, softcap, score_kept, mask_kept = reduce_builtins(
        builtin_of(score_mod, "score_mod"), builtin_of(mask_mod, "mask_mod"), left, right, softcap, n_k - n_q)
    return Reduced(window, softcap, score_mod if score_kept else None, mask_mod if mask_kept else None)


def builtin_of(text: str | None, kind: str):
    """What a mod's canonical text says of the built-ins: a score mod's softcap (0.0 for ``return score``), a mask
    mod's band ``(lo, hi)`` on ``q_idx - kv_idx``; None for neither (or no mod)."""
    if text is None:
        return None
    return _softcap(text) if kind == "score_mod" else _band(text)


def reduce_builtins(cap, band, left, right, softcap, shift):
    """``reduce_mods`` once the texts are read (``builtin_of``): ``(window, softcap, score mod kept, mask mod
    kept)``. Plain arithmetic, so that ``torch.compile`` traces it with the shapes (``shift``) symbolic."""
    score_kept = mask_kept = True
    if cap == 0.0:  # the identity
        score_kept = False
    elif cap is not None and softcap is None:  # a softcap of the call's own would come first
        softcap, score_kept = cap, False
    if band is not None:
        lo, hi = band  # on q_idx - kv_idx, top-left
        band_left = None if hi is None else hi + shift
        band_right = None if lo is None else -(lo + shift)
        if (band_left is None or band_left >= 0) and (band_right is None or band_right >= 0):
            left, right, mask_kept = _tighter(left, band_left), _tighter(right, band_right), False
    return (left, right), softcap, score_kept, mask_kept


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


@functools.lru_cache(maxsize=256)
def _softcap(text: str) -> float | None:
    """``c`` of ``c * tanh(score / c)`` (either factor order), 0.0 for ``return score``; else None."""
    graph = parse(text)
    if not graph.values and graph.result == "score":
        return 0.0
    if len(graph.values) != 3 or graph.tensors:
        return None
    (v0, d0, op0, a0), (v1, d1, op1, a1), (v2, d2, op2, a2) = graph.values
    if (d0, d1, d2) != ("float32",) * 3 or (op0, op1, op2) != ("div", "tanh", "mul") or graph.result != v2:
        return None
    if a0[0] != "score" or not _is_number(a0[1]) or a1 != (v0,) or v1 not in a2:
        return None
    other = a2[1] if a2[0] == v1 else a2[0]
    if not _is_number(other) or float(other) != float(a0[1]):
        return None
    cap = float(other)
    return cap if 0 < cap < math.inf else None


# A linear form over the positions: (coefficient of q_idx, of kv_idx, constant).
_Form = tuple[Fraction, Fraction, Fraction]
# The diagonals a condition keeps, lo <= q_idx - kv_idx <= hi, None unbounded; EMPTY keeps none.
_Interval = tuple[int | None, int | None]
EMPTY = "empty"


@functools.lru_cache(maxsize=256)
def _band(text: str) -> tuple[int | None, int | None] | None:
    """The diagonals a mask mod keeps, ``(lo, hi)`` on ``q_idx - kv_idx``; None if it is not a band."""
    graph = parse(text)
    if graph.tensors:
        return None
    if graph.result == "True":
        return (None, None)
    forms: dict[str, _Form] = {"q_idx": (Fraction(1), Fraction(0), Fraction(0)),
                               "kv_idx": (Fraction(0), Fraction(1), Fraction(0))}
    absolute: dict[str, _Form] = {}  # abs() of a form of q_idx - kv_idx
    kept: dict[str, _Interval | str] = {}

    def form(a: str) -> _Form | None:
        if _is_number(a):
            return (Fraction(0), Fraction(0), Fraction(a)) if a.lstrip("-").isdigit() else None
        return forms.get(a)

    for name, dtype, op, args in graph.values:
        if dtype in _INTS:
            f = _affine(op, args, form)
            if f is not None:
                forms[name] = f
            elif op == "abs" and form(args[0]) is not None and _diagonal(form(args[0])):
                absolute[name] = form(args[0])
            else:
                return None
        elif dtype == "bool":
            if op == "and":
                parts = [kept.get(a) for a in args]
                if any(p is None for p in parts):
                    return None
                kept[name] = _intersect(*parts)
            elif op in ("lt", "le", "gt", "ge", "eq"):
                interval = _compare(op, args, form, absolute)
                if interval is None:
                    return None
                kept[name] = interval
            else:
                return None
        else:
            return None
    result = kept.get(graph.result)
    return None if result is None or result == EMPTY else result


def _affine(op: str, args: tuple[str, ...], form) -> _Form | None:
    if op == "to":
        return form(args[0]) if args[1] in _INTS else None
    fs = [form(a) for a in args]
    if any(f is None for f in fs):
        return None
    if op == "add":
        return tuple(x + y for x, y in zip(*fs))
    if op == "sub":
        return tuple(x - y for x, y in zip(*fs))
    if op == "neg":
        return tuple(-x for x in fs[0])
    if op == "mul":
        constant = [f for f in fs if f[0] == f[1] == 0]
        if not constant:
            return None
        other = fs[1] if fs[0] is constant[0] else fs[0]
        return tuple(x * constant[0][2] for x in other)
    return None


def _diagonal(f: _Form) -> bool:
    """Whether the form depends on the positions through q_idx - kv_idx alone (or not at all)."""
    return f[0] == -f[1]


def _compare(op: str, args, form, absolute) -> _Interval | str | None:
    """The diagonals kept by ``args[0] <op> args[1]``; None if that is not a band."""
    a, b = args
    if a in absolute or b in absolute:
        # |x| <= c (or c >= |x|): -c <= x <= c; the other directions are not bands.
        if a in absolute and form(b) is not None and form(b)[:2] == (0, 0) and op in ("le", "lt"):
            inner, bound, strict = absolute[a], form(b)[2], op == "lt"
        elif b in absolute and form(a) is not None and form(a)[:2] == (0, 0) and op in ("ge", "gt"):
            inner, bound, strict = absolute[b], form(a)[2], op == "gt"
        else:
            return None
        upper = _compare_form(inner, "lt" if strict else "le", bound)
        lower = _compare_form(inner, "gt" if strict else "ge", -bound)
        return _intersect(upper, lower)
    fa, fb = form(a), form(b)
    if fa is None or fb is None:
        return None
    diff = tuple(x - y for x, y in zip(fa, fb))
    if not _diagonal(diff):
        return None
    return _compare_form(diff, op, Fraction(0))


def _compare_form(f: _Form, op: str, bound: Fraction) -> _Interval | str:
    """Diagonals d = q_idx - kv_idx where ``f(d) <op> bound``, f = coef * d + const."""
    coef, const = f[0], f[2]
    if coef == 0:
        holds = {"lt": const < bound, "le": const <= bound, "gt": const > bound, "ge": const >= bound,
                 "eq": const == bound}[op]
        return (None, None) if holds else EMPTY
    x = (bound - const) / coef  # coef * d <op> coef * x
    if coef < 0:
        op = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}[op]
    if op == "eq":
        return (int(x), int(x)) if x.denominator == 1 else EMPTY
    if op == "le":
        return (None, math.floor(x))
    if op == "lt":
        return (None, math.ceil(x) - 1)
    if op == "ge":
        return (math.ceil(x), None)
    return (math.floor(x) + 1, None)  # gt


def _intersect(*parts) -> _Interval | str:
    if EMPTY in parts:
        return EMPTY
    lows = [p[0] for p in parts if p[0] is not None]
    highs = [p[1] for p in parts if p[1] is not None]
    lo, hi = (max(lows) if lows else None), (min(highs) if highs else None)
    return EMPTY if lo is not None and hi is not None and lo > hi else (lo, hi)
