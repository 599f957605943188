"""Block sparsity of a mask mod: which key blocks each query block needs, as FlexAttention's BlockMask.

The mask is evaluated with torch on the device, from the mod's canonical text (so exactly the function
the kernel runs, out-of-range reads as 0 included), over the whole (query, key) grid, and reduced per
(BLOCK_M, BLOCK_N) block to empty (skipped), full (every real pair kept) or partial. Per query block the
non-empty key blocks are listed in order (``count``, ``indices``, ``full``: Flex's ``kv_num_blocks`` and
``kv_indices``), and the kernel walks them as runs of neighbouring blocks of one kind, leaving the mask out
of the full ones. A row is a (b, h, query block); a
mod whose graph reads neither ``b`` nor ``h`` gets one row per query block, shared by every head.

Tables are cached per (canonical text, captured tensors' identity and version, the sizes the mod reads,
block sizes, device): new values written into a captured tensor (its version moves) recompute it. Not
cached: tables of inference tensors (which have no version); and while a CUDA graph is captured the table
is always built inside the graph, so that every replay rebuilds it from the tensors' values then.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tilegen.mods.lower import _COMPARE, _is_number, compute_dtype, number_value, parse

__all__ = ["BlockTable", "backward_tables", "block_table", "evaluate_mask"]

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "int32": torch.int32, "int64": torch.int64, "int16": torch.int16, "int8": torch.int8,
                 "uint8": torch.uint8, "bool": torch.bool}
# Elements of the boolean mask evaluated at once (a chunk of query rows): bounds the device memory a
# call with a mod that reads b and h takes, whatever its sequence lengths.
_CHUNK = 1 << 25
_KEPT = 32


@dataclass(frozen=True, eq=False)
class BlockTable:
    """Per row: int32 ``count`` [rows] non-empty key blocks, listed in int32 ``indices`` [rows, k_blocks] with
    int8 ``full`` (the mod keeps the block whole); and the same as runs of neighbouring blocks of one kind, which
    the kernel reads (``run_count`` [rows]; ``run_start``, ``run_end`` (block indices, end excluded) and
    ``run_full`` [rows, k_blocks]). ``stride_b``/``stride_h``: rows between batches/heads (0 where the mod reads
    neither). ``transposed``: a row per (b, h, key block) listing query blocks instead (the backward's dK/dV kernel,
    which streams query blocks past a key block); ``block_m``/``block_n`` are the query and key blocks either way."""

    count: torch.Tensor
    indices: torch.Tensor
    full: torch.Tensor
    run_count: torch.Tensor
    run_start: torch.Tensor
    run_end: torch.Tensor
    run_full: torch.Tensor
    stride_b: int
    stride_h: int
    block_m: int
    block_n: int
    transposed: bool = False

    def kernel_args(self) -> tuple:
        return (self.run_count, self.run_start, self.run_end, self.run_full, self.stride_b, self.stride_h,
                self.indices.shape[1])

    def list_args(self) -> tuple:
        """The lists as a kernel that walks them block by block reads them (the warp-specialized Gluon kernel, whose
        loader and consumers each step through the same blocks)."""
        return self.count, self.indices, self.full, self.stride_b, self.stride_h, self.indices.shape[1]


def _first(flags: torch.Tensor) -> torch.Tensor:
    """Per row, the columns where ``flags`` holds, in order, then the others (a stable sort)."""
    return torch.sort((~flags).to(torch.int8), dim=1, stable=True).indices


def _number(token: str, device):
    if token in ("True", "False"):
        return torch.tensor(token == "True", device=device)
    value = float(token)
    if value.is_integer() and not any(c in token for c in ".ena"):
        return torch.tensor(int(token), device=device)
    return torch.tensor(value, device=device)


def evaluate_mask(text: str, tensors, b, h, q_idx, kv_idx) -> torch.Tensor:
    """The mask mod of canonical ``text`` on broadcasting int32 index tensors, with the kernel's semantics
    (tilegen.mods.lower): integer ``//`` and ``%`` floor, an index outside a captured tensor reads 0."""
    graph = parse(text)
    if graph.kind != "mask_mod":
        raise ValueError(f"not a mask mod: {text[:40]!r}")
    device = q_idx.device
    env = {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
    dtypes = {"b": "int32", "h": "int32", "q_idx": "int32", "kv_idx": "int32"}
    env.update({f"t{i}": t for i, t in enumerate(tensors)})

    def val(a):
        return _number(a, device) if _is_number(a) else env[a]

    for name, dtype, op, args in graph.values:
        to = _TORCH_DTYPES[dtype]
        if op == "getitem":
            t = env[args[0]]
            index, valid = [], None
            for d, i in enumerate(args[1:]):
                i = val(i).long()
                ok = (i >= 0) & (i < t.shape[d])
                valid = ok if valid is None else valid & ok
                index.append(i.clamp(0, t.shape[d] - 1))
            index = torch.broadcast_tensors(*index)
            r = torch.where(valid, t[index], torch.zeros((), dtype=t.dtype, device=device))
        elif op == "to":
            x = val(args[0])
            r = x != 0 if args[1] == "bool" else x.to(_TORCH_DTYPES[args[1]])
        elif op in ("tanh", "exp", "log", "sqrt"):
            r = getattr(torch, op)(val(args[0]).float())
        elif op == "not":
            r = ~val(args[0])
        else:
            # Operands converted to the type the text's torch computed in (not the one these tensors' shapes would
            # promote to: a number here is a 0-dim tensor, there a Python number), as the kernel does.
            kind = compute_dtype(op, args, dtypes, dtype)
            operands = args[1:] if op == "where" else args
            wide = kind in ("float16", "bfloat16") and op != "where"  # in float32, rounded once: as the kernel
            a = []
            for x in operands:
                if x == "None" or _is_number(x):
                    a.append(None if x == "None" else number_value(x))
                else:
                    a.append(env[x].to(_TORCH_DTYPES[kind]).float() if wide else env[x].to(_TORCH_DTYPES[kind]))
            is_int = kind not in ("float32", "float16", "bfloat16") and not wide
            if op == "floordiv":
                r = torch.div(a[0], a[1], rounding_mode="floor") if is_int else torch.floor(a[0] / a[1])
            elif op == "mod":
                r = torch.remainder(a[0], a[1]) if is_int else a[0] - torch.floor(a[0] / a[1]) * a[1]
            elif op == "where":
                r = torch.where(val(args[0]).bool(), *a)
            elif op == "clamp":
                r = a[0]
                if a[1] is not None:
                    r = torch.clamp(r, min=a[1])
                if a[2] is not None:
                    r = torch.clamp(r, max=a[2])
            else:
                r = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide,
                     "neg": torch.neg, "abs": torch.abs, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
                     "ge": torch.ge, "eq": torch.eq, "ne": torch.ne, "and": torch.bitwise_and,
                     "or": torch.bitwise_or, "minimum": torch.minimum, "maximum": torch.maximum}[op](*a)
            if wide and op not in _COMPARE:
                r = r.to(_TORCH_DTYPES[kind])
        dtypes[name] = dtype
        env[name] = r.to(to)
    result = val(graph.result)
    return result != 0


@functools.lru_cache(maxsize=256)  # read at every call, before the cache lookup
def _reads(text: str) -> frozenset[str]:
    """The roles the mod's graph reads (the tracer dropped dead code, so a role named is a role used)."""
    graph = parse(text)
    used = {a for _, _, _, args in graph.values for a in args} | {graph.result}
    return frozenset(used & {"b", "h", "q_idx", "kv_idx"})


def _build(text, tensors, batch, heads, n_q, n_k, block_m, block_n, device, transposed) -> BlockTable:
    reads = _reads(text)
    rows_b = batch if "b" in reads else 1
    rows_h = heads if "h" in reads else 1
    q_blocks, k_blocks = -(-n_q // block_m), -(-n_k // block_n)
    i32 = dict(dtype=torch.int32, device=device)
    b = torch.arange(rows_b, **i32).view(-1, 1, 1, 1)
    h = torch.arange(rows_h, **i32).view(1, -1, 1, 1)
    kv = torch.arange(n_k, **i32).view(1, 1, 1, -1)
    pad_k = k_blocks * block_n - n_k
    any_parts, all_parts = [], []
    step = max(1, _CHUNK // max(1, rows_b * rows_h * n_k * block_m)) * block_m
    for r0 in range(0, n_q, step):
        r1 = min(r0 + step, n_q)
        q = torch.arange(r0, r1, **i32).view(1, 1, -1, 1)
        keep = torch.broadcast_to(evaluate_mask(text, tensors, b, h, q, kv), (rows_b, rows_h, r1 - r0, n_k))
        # Padding rows (past n_q) are never stored and padding keys the kernel masks by n_k: neither makes a
        # block non-empty, and neither keeps a block from being full.
        pad_q = -(r1 - r0) % block_m
        for fill, parts in ((False, any_parts), (True, all_parts)):
            m = torch.nn.functional.pad(keep, (0, pad_k, 0, pad_q), value=fill)
            m = m.view(rows_b, rows_h, (r1 - r0 + pad_q) // block_m, block_m, k_blocks, block_n)
            parts.append(m.any(dim=(3, 5)) if not fill else m.all(dim=(3, 5)))
    if not any_parts:  # no query: a table of no rows' blocks
        any_parts = all_parts = [torch.zeros((rows_b, rows_h, 0, k_blocks), dtype=torch.bool, device=device)]
    nonempty = torch.cat(any_parts, dim=2)
    full = torch.cat(all_parts, dim=2) & nonempty
    if transposed:
        nonempty, full = nonempty.transpose(2, 3), full.transpose(2, 3)
    per_row, columns = nonempty.shape[2:]  # query blocks of a (b, h), or key blocks when transposed; the other
    # Rows spelled out: with no key (or, transposed, no query) there are no columns to infer them from.
    nonempty, full = nonempty.reshape(rows_b * rows_h * per_row, columns), full.reshape(rows_b * rows_h * per_row,
                                                                                       columns)
    # Non-empty blocks first, each group in key order: the kernel reads count of them.
    order = _first(nonempty)
    count = nonempty.sum(dim=1, dtype=torch.int32)
    # Runs: the kernel gives a run one loop (three, for the ranges' masked edges), whose iterations the compiler
    # can software-pipeline; a loop per block has one iteration, nothing to overlap (not yet timed on a GPU).
    kind = nonempty.to(torch.int8) + full.to(torch.int8)  # 0 empty, 1 partial, 2 full
    edge = torch.ones_like(kind[:, :1], dtype=torch.bool)
    changes = kind[:, 1:] != kind[:, :-1]
    starts = (kind != 0) & torch.cat([edge, changes], dim=1)
    ends = (kind != 0) & torch.cat([changes, edge], dim=1)
    first_of, last_of = _first(starts), _first(ends)
    return BlockTable(count.contiguous(), order.to(torch.int32).contiguous(),
                      torch.gather(full, 1, order).to(torch.int8).contiguous(),
                      starts.sum(dim=1, dtype=torch.int32).contiguous(), first_of.to(torch.int32).contiguous(),
                      (last_of + 1).to(torch.int32).contiguous(),
                      (torch.gather(kind, 1, first_of) == 2).to(torch.int8).contiguous(),
                      rows_h * per_row if rows_b > 1 else 0, per_row if rows_h > 1 else 0, block_m, block_n, transposed)


_tables: OrderedDict = OrderedDict()


def backward_tables(text: str, tensors, batch: int, heads: int, n_q: int, n_k: int, config, device) -> dict:
    """The attention backward's launch arguments for a mask mod under ``config`` (``attention_bwd``'s): the dK/dV
    kernel's table, transposed (it streams query blocks past a key block), and the dQ kernel's, None where dQ is
    added by atomics and that kernel does not run."""
    sizes = (text, tensors, batch, heads, n_q, n_k)
    return {"mod_blocks_dkdv": block_table(*sizes, config.block_m1, config.block_n1, device, True),
            "mod_blocks_dq": None if config.atomic_dq else block_table(*sizes, config.block_m2, config.block_n2,
                                                                      device)}


def block_table(text: str, tensors, batch: int, heads: int, n_q: int, n_k: int, block_m: int, block_n: int,
                device, transposed: bool = False) -> BlockTable:
    """The cached table of a mask mod for a call's sizes and the kernel's blocks (module docstring); ``transposed``:
    per key block, the query blocks (``BlockTable``)."""
    reads = _reads(text)
    capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
    try:
        versions = tuple((id(t), t._version) for t in tensors)
    except RuntimeError:  # an inference tensor has no version: its new values could not be told apart
        versions = None
    key = (text, versions, batch if "b" in reads else 1, heads if "h" in reads else 1, n_q, n_k, block_m, block_n,
           str(device), transposed)
    # While a CUDA graph is captured the table is built inside it, never taken from the cache: a replay then
    # rebuilds it from the captured tensors' values of that moment (as the kernel reads them), and the graph
    # holds no tensor the cache could drop.
    hit = _tables.get(key) if versions is not None and not capturing else None
    # The entry holds its tensors, so an id in the key cannot be a later tensor's while the entry lives.
    if hit is not None and all(a is b for a, b in zip(hit[0], tensors)):
        _tables.move_to_end(key)
        return hit[1]
    table = _build(text, tensors, batch, heads, n_q, n_k, block_m, block_n, device, transposed)
    # One built while a graph is captured holds its values only once the graph replays: no eager call may read it.
    if versions is not None and not capturing:
        _tables[key] = (tuple(tensors), table)
        while len(_tables) > _KEPT:
            _tables.popitem(last=False)
    return table
