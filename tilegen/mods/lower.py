"""Lower a mod's canonical text (``tilegen.mods.trace``) into the Triton statements of its jit function.

The statements are rendered by ``templates/common/mods.py.jinja`` as ``_score_mod``/``_mask_mod``,
which ``_attend_blocks`` calls on every score block with q_idx ``[BLOCK_M, 1]`` and kv_idx
``[1, BLOCK_N]``. Captured tensor ``tK`` of a mod becomes the arguments ``{prefix}_tK`` (pointer),
``{prefix}_tK_s0..`` (strides) and ``{prefix}_tK_n0..`` (sizes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["parse", "lower_mod", "mod_ref", "LoweredMod", "ModSyntaxError"]

_OPS = {"add": 2, "sub": 2, "mul": 2, "div": 2, "neg": 1, "abs": 1, "floordiv": 2, "mod": 2, "lt": 2, "le": 2,
        "gt": 2, "ge": 2, "eq": 2, "ne": 2, "and": 2, "or": 2, "not": 1, "where": 3, "tanh": 1, "exp": 1,
        "log": 1, "sqrt": 1, "minimum": 2, "maximum": 2, "clamp": 3, "to": 2, "getitem": None}
_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
           "eq": "==", "ne": "!=", "and": "&", "or": "|"}
_DTYPES = ("float32", "float16", "bfloat16", "int32", "int64", "int16", "int8", "uint8", "bool")
_ROLES = {"score_mod": ("score", "b", "h", "q_idx", "kv_idx"), "mask_mod": ("b", "h", "q_idx", "kv_idx")}
_LINE = re.compile(r"(v\d+):(\w+)=(\w+)\((.*)\)")


class ModSyntaxError(ValueError):
    """A canonical mod text that tilegen did not write."""


@dataclass(frozen=True)
class ModGraph:
    kind: str
    tensors: tuple[tuple[str, int], ...]  # (dtype, ndim) of t0, t1, ...
    values: tuple[tuple[str, str, str, tuple[str, ...]], ...]  # (name, dtype, op, args)
    result: str


def parse(text: str) -> ModGraph:
    """The canonical text back as a graph; a ``ModSyntaxError`` says what is malformed."""
    if not isinstance(text, str):
        raise ModSyntaxError(f"expected a str, got {type(text).__name__}")
    if not text.isascii() or any(c.isspace() and c != " " for c in text):
        raise ModSyntaxError("a canonical mod is one line of ASCII")
    parts = text.split(";")
    kind = parts[0]
    if kind not in _ROLES or len(parts) < 2 or not parts[-1].startswith("return "):
        raise ModSyntaxError(f"not a canonical mod: {text[:60]!r}")
    tensors, values, known = [], [], set(_ROLES[kind])
    for part in parts[1:-1]:
        m = re.fullmatch(r"t(\d+)=(\w+)\[(\d+)\]", part)
        if m:
            if int(m.group(1)) != len(tensors) or m.group(2) not in _DTYPES:
                raise ModSyntaxError(f"bad tensor {part!r}")
            tensors.append((m.group(2), int(m.group(3))))
            known.add(f"t{len(tensors) - 1}")
            continue
        m = _LINE.fullmatch(part)
        if not m or m.group(2) not in _DTYPES or m.group(3) not in _OPS:
            raise ModSyntaxError(f"bad statement {part!r}")
        name, dtype, op, args = m.group(1), m.group(2), m.group(3), tuple(m.group(4).split(","))
        if name != f"v{len(values)}":
            raise ModSyntaxError(f"statement {part!r} out of order")
        if _OPS[op] is not None and len(args) != _OPS[op]:
            raise ModSyntaxError(f"{op} takes {_OPS[op]} arguments: {part!r}")
        for position, a in enumerate(args):
            # Every token becomes code: only names defined above, numbers as repr() writes them, a dtype where
            # .to() takes one and None where clamp does. A spec read from a database can hold no other code.
            if not (a in known or _is_number(a) or (op == "to" and position == 1 and a in _DTYPES)
                    or (op == "clamp" and position > 0 and a == "None")):
                raise ModSyntaxError(f"{part!r}: argument {a!r} is neither defined above nor a number")
        tensor_names = {f"t{i}": ndim for i, (_, ndim) in enumerate(tensors)}
        if op == "getitem" and (args[0] not in tensor_names or len(args) - 1 != tensor_names[args[0]]):
            raise ModSyntaxError(f"{part!r}: indexes no captured tensor, or not once per dimension")
        if any(a in tensor_names for a in args[1 if op == "getitem" else 0:]):
            raise ModSyntaxError(f"{part!r}: a captured tensor used without indexing")
        values.append((name, dtype, op, args))
        known.add(name)
    result = parts[-1].removeprefix("return ")
    if not (result in known or _is_number(result)) or re.fullmatch(r"t\d+", result):
        raise ModSyntaxError(f"returns unknown {result!r}")
    return ModGraph(kind, tuple(tensors), tuple(values), result)


def gathers_per_score(text: str | None) -> bool:
    """Whether the mod reads a captured tensor at an index that depends on both the query and the key
    position (T5's relative bias: ``table[h, bucket(kv_idx - q_idx)]``): a gather of a whole score tile,
    which Triton stages through shared memory. Indices that follow one position alone (``doc[q_idx]``)
    or neither (``slopes[h]``) load a row or a column; one computed from the score (``table[(score > 0).int()]``)
    follows both."""
    if text is None:
        return False
    depends: dict[str, frozenset[str]] = {"q_idx": frozenset({"q"}), "kv_idx": frozenset({"k"}),
                                          "score": frozenset({"q", "k"})}
    for name, _, op, args in parse(text).values:
        reads = frozenset().union(*(depends.get(a, frozenset()) for a in args))
        if op == "getitem" and frozenset().union(*(depends.get(a, frozenset()) for a in args[1:])) == {"q", "k"}:
            return True
        depends[name] = reads
    return False


_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?(?:e[+-]?\d+)?|inf|nan)|True|False")


def _is_number(token: str) -> bool:
    """A Python literal as ``repr`` writes ints, floats and bools (``float()`` alone would take more)."""
    return _NUMBER.fullmatch(token) is not None


def mod_ref(a: str, prefix: str) -> str:
    """A canonical argument as Triton code: captured tensor ``tK`` as the kernel's ``{prefix}_tK``, an infinite
    or NaN literal as a float, any other name or number as it is."""
    if re.fullmatch(r"t\d+", a):
        return f"{prefix}_{a}"
    return {"inf": 'float("inf")', "-inf": 'float("-inf")', "nan": 'float("nan")'}.get(a, a)


@dataclass(frozen=True)
class LoweredMod:
    """The jit function's parameters after the roles (a string ending in ", " or empty), its body, the helpers
    it calls (``tanh``, ``floordiv``, ``mod``)."""

    params: str
    lines: tuple[str, ...]
    helpers: frozenset[str]


def lower_mod(text: str, prefix: str) -> LoweredMod:
    graph = parse(text)
    params: list[str] = []
    for i, (_, ndim) in enumerate(graph.tensors):
        t = f"{prefix}_t{i}"
        params += [t, *(f"{t}_s{d}" for d in range(ndim)), *(f"{t}_n{d}" for d in range(ndim))]
    dtypes = {"score": "float32", **{r: "int32" for r in ("b", "h", "q_idx", "kv_idx")}}
    dtypes.update({n: d for n, d, _, _ in graph.values})
    helpers: set[str] = set()
    lines: list[str] = []

    def ref(a: str) -> str:
        return mod_ref(a, prefix)

    def as_tensor(a: str, dtype: str) -> str:
        # The helpers take tensors: a Python number becomes a scalar of the result's type.
        return f"tl.full([], {ref(a)}, tl.{dtype})" if _is_number(a) else ref(a)

    for name, dtype, op, args in graph.values:
        a = [ref(x) for x in args]
        is_int = dtype not in ("float32", "float16", "bfloat16")
        if op in _BINARY:
            expr = f"{a[0]} {_BINARY[op]} {a[1]}"
        elif op == "neg":
            expr = f"-{a[0]}"
        elif op == "not":
            expr = f"~{a[0]}"
        elif op == "abs":
            expr = f"tl.abs({a[0]})"
        elif op == "where":
            expr = f"tl.where({a[0]}, {a[1]}, {a[2]})"
        elif op in ("minimum", "maximum"):
            # torch's minimum/maximum propagate NaN; Triton's do not unless asked.
            nan = ", propagate_nan=tl.PropagateNan.ALL" if not is_int else ""
            expr = f"tl.{op}({a[0]}, {a[1]}{nan})"
        elif op == "clamp":
            expr = a[0]
            if args[1] != "None":
                expr = f"tl.maximum({expr}, {a[1]})"
            if args[2] != "None":
                expr = f"tl.minimum({expr}, {a[2]})"
        elif op in ("tanh", "exp", "log", "sqrt"):
            # In fp32 whatever the input type, then to the type torch gives (fp16/bf16 inputs stay so).
            x = f"{a[0]}.to(tl.float32)"
            fn = {"tanh": "_mod_tanh", "exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt_rn"}[op]
            if op == "tanh":
                helpers.add("tanh")
            expr = f"{fn}({x})" + ("" if dtype == "float32" else f".to(tl.{dtype})")
        elif op in ("floordiv", "mod"):
            if is_int:
                # Triton's integer // and % truncate toward zero (C); torch's floor (Python).
                helpers.add(op)
                fn = "_mod_floordiv" if op == "floordiv" else "_mod_remainder"
                expr = f"{fn}({as_tensor(args[0], dtype)}, {as_tensor(args[1], dtype)})"
            elif op == "floordiv":
                expr = f"tl.floor({a[0]} / {a[1]})"
            else:
                expr = f"{a[0]} - tl.floor({a[0]} / {a[1]}) * {a[1]}"
        elif op == "to":
            expr = f"({a[0]} != 0)" if args[1] == "bool" else f"{a[0]}.to(tl.{args[1]})"
            if _is_number(args[0]):
                expr = f"tl.full([], {a[0]}, tl.{args[1]})"
        elif op == "getitem":
            t, index = a[0], args[1:]
            offsets, masks = [], []
            for d, i in enumerate(index):
                if _is_number(i):
                    offsets.append(f"{i} * {t}_s{d}")
                    masks.append(f"({i} < {t}_n{d})" if int(i) >= 0 else "False")
                else:
                    offsets.append(f"{ref(i)}.to(tl.int64) * {t}_s{d}")
                    masks.append(f"({ref(i)} >= 0) & ({ref(i)} < {t}_n{d})")
            # Outside the tensor reads 0: the host checks the indices it can (tilegen.mods docstring). The
            # `!= 0` makes a bool of a mask mixing scalar and block conditions, which Triton's interpreter (3.9)
            # otherwise passes to its load with a dtype it refuses; compiled, it folds away.
            expr = f"tl.load({t} + {' + '.join(offsets)}, mask=({' & '.join(masks)}) != 0, other=0)"
        else:  # parse admits no other op
            raise AssertionError(op)
        lines.append(f"{name} = {expr}")
        dtypes[name] = dtype
    result = graph.result
    if graph.kind == "score_mod":
        r = f"tl.full([], {ref(result)}, tl.float32)" if _is_number(result) else f"{ref(result)}.to(tl.float32)"
        # A result that does not depend on the score still fills the block.
        lines.append(f"return tl.broadcast_to({r}, score.shape)")
    else:
        # As for the loads' masks: a bool the interpreter takes whether scalar and block conditions mix or not.
        lines.append(f"return {ref(result)}" if _is_number(result) else f"return {ref(result)} != 0")
    return LoweredMod("".join(p + ", " for p in params), tuple(lines), frozenset(helpers))


def mod_values(score_mod: str | None, mask_mod: str | None) -> dict:
    """The template values of a spec's mods (``templates/common/mods.py.jinja``); none when it has none."""
    score = lower_mod(score_mod, "sm") if score_mod is not None else LoweredMod("", (), frozenset())
    mask = lower_mod(mask_mod, "mm") if mask_mod is not None else LoweredMod("", (), frozenset())
    return {
        "mods": score_mod is not None or mask_mod is not None,
        "score_mod": score_mod is not None, "mask_mod": mask_mod is not None,
        "score_mod_params": score.params, "mask_mod_params": mask.params,
        "mod_params": score.params + mask.params,
        "score_mod_lines": list(score.lines), "mask_mod_lines": list(mask.lines),
        "mod_helpers": sorted(score.helpers | mask.helpers),
        # Set by the dense kernel's lowering, the one whose launch takes a block table (tilegen.mods.blocks).
        "mask_mod_blocks": False,
    }


def check_mod_field(field: str, text) -> None:
    """A spec's ``score_mod``/``mask_mod``: ``None`` or a canonical text of that kind (``ValueError`` if not)."""
    if text is None:
        return
    if parse(text).kind != field:
        raise ModSyntaxError(f"a {parse(text).kind} text in the {field} field")


def mod_name(field: str, text: str) -> str:
    """A short, stable name part for a mod: its kind and the start of its text's hash."""
    import hashlib

    return ("smod" if field == "score_mod" else "mmod") + hashlib.sha256(text.encode()).hexdigest()[:8]
