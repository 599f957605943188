"""The derivative of a score mod, by forward-mode differentiation of its canonical graph.

The backward template (``templates/common/mods_grad.py.jinja``) renders ``_score_mod_bwd(ds, score, b, h,
q_idx, kv_idx, ...)``: given ``ds``, the loss's gradient with respect to the mod's result, it returns
``ds * d(result)/d(score)`` and adds ``ds * d(result)/d(element)`` into the fp32 gradient of each captured
float tensor the call differentiates, at the element each gather read. One tangent pass per seed (the score,
then each gather of such a tensor): mods are a few statements, and a pass leaves out every value the seed
does not reach. Integer and bool values have no tangent.
"""

from __future__ import annotations

import functools
import re
import warnings

import torch

from tilegen.mods.lower import (ModGraph, _at_bounds, _depends_on, _is_number, _saturating_gathers, followed, lower_mod,
                                mod_ref, parse, positions)

__all__ = ["ATOMICS", "ModGradError", "check_differentiable", "grad_tensors", "lower_score_mod_grad", "mod_grad_values",
           "warned_of_atomics"]

ATOMICS = ("the gradients of a score mod's captured tensors are accumulated with atomic adds, in no fixed order, "
           "which torch.use_deterministic_algorithms(True)")


def warned_of_atomics() -> bool:
    """Under ``torch.use_deterministic_algorithms(True, warn_only=True)``: warns that a captured tensor's gradient
    is summed by atomic adds, and returns True; False where the flag forbids them."""
    if not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    warnings.warn(f"tilegen: {ATOMICS} warns of; the backward runs with atomics", stacklevel=6)
    return True

_FLOATS = ("float32", "float16", "bfloat16")


class ModGradError(NotImplementedError):
    """A score mod whose derivative tilegen cannot form (raised before any kernel runs)."""


def _tangents(graph: ModGraph, seed: str, tag: str, prefix: str) -> tuple[list[str], str | None]:
    """Statements ``{tag}_vN = d(vN)/d(seed)`` for the values the seed reaches, and the result's tangent (None:
    zero). The values themselves are the forward statements' names."""
    d: dict[str, str] = {seed: "1.0"}
    lines: list[str] = []
    for name, dtype, op, args in graph.values:
        if name == seed:
            continue
        t = [d.get(a) for a in args]
        if dtype not in _FLOATS or all(x is None for x in t):
            continue
        a = [mod_ref(x, prefix) for x in args]
        z = [x if x is not None else "0.0" for x in t]
        if op == "add":
            expr = " + ".join(x for x in t if x is not None)
        elif op == "sub":
            expr = f"{z[0]} - {t[1]}" if t[1] is not None else t[0]
        elif op == "mul":
            terms = ([f"{t[0]} * {a[1]}"] if t[0] is not None else []) + (
                [f"{a[0]} * {t[1]}"] if t[1] is not None else [])
            expr = " + ".join(terms)
        elif op == "div":
            expr = f"({z[0]} - {mod_ref(name, prefix)} * {t[1]}) / {a[1]}" if t[1] is not None else f"{t[0]} / {a[1]}"
        elif op == "neg":
            expr = f"-{t[0]}"
        elif op == "abs":
            # torch's: the sign of x, 0 at 0.
            expr = f"tl.where({a[0]} > 0, {t[0]}, tl.where({a[0]} < 0, -{t[0]}, 0.0))"
        elif op == "tanh":
            expr = f"{t[0]} * (1.0 - {mod_ref(name, prefix)}.to(tl.float32) * {mod_ref(name, prefix)}.to(tl.float32))"
        elif op == "exp":
            expr = f"{t[0]} * {mod_ref(name, prefix)}.to(tl.float32)"
        elif op == "log":
            expr = f"{t[0]} / {a[0]}.to(tl.float32)"
        elif op == "sqrt":
            expr = f"{t[0]} / (2.0 * {mod_ref(name, prefix)}.to(tl.float32))"
        elif op == "where":
            expr = f"tl.where({a[0]}, {z[1]}, {z[2]})"
        elif op in ("minimum", "maximum"):
            # torch's: the chosen side's, half of each on a tie.
            first = ">" if op == "maximum" else "<"
            second = "<" if op == "maximum" else ">"
            expr = (f"tl.where({a[0]} {first} {a[1]}, {z[0]}, tl.where({a[0]} {second} {a[1]}, {z[1]}, "
                    f"({z[0]} + {z[1]}) * 0.5))")
        elif op == "clamp":
            # torch's: x's inside [min, max] (ends included), a tensor bound's where it binds.
            inside = [f"({a[0]} >= {a[1]})" if args[1] != "None" else None,
                      f"({a[0]} <= {a[2]})" if args[2] != "None" else None]
            inside = [c for c in inside if c is not None]
            expr = z[0] if not inside else f"tl.where({' & '.join(inside)}, {z[0]}, 0.0)"
            if t[1] is not None:
                expr = f"tl.where({a[0]} < {a[1]}, {t[1]}, {expr})"
            if t[2] is not None:
                expr = f"tl.where({a[0]} > {a[2]}, {t[2]}, {expr})"
        elif op == "to":
            expr = t[0]  # float to float (a cast to an integer or bool has no tangent); tangents stay fp32
        else:
            # floordiv and mod of floats: steps of the score, whose derivative is 0 or undefined at each step.
            raise ModGradError(f"score_mod: the derivative of {op} ({name} = {op}({', '.join(args)})) with respect "
                               "to the score or a captured tensor is not supported; the derivative is formed for "
                               "+ - * /, neg, abs, tanh, exp, log, sqrt, where, minimum, maximum, clamp and casts")
        var = f"{tag}_{name}"
        lines.append(f"{var} = {expr}")
        d[name] = var
    return lines, d.get(graph.result)


def _constants(lines: list[str]) -> set[str]:
    """The tangents among ``lines`` (``name = expr``) whose expressions hold numbers and such tangents alone."""
    constants: set[str] = set()
    for line in lines:
        name, expr = line.split(" = ", 1)
        # An identifier, or a number's exponent ("1e-05"), makes it not a number: the guard stays, as for any value.
        if all(word in constants for word in re.findall(r"[A-Za-z_][A-Za-z_0-9.]*", expr)):
            constants.add(name)
    return constants


@functools.lru_cache(maxsize=256)  # read at every call that trains
def grad_tensors(text: str | None) -> tuple[int, ...]:
    """The captured tensors of a score mod that can take a gradient: the floating ones."""
    if text is None:
        return ()
    return tuple(i for i, (dtype, _) in enumerate(parse(text).tensors) if dtype in _FLOATS)


@functools.lru_cache(maxsize=256)  # a refusal raises, and is not cached
def check_differentiable(text: str | None, wanted: tuple[int, ...] = ()) -> None:
    """Raise ``ModGradError`` naming the first operation whose derivative cannot be formed: with respect to the
    score, or to one of the captured tensors ``wanted`` (their indices among the score mod's, those that require
    grad). A tensor that does not require grad may go through any operation."""
    if text is None:
        return
    lower_score_mod_grad(text)
    graph = parse(text)
    for i in wanted:
        if i in grad_tensors(text):
            try:
                _tensor_tangents(graph, i, "sm")
            except ModGradError as e:
                raise ModGradError(f"captured tensor t{i} of the score mod requires grad, and {e}") from None


def _tensor_tangents(graph: ModGraph, i: int, prefix: str) -> list[tuple[str, tuple, list[str], str | None]]:
    """Per gather of captured tensor ``i``: ``(site, index, tangent statements, the result's tangent)``."""
    sites = [(name, args[1:]) for name, _, op, args in graph.values if op == "getitem" and args[0] == f"t{i}"]
    return [(site, index, *_tangents(graph, site, f"d{site}", prefix)) for site, index in sites]


def _element(t: str, index: list[str], one: bool) -> tuple[str, str]:
    """The offset into captured tensor ``t``'s contiguous gradient of the element at ``index`` (code; numbers as they
    are), and the condition that it lies inside the tensor: a scalar offset where ``one`` element takes the block's
    sum, else a block of the scores' shape, as the atomic's pointer must be."""
    offset, inside = "", []
    for dim, x in enumerate(index):
        if dim:
            offset = f"({offset}) * {t}_n{dim} + {x}"  # int64 from the first dimension on
        elif one:
            offset = x if _is_number(x) else f"{x}.to(tl.int64)"
        else:
            offset = f"({x} + tl.zeros(ds.shape, tl.int64))"
        if not _is_number(x):
            inside.append(f"({x} >= 0) & ({x} < {t}_n{dim})")
        else:  # the host refuses a constant outside the tensor (TracedMod.check_ranges)
            inside.append(f"({x} < {t}_n{dim})")
    return offset, " & ".join(inside)


def lower_score_mod_grad(text: str, prefix: str = "sm") -> tuple[str, list[str]]:
    """``_score_mod_bwd``'s extra parameters (``{prefix}_tK_g, {PREFIX}_TK_G, `` per floating captured tensor: its
    fp32 gradient, contiguous, and a constexpr that says whether this call wants it) and its body."""
    graph = parse(text)
    forward = lower_mod(text, prefix)
    body = [line for line in forward.lines if not line.startswith("return ")]
    params = ""
    score_lines, d_score = _tangents(graph, "score", "d", prefix)
    body += score_lines
    # Which positions each value follows: a gather at an index that follows neither (slopes[h]) reads one element
    # for a whole score block; one computed from the score (table[(score > 0).int()]) an element per score.
    follows = positions(graph)
    saturating = _saturating_gathers(graph)
    values = graph.by_name
    for i in grad_tensors(text):
        t = f"{prefix}_t{i}"
        flag = f"{prefix.upper()}_T{i}_G"
        params += f"{t}_g, {flag}, "
        try:
            passes = _tensor_tangents(graph, i, prefix)
        except ModGradError:
            continue  # this tensor takes no gradient: a call that asks for one is refused (check_differentiable)
        block = []
        for site, index, lines, d_site in passes:
            if d_site is None:
                continue
            block += lines
            one = not followed(follows, index)
            offset, inside = _element(t, [mod_ref(x, prefix) for x in index], one)
            if one:
                # One element for the whole block: its sum in one add, not an add per score on one address.
                block.append(f"tl.atomic_add({t}_g + {offset}, tl.sum(tl.where(ds != 0, ds * {d_site}, 0.0)), "
                             f"mask={inside}, sem=\"relaxed\")")
                continue
            # Element by element into the contiguous fp32 gradient, where the forward's load read the tensor; only
            # scores the loss reaches (ds is 0 where the masks drop a score).
            each = (f"tl.atomic_add({t}_g + {offset}, ds * {d_site}, mask=({inside} & (ds != 0)) != 0, "
                    f"sem=\"relaxed\")")
            if site not in saturating:
                block.append(each)
                continue
            # Where the forward read one value for the block (its clamp at a bound), the block adds into that one
            # element: its sum in one add, not an add per score on one address.
            clamp = saturating[site]
            held = [mod_ref(x, prefix) if x not in values or not _depends_on(graph, x, clamp)
                    else _at_bounds(clamp, values[clamp][3], lambda side, x=x: f"{x}_at{side}")[1] for x in index]
            condition, _ = _at_bounds(clamp, values[clamp][3], str)
            offset, inside = _element(t, held, True)
            block += [f"if {condition}:",
                      f"    tl.atomic_add({t}_g + {offset}, tl.sum(tl.where(ds != 0, ds * {d_site}, 0.0)), "
                      f"mask={inside}, sem=\"relaxed\")", "else:", "    " + each]
        if block:
            body += [f"if {flag}:"] + ["    " + line for line in block]
    if d_score is None:
        body.append("return tl.zeros(ds.shape, tl.float32)")
    elif d_score in _constants(score_lines):
        # A number (ALiBi's and a relative bias's 1.0): finite, so no guard, whose select over the block costs the
        # Gluon backward's consumers registers (ptxas spilled 892 bytes against 280 without it, a scaling mod).
        body.append(f"return ds * {d_score}")
    else:
        # Where no gradient arrives the mod's derivative may be inf or NaN (log at 0): 0, not 0 * inf.
        body.append(f"return tl.where(ds != 0, ds * {d_score}, 0.0)")
    return params, body


def mod_grad_values(score_mod: str | None) -> dict:
    """The backward template's values of a spec's score mod (``templates/common/mods_grad.py.jinja``): the
    function's extra parameters, as a kernel declares them (the flags constexpr) and as a call without gradients
    to captured tensors passes them; its body; which captured tensors take gradients."""
    if score_mod is None:
        return {"score_mod_grad_params": "", "score_mod_grad_kernel_params": "", "score_mod_no_grads": "",
                "score_mod_grad_lines": [], "score_mod_grad_tensors": []}
    params, lines = lower_score_mod_grad(score_mod)
    names = params.split(", ")[:-1]
    return {"score_mod_grad_params": params,
            "score_mod_grad_kernel_params": "".join(n + (": tl.constexpr, " if n.isupper() else ", ") for n in names),
            "score_mod_no_grads": "".join("False, " if n.isupper() else "None, " for n in names),
            "score_mod_grad_lines": lines, "score_mod_grad_tensors": list(grad_tensors(score_mod))}
