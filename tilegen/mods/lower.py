"""Lower a mod's canonical text (``tilegen.mods.trace``) into the Triton statements of its jit function.

The statements are rendered by ``templates/common/mods.py.jinja`` as ``_score_mod``/``_mask_mod``,
which ``_attend_blocks`` calls on every score block with q_idx ``[BLOCK_M, 1]`` and kv_idx
``[1, BLOCK_N]``. Captured tensor ``tK`` of a mod becomes the arguments ``{prefix}_tK`` (pointer),
``{prefix}_tK_s0..`` (strides) and ``{prefix}_tK_n0..`` (sizes).
"""

from __future__ import annotations

import functools
import math
import re
import struct
from dataclasses import dataclass

__all__ = ["parse", "lower_mod", "mod_ref", "LoweredMod", "ModSyntaxError", "ModTypeError", "check_types",
           "compute_dtype", "positions", "followed"]

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

    @functools.cached_property
    def by_name(self) -> dict[str, tuple[str, str, str, tuple[str, ...]]]:
        return {v[0]: v for v in self.values}


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


def _scalar(value: str, dtype: str) -> str:
    """A number as a scalar of ``dtype``: a cast, which Triton's and Gluon's kernels both take (Gluon's ``tl.full``
    asks for a layout, even for a scalar)."""
    return f"tl.cast({value}, tl.{dtype})"


def gathers_per_score(text: str | None) -> bool:
    """Whether the mod reads a captured tensor at an index that depends on both the query and the key
    position (T5's relative bias: ``table[h, bucket(kv_idx - q_idx)]``): a gather of a whole score tile,
    which Triton stages through shared memory. Indices that follow one position alone (``doc[q_idx]``)
    or neither (``slopes[h]``) load a row or a column; one computed from the score (``table[(score > 0).int()]``)
    follows both."""
    if text is None:
        return False
    graph = parse(text)
    follows = positions(graph)
    return any(op == "getitem" and followed(follows, args[1:]) == {"q", "k"} for _, _, op, args in graph.values)


@functools.lru_cache(maxsize=64)  # asked by the forward's lowering and again by the backward's
def _saturating_gathers(graph: ModGraph) -> dict[str, str]:
    """The gathers whose index follows the positions only through an integer clamp of them to constant bounds
    (T5's ``table[h, buckets[clamp(kv_idx - q_idx, -d, d) + d]]``), each with that clamp's name: where the clamp
    holds its operand at a bound, such a gather reads one value for the whole block."""
    follows = positions(graph)
    found: dict[str, str] = {}
    for clamp, dtype, op, args in graph.values:
        if (op != "clamp" or dtype not in _INT_RANGE or _is_number(args[0]) or follows[args[0]] != {"q", "k"}
                or _depends_on(graph, args[0], "score") or any(not (_is_number(b) or b == "None") for b in args[1:])
                or args[1:] == ("None", "None")
                or ("None" not in args[1:] and number_value(args[1]) > number_value(args[2]))):
            continue
        held = {"q_idx": frozenset({"q"}), "kv_idx": frozenset({"k"}), "score": frozenset({"q", "k"})}
        for name, _, _, value_args in graph.values:
            held[name] = frozenset() if name == clamp else followed(held, value_args)
        # Integers between the clamp and the gather: compiled, the bound's value is folded exactly, where a float
        # operation on the block would be approximate (a division by a reciprocal) and could read another element.
        exact = {clamp}
        for name, value_dtype, _, value_args in graph.values:
            below = [a for a in value_args if not _is_number(a) and _depends_on(graph, a, clamp)]
            if name != clamp and below and all(a in exact for a in below) and value_dtype in (*_INT_RANGE, "bool"):
                exact.add(name)
        for name, _, value_op, value_args in graph.values:
            index = value_args[1:]
            if (value_op == "getitem" and name not in found and followed(follows, index)
                    and not followed(held, index) and any(i in exact for i in index)
                    and not any(_depends_on(graph, i, clamp) and i not in exact for i in index)):
                found[name] = clamp
    return found


def _at_bounds(clamp: str, args: tuple[str, ...], at) -> tuple[str, str]:
    """For a saturating clamp (``_saturating_gathers``) of arguments ``args``: the condition that the block sits at one
    of its bounds (the flags ``lower_mod`` writes after the clamp), and the value ``at(side)`` of that bound's side
    (1 the lower, 2 the upper)."""
    sides = [side for side in (1, 2) if args[side] != "None"]
    held = [at(side) for side in sides]
    value = held[0] if len(held) == 1 else f"tl.where({clamp}_below, {held[0]}, {held[1]})"
    return " | ".join(f"{clamp}_" + ("below" if side == 1 else "above") for side in sides), value


def _depends_on(graph: ModGraph, name: str, source: str) -> bool:
    """Whether value ``name`` of the graph is computed from ``source`` (a value or a role)."""
    return name == source or source in _sources(graph).get(name, ())


@functools.lru_cache(maxsize=64)
def _sources(graph: ModGraph) -> dict[str, frozenset[str]]:
    """Every value's transitive operands (values, roles, captured tensors), in one pass over the graph: a walk of
    the operands per question would revisit a value once per path to it, which doubles with every reuse."""
    found: dict[str, frozenset[str]] = {}
    for name, _, _, args in graph.values:
        names = [a for a in args if not _is_number(a) and a != "None"]
        found[name] = frozenset(names).union(*(found.get(a, frozenset()) for a in names))
    return found


def positions(graph) -> dict[str, frozenset[str]]:
    """The positions each value of a parsed mod follows: ``"q"`` (the query's), ``"k"`` (the key's), both, or
    neither (``h``, a constant). The score differs at every (query, key), as a value of both positions does."""
    follows = {"q_idx": frozenset({"q"}), "kv_idx": frozenset({"k"}), "score": frozenset({"q", "k"})}
    for name, _, _, args in graph.values:
        follows[name] = followed(follows, args)
    return follows


def followed(follows: dict[str, frozenset[str]], names) -> frozenset[str]:
    """The positions the values ``names`` follow together (``positions``'s map)."""
    return frozenset().union(*(follows.get(a, frozenset()) for a in names))


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


# Types. The canonical text records the dtype torch gives every value (0-dim tensors and Python numbers, as the
# trace runs the mod); the kernel computes that, not what Triton's own promotion would make of the operands.
_FLOATS = ("float32", "float16", "bfloat16")
_HALF = ("float16", "bfloat16")
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
_INT_RANGE = {"uint8": (0, 2**8 - 1), "int8": (-2**7, 2**7 - 1), "int16": (-2**15, 2**15 - 1),
              "int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}
# Arithmetic whose operands torch converts to the computation type: a number it converts is refused where that
# conversion wraps or rounds (check_types).
_CONVERTS = ("add", "sub", "mul", "div", "floordiv", "mod", *_COMPARE)


class ModTypeError(ValueError):
    """An operation of a mod whose result the kernel cannot compute as torch does (``check_types``)."""


def number_value(token: str) -> bool | int | float:
    """A canonical number token as the Python number it spells."""
    if token in ("True", "False"):
        return token == "True"
    return float(token) if any(c in token for c in ".ena") else int(token)


def _promote(a: str, b: str) -> str:
    """``torch.promote_types`` over the dtypes a mod computes in."""
    if a == b or b == "bool":
        return a
    if a == "bool":
        return b
    if a in _FLOATS and b in _FLOATS:
        return "float32"  # float16 with bfloat16, either with float32
    if a in _FLOATS or b in _FLOATS:
        return a if a in _FLOATS else b
    if "uint8" in (a, b):
        other = b if a == "uint8" else a
        return "int16" if other == "int8" else other
    return a if _INT_RANGE[a][1] > _INT_RANGE[b][1] else b


def _result_type(operands: list[str], dtypes: dict) -> str:
    """``torch.result_type`` of values (0-dim tensors) and Python numbers: a number takes part only when its
    category (bool, integer, float) is above every value's, as the default type of that category."""
    values = [dtypes[a] for a in operands if not _is_number(a)]
    numbers = [{bool: "bool", int: "int64", float: "float32"}[type(number_value(a))] for a in operands
               if _is_number(a)]
    value = functools.reduce(_promote, values) if values else None
    number = functools.reduce(_promote, numbers) if numbers else None
    if value is None or number is None:
        return value or number
    if value in _FLOATS:
        return value
    return _promote(value, number) if value == "bool" or number in _FLOATS else value


def compute_dtype(op: str, args: tuple[str, ...], dtypes: dict, result: str) -> str:
    """The dtype torch converts the operands of ``op`` to and computes in: the result's, but for a comparison."""
    return _result_type(list(args), dtypes) if op in _COMPARE else result


def _exact(number, dtype: str) -> bool:
    """Whether ``dtype`` holds the Python number exactly."""
    if dtype in _INT_RANGE:
        low, high = _INT_RANGE[dtype]
        return not isinstance(number, float) and low <= number <= high
    if dtype == "bool":
        return number in (0, 1)
    if number != number or number in (math.inf, -math.inf):
        return True
    code = {"float16": "e", "bfloat16": "f", "float32": "f"}[dtype]
    try:
        packed = struct.pack("<" + code, number)
    except OverflowError:
        return False
    if dtype == "bfloat16" and packed[:2] != b"\0\0":  # bfloat16 is float32's upper half
        return False
    return struct.unpack("<" + code, packed)[0] == number


def check_types(text: str) -> None:
    """Raise ``ModTypeError`` naming the first operation whose torch result the kernel cannot compute exactly: a
    Python number that torch converts to the operation's integer type by wrapping it around (``uint8_value < 300``),
    or to a float16/bfloat16 one by rounding it, which torch does for some operations and devices and not for others
    (``bf16_value * 0.1``)."""
    graph = parse(text)
    dtypes = {"score": "float32", **{r: "int32" for r in ("b", "h", "q_idx", "kv_idx")}}
    for name, dtype, op, args in graph.values:
        dtypes[name] = dtype
        kind = compute_dtype(op, args, dtypes, dtype)
        # A select or a bound (where, clamp) gives the number back rounded as torch does; an integer one must fit.
        if op not in _CONVERTS and not (op in ("and", "or", "where", "clamp") and kind in _INT_RANGE):
            continue
        for a in args[1 if op == "where" else 0:]:
            # float32: torch converts a number to it as Triton does, whatever the operation.
            if not _is_number(a) or kind == "float32" or _exact(number_value(a), kind):
                continue
            value = " and ".join(("an " if dtypes[x].startswith("int") else "a ") + f"{dtypes[x]} value"
                                 if not _is_number(x) else x for x in args if x != "None")
            if kind in _INT_RANGE:
                raise ModTypeError(f"{op} of {value}: torch computes it in {kind}, which does not hold {a} (torch "
                                   f"wraps it around); use a number in [{_INT_RANGE[kind][0]}, {_INT_RANGE[kind][1]}], "
                                   "or cast the value to a wider type (.long()) first")
            raise ModTypeError(f"{op} of {value}: torch computes it in {kind}, which does not hold {a} exactly, and "
                               f"whether torch rounds {a} to {kind} first depends on the operation and the device; use "
                               f"a number {kind} holds, or compute in float32 (.float()) first")


_TRITON_BITS = {"bool": 1, "uint8": 8, "int8": 8, "int16": 16, "int32": 32, "uint32": 32, "int64": 64,
                "uint64": 64}


def _triton_number(token: str) -> str:
    """The type Triton gives a Python number (``semantic.to_tensor_type``)."""
    x = number_value(token)
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int32" if -2**31 <= x < 2**31 else "uint32" if 0 <= x < 2**32 else "int64" if x < 2**63 else "uint64"
    inside = 2**-126 <= abs(x) <= (2 - 2**-23) * 2**127
    return "float32" if x != x or x == 0 or abs(x) == math.inf or inside else "float64"


def _triton_kind(dtype: str) -> int:
    return 0 if dtype == "bool" else 2 if dtype in (*_FLOATS, "float64") else 1


def _triton_promote(a: tuple[str, bool], b: tuple[str, bool], div_or_mod: bool = False) -> str | None:
    """The type Triton computes a binary operation in (``semantic.computation_type_impl``), from each operand's type
    and whether it is a Python number; None where Triton refuses the pair."""
    (x, x_number), (y, y_number) = a, b
    if x_number != y_number:
        number, value = (x, y) if x_number else (y, x)
        if _triton_kind(number) <= _triton_kind(value):
            x = y = value
    if "float64" in (x, y):
        return "float64"
    if div_or_mod and (x in _FLOATS or y in _FLOATS):
        return "float32"
    if "float32" in (x, y):
        return "float32"
    if "float16" in (x, y):
        return "float16"
    if "bfloat16" in (x, y):
        return "bfloat16" if x == y else "float32"
    signed_x, signed_y = x not in ("bool", "uint8", "uint32", "uint64"), y not in ("bool", "uint8", "uint32", "uint64")
    if signed_x != signed_y and div_or_mod:
        return None
    if signed_x == signed_y:
        return x if _TRITON_BITS[x] > _TRITON_BITS[y] else y
    unsigned, signed = (x, y) if signed_y else (y, x)
    return unsigned if _TRITON_BITS[unsigned] >= _TRITON_BITS[signed] else signed


def _holds(big: str | None, small: str) -> bool:
    """Whether every value of dtype ``small`` is one of dtype ``big``."""
    if big is None:
        return False
    if big == small or small == "bool":
        return True
    if big in ("float32", "float64") and small in _FLOATS:
        return small != "float32" or big == "float64"
    if small in _FLOATS or big == "bool":
        return False
    if big in _FLOATS:  # an integer type: those of at most the float's significand bits
        return {"uint8": 8, "int8": 8, "int16": 16}.get(small, 64) <= {"float16": 11, "bfloat16": 8}.get(big, 24)
    if big in _INT_RANGE and small in _INT_RANGE:
        return _INT_RANGE[big][0] <= _INT_RANGE[small][0] and _INT_RANGE[small][1] <= _INT_RANGE[big][1]
    return False


def _to(code: str, source: str, target: str) -> str:
    """The value ``code`` of dtype ``source`` as torch converts it to ``target``. Through float32 where bfloat16 is
    either: torch converts integers to bfloat16 through float32 (which rounds twice past 2**24), and Triton's
    interpreter holds bfloat16 as raw bits, which only its float32 conversions read."""
    if source == target:
        return code
    if target == "bool":
        return f"({code}.to(tl.float32) != 0)" if source == "bfloat16" else f"({code} != 0)"
    if (source == "bfloat16" or target == "bfloat16") and "float32" not in (source, target):
        return f"{code}.to(tl.float32).to(tl.{target})"
    return f"{code}.to(tl.{target})"


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
        return renamed.get(a) or mod_ref(a, prefix)

    def converted(x: str, kind: str) -> str:
        """Operand ``x`` as torch converts it to the computation type ``kind``; a number as it is."""
        return ref(x) if _is_number(x) or x == "None" else _to(ref(x), dtypes[x], kind)

    def in_float32(x: str, kind: str) -> str:
        """Operand ``x`` converted to the bfloat16 computation type, read as float32 (bfloat16 math below)."""
        if _is_number(x) or x == "None":
            return ref(x)
        if dtypes[x] in ("bool", "uint8", "int8", "bfloat16"):  # bfloat16 holds them: no rounding
            return f"{ref(x)}.to(tl.float32)"
        return f"{_to(ref(x), dtypes[x], kind)}.to(tl.float32)"

    def arithmetic(op: str, a: list[str], args: tuple[str, ...], kind: str) -> str:
        """The operation on operands ``a`` (code) that hold values of ``kind``."""
        if op in _BINARY:
            # torch's + on bools is a logical or; Triton's on int1 an exclusive or.
            return f"{a[0]} | {a[1]}" if op == "add" and kind == "bool" else f"{a[0]} {_BINARY[op]} {a[1]}"
        if op == "neg":
            return f"-{a[0]}"
        if op == "abs":
            return f"tl.abs({a[0]})"
        # torch's minimum, maximum and clamp propagate NaN; Triton's minimum and maximum do not unless asked.
        nan = ", propagate_nan=tl.PropagateNan.ALL" if kind in _FLOATS else ""
        if op in ("minimum", "maximum"):
            return f"tl.{op}({a[0]}, {a[1]}{nan})"
        if op == "clamp":
            expr = a[0]
            if args[1] != "None":
                expr = f"tl.maximum({expr}, {a[1]}{nan})"
            if args[2] != "None":
                expr = f"tl.minimum({expr}, {a[2]}{nan})"
            return expr
        if op in ("floordiv", "mod") and kind not in _FLOATS:
            # Triton's integer // and % truncate toward zero (C); torch's floor (Python).
            helpers.add(op)
            fn = "_mod_floordiv" if op == "floordiv" else "_mod_remainder"
            return f"{fn}({a[0]}, {a[1]})"
        # torch's float // and % (templates/common/mods.py.jinja), in float32 as Triton divides: the half types hold
        # the operands exactly, and the caller rounds the result to them once.
        helpers.add(f"float_{op}")
        fn = "_mod_floordiv_float" if op == "floordiv" else "_mod_remainder_float"
        a = [_scalar(c, "float32") if _is_number(x) else f"{c}.to(tl.float32)" for c, x in zip(a, args)]
        return f"{fn}({a[0]}, {a[1]})"

    def triton_type(op: str, operands: list[tuple[str, bool]]) -> tuple[str | None, str | None]:
        """The type Triton computes ``op`` in from operands ``(type, is a number)``, and the type of its result."""
        if op == "clamp":
            kind = operands[0]
            for bound in operands[1:]:
                if bound[0] != "None":
                    kind = (_triton_promote(kind, bound), False)
                    if kind[0] is None:
                        return None, None
            return kind[0], kind[0]
        if op in ("neg", "abs"):
            return operands[0][0], operands[0][0]
        kind = _triton_promote(*operands, div_or_mod=op in ("div", "floordiv", "mod"))
        if kind is None or op in _COMPARE:
            return kind, "bool"
        if op == "div" or (op in ("floordiv", "mod") and kind in _FLOATS):
            return kind, "float64" if kind == "float64" else "float32"  # Triton divides in float32
        return kind, kind

    def expression(dtype: str, op: str, args: tuple[str, ...]) -> str:
        """The code of one value."""
        a = [ref(x) for x in args]
        if op in (*_BINARY, "neg", "abs", "minimum", "maximum", "clamp", "floordiv", "mod", "where"):
            kind = compute_dtype(op, args, dtypes, dtype)
            operands = args[1:] if op == "where" else args
            if kind == "bfloat16" and op != "where":
                # In float32 on bfloat16 values, rounded once to bfloat16: torch's result (its bfloat16 kernels compute
                # so), and arithmetic Triton's interpreter has (it holds bfloat16 as raw bits).
                expr = arithmetic(op, [in_float32(x, kind) for x in operands], args, "float32")
                if op not in _COMPARE:
                    expr = f"({expr}).to(tl.bfloat16)"
            else:
                if op in ("floordiv", "mod") and kind not in _FLOATS:
                    # The helpers take tensors: a Python number becomes a scalar of the result's type.
                    operand_code = [_scalar(ref(x), kind) if _is_number(x) else ref(x) for x in operands]
                    types = [(kind if _is_number(x) else dtypes[x], False) for x in operands]
                else:
                    operand_code = [ref(x) for x in operands]
                    types = [("None" if x == "None" else _triton_number(x), True) if _is_number(x) or x == "None"
                             else (dtypes[x], False) for x in operands]
                computed, result = triton_type(op, types)
                # Triton's promotion of the operands as they are gives torch's values where it computes in a type that
                # holds torch's, into which torch's conversion of every operand is exact (or the same as Triton's).
                same = _holds(computed, kind) and (computed == kind or all(
                    number or t in ("None", kind) or _holds(kind, t) for t, number in types))
                if not same:
                    operand_code = [c if _is_number(x) or x == "None" else converted(x, kind)
                                    for c, x in zip(operand_code, operands)]
                    types = [(kind, False) if not number else (t, number) for t, number in types]
                    computed, result = triton_type(op, types)
                if op == "where":
                    expr = f"tl.where({a[0]}, {operand_code[0]}, {operand_code[1]})"
                else:
                    expr = arithmetic(op, operand_code, args, kind)
                if result != (dtype if op not in _COMPARE else "bool"):
                    expr = _to(f"({expr})", result, dtype)
        elif op == "not":
            expr = f"~{a[0]}"
        elif op in ("tanh", "exp", "log", "sqrt"):
            # In fp32 whatever the input type, then to the type torch gives (fp16/bf16 inputs stay so).
            x = f"{a[0]}.to(tl.float32)"
            fn = {"tanh": "_mod_tanh", "exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt_rn"}[op]
            if op == "tanh":
                helpers.add("tanh")
            expr = f"{fn}({x})" + ("" if dtype == "float32" else f".to(tl.{dtype})")
        elif op == "to":
            if _is_number(args[0]):
                expr = _scalar(a[0], args[1])
            elif args[1] == "bool" or ("bfloat16" in (dtypes[args[0]], args[1]) and dtypes[args[0]] != args[1]):
                expr = _to(a[0], dtypes[args[0]], args[1])
            else:
                expr = f"{a[0]}.to(tl.{args[1]})"
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
        return expr

    saturating = _saturating_gathers(graph)
    renamed: dict[str, str] = {}  # a value's code name while a clamp is held at one of its bounds

    def at_bound(name: str, clamp: str, side: int) -> str:
        """The code name of value ``name`` with clamp ``clamp`` held at its bound ``side`` (1 low, 2 high): a
        value of the block's uniform inputs, written once above its first use."""
        held = f"{name}_at{side}"
        if name != clamp and not _depends_on(graph, name, clamp):
            return ref(name)
        if held not in emitted:
            emitted.add(held)
            _, dtype, op, args = values[name]
            if name == clamp:
                expr = _scalar(args[side], dtype)
            else:
                # The operands' held values first: their own renaming is over before this one begins.
                renamed.update({x: at_bound(x, clamp, side) for x in args if x in values})
                expr = expression(dtype, op, args)
                renamed.clear()
            lines.append(f"{held} = {expr}")
        return held

    values = graph.by_name
    emitted: set[str] = set()
    for name, dtype, op, args in graph.values:
        if name in saturating:
            # A block whose every score the clamp holds at one bound (T5's clamped offset, in every block farther
            # from the diagonal than its distance) reads that bound's one value: no gather of a whole block, which
            # Triton stages through shared memory. Blocks near the diagonal gather as before.
            clamp = saturating[name]
            condition, value = _at_bounds(clamp, values[clamp][3], lambda side: at_bound(name, clamp, side))
            lines += [f"if {condition}:", f"    {name} = tl.broadcast({value}, {ref(values[clamp][3][0])})[0]", "else:",
                      f"    {name} = {expression(dtype, op, args)}"]
        else:
            lines.append(f"{name} = {expression(dtype, op, args)}")
        dtypes[name] = dtype
        if name in saturating.values():
            x, low, high = (ref(args[0]), *args[1:])
            if low != "None":
                lines.append(f"{name}_below = tl.max({x}) <= {low}")
            if high != "None":
                lines.append(f"{name}_above = tl.min({x}) >= {high}")
    result = graph.result
    if graph.kind == "score_mod":
        r = _scalar(ref(result), "float32") if _is_number(result) else f"{ref(result)}.to(tl.float32)"
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
