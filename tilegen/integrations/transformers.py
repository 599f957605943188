"""tilegen attention inside Hugging Face transformers models, through their ``AttentionInterface``.

    from tilegen.integrations import transformers as tilegen_hf
    model = AutoModelForCausalLM.from_pretrained(name)
    tilegen_hf.use_tilegen(model)   # or: register(), then from_pretrained(..., attn_implementation="tilegen")

Every attention call of the model then runs in tilegen:

- no mask (or an all-ones one): ``tilegen.attention``, causal from the module, aligned bottom-right, so a
  decoding step against transformers' caches (fewer queries than keys) is the same call;
- padding, left or right, and packed sequences: ``tilegen.varlen_attention`` on the real tokens only,
  read where they lie in the padded tensors (a mask with holes in a row has its real tokens gathered).
  ``register()`` installs a mask builder that, like FlashAttention-2's, hands the attention function the
  2-d padding mask (bool) or the packed sequences' ids (int64, one id per sequence) instead of a dense
  ``[batch, 1, n_q, n_k]`` mask; transformers' ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword
  arguments (padding-free training) are taken as they are. A causal call's padded rows' outputs are zeros; a
  bidirectional call's mask pads its keys only (it may be cross-attention, whose queries the mask does not
  describe), so every query attends the real keys, as in transformers' own attention;
- a decoding step of a padded batch (one query a row, at its row's last key): ``tilegen.PagedDecode`` over
  transformers' cache where it lies, each key a page of one slot (``_decode``), instead of a ragged copy of K
  and V on every step and layer;
- sliding windows (``sliding_window``: the ``sliding_window`` keys up to and including the query's own,
  as transformers' masks keep ``kv_idx > q_idx - sliding_window``), softcap, GQA, the module's scaling;
- training: both tilegen ops are differentiable.

What it cannot serve it hands to PyTorch's SDPA (or the model's eager attention when softcap, attention
sinks or the attention weights are needed), with one warning per reason: a mask pattern transformers
built from anything but causal, sliding-window, padding and packing (chunked, image-token overlays, a
4-d mask of the caller's that is not causal over padding), attention dropout while training,
``output_attentions``, attention sinks, a sliding window over a padding mask with holes (several queries a row).

The ragged path reads its max lengths on the host: one synchronization per forward (per mask), as
FlashAttention-2's padding path has; the unmasked path has none. That layout is kept with the mask object and its
version counter, so an in-place write to a mask is seen, except one that bypasses the counter (through ``.data``
or a NumPy view of the tensor) or one to a mask made under ``torch.inference_mode``, which counts no versions: a mask
changed so must be a new tensor.

transformers is imported by ``register()``, ``use_tilegen()`` and ``mask_forward`` only, never when tilegen is.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from tilegen.families.attention_fwd.spec import SUPPORTED_HEAD_DIMS
from tilegen.ops.attention import attention_seq_major
from tilegen.ops.decode import PagedDecode
from tilegen.ops.kv_cache import PagedKVCache
from tilegen.ops.tensors import empty_like_template
from tilegen.ops.varlen import call_key, padded_call, varlen_attention, varlen_attention_padded

__all__ = ["NAME", "attention_forward", "mask_forward", "register", "use_tilegen"]

#: The ``attn_implementation`` name ``register()`` uses by default.
NAME = "tilegen"

_warned: set[str] = set()
# Bound once: each attribute lookup on the way to them is paid on every call of a decoding step.
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_empty_like = torch.empty_like
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # a CUDA build's; asked of CUDA tensors only


def _warn_once(reason: str, target: str) -> None:
    # Once per reason and process: a model calls attention once per layer and step.
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"tilegen attention: {_MESSAGES[reason]}; running such calls in {target} instead",
                      RuntimeWarning, stacklevel=4)


_EMPTY: Any = {}  # a missing instance dict, and the marker of a missing attribute


def _module_attribute(module: Any, name: str, default: Any) -> Any:
    """``getattr(module, name, default)`` for an attribute the module's instance dict lacks: the class's (a value or
    a property). A class that lacks it too is remembered, since finding that out raises inside ``getattr``, which
    costs a quarter of a microsecond a call (Llama's modules have no ``sliding_window``)."""
    cls = type(module)
    if _lacks(cls, name):
        return default
    return getattr(module, name, default)


@functools.cache
def _lacks(cls: type, name: str) -> bool:
    return not hasattr(cls, name)


# _lacks(cls, "sliding_window") by class, asked on every call of a module without the attribute: a dictionary's
# lookup costs half of the cached function's.
_windowless: dict[type, bool] = {}


def _dense(query, key, value, causal, window, softcap, scale) -> torch.Tensor:
    """``tilegen.attention`` in transformers' output layout ``[batch, n_q, heads, head_dim_v]``, written there by
    the kernel (``attention_seq_major``), not transposed after it."""
    return attention_seq_major(query, key, value, causal=causal, window=window, softcap=softcap, scale=scale)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = _EMPTY,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention function contract: ``query`` ``[batch, heads, n_q, head_dim]``, ``key`` and
    ``value`` ``[batch, kv_heads, n_k, head_dim]`` (not repeated: GQA from the head counts); returns
    ``(output [batch, n_q, heads, head_dim], None)``.

    ``attention_mask``: ``None`` (the plain causal or bidirectional pattern), a 2-d bool padding mask
    ``[batch, >= n_k]`` (1 = a real token), a 2-d integer tensor of packed sequences' ids ``[batch, n]``
    (what ``mask_forward`` hands over), or a 4-d mask: served when it is the causal (or bidirectional)
    pattern, window included, over padding, else handed to the fallback.

    ``sliding_window``: when not passed, the module's ``sliding_window`` attribute (models that leave the window
    to the mask); passed, ``None`` included, it is the call's (EXAONE 4's full-attention layers pass ``None`` while
    their module holds the config's window).
    """
    # The module's attributes read from its dict: nn.Module.__getattr__, the path of a missing one (a Llama
    # module has no sliding_window), costs microseconds on every call, and so would raising on the way.
    attrs = getattr(module, "__dict__", _EMPTY)
    if is_causal is None:
        is_causal = attrs.get("is_causal", _EMPTY)
        if is_causal is _EMPTY:
            is_causal = _module_attribute(module, "is_causal", True)
    causal = bool(is_causal)
    if sliding_window is _EMPTY:
        sliding_window = attrs.get("sliding_window", _EMPTY)
        if sliding_window is _EMPTY:  # a Llama module's case, every call: the class's lack is remembered
            windowless = _windowless.get(type(module))
            if windowless is None:
                windowless = _windowless[type(module)] = _lacks(type(module), "sliding_window")
            sliding_window = None if windowless else getattr(module, "sliding_window", None)
    window = None
    if sliding_window is not None:
        if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1:
            raise ValueError(f"tilegen attention: sliding_window: expected an int >= 1 or None, got {sliding_window!r}")
        # Causal: the query and the sliding_window - 1 keys before it. Bidirectional: transformers' overlay
        # keeps |q_idx - kv_idx| <= sliding_window.
        window = (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)

    reason = None
    if dropout:
        reason = "dropout"
    elif kwargs.get("output_attentions"):
        reason = "output_attentions"
    elif kwargs.get("s_aux") is not None:
        reason = "s_aux"
    elif attention_mask is not None and attention_mask.dim() != 2:
        if attention_mask.dim() != 4:
            raise ValueError(f"tilegen attention: attention_mask: expected a 2-d padding mask or sequence ids, or a "
                             f"4-d mask, got the shape {tuple(attention_mask.shape)}")
        # A dense mask of the caller's (or a builder's): served when it is the causal (or bidirectional)
        # pattern, the window, and padding, which its 2-d padding mask then stands for.
        padding = _layout(attention_mask, query.shape[2], key.shape[2], (causal, sliding_window, query.shape[0]),
                          _padding_of_dense)
        if padding is None:
            _check_dense_mask(attention_mask, query, key)
            reason = "mask"
        else:
            attention_mask = padding
    if reason is not None:
        return _fallback(reason, module, query, key, value, attention_mask, dropout, scaling, causal,
                         sliding_window, softcap, kwargs)

    # The head dims are checked where the call's spec is made (a try costs nothing until it raises): one the kernels
    # do not take goes to the fallback, as transformers' tiny models' (head dim 4) do.
    try:
        cu_q = kwargs.get("cu_seq_lens_q")
        if cu_q is not None and (attention_mask is None or attention_mask.dtype != torch.bool):
            cu_k, max_q, max_k = kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_q"), kwargs.get("max_length_k")
            if cu_k is not None and max_q is not None and max_k is not None:
                # Sequences packed along each row (padding-free training): the flattened tensors, read in place.
                return varlen_attention_padded(query, key, value, _as_offsets(cu_q), _as_offsets(cu_k), int(max_q),
                                               int(max_k), causal=causal, window=window, softcap=softcap,
                                               scale=scaling), None

        if attention_mask is None:
            return _dense(query, key, value, causal, window, softcap, scaling), None

        shape_q, shape_k = query.shape, key.shape  # each .shape is a new torch.Size: read once
        batch, n_q, n_k = shape_q[0], shape_q[2], shape_k[2]
        if attention_mask.dtype is torch.bool:
            # A bidirectional window counts positions of one sequence: its queries are the keys' own, as a causal
            # call's are (_padding_layout).
            layout = _layout(attention_mask, n_q, n_k, causal or window is not None, _padding_layout)
            rows = layout.batch
        else:
            if attention_mask.is_floating_point() or attention_mask.is_complex():
                raise ValueError(f"tilegen attention: attention_mask: a 2-d mask is a bool padding mask or integer ids "
                                 f"of packed sequences, got {attention_mask.dtype}")
            layout, rows = None, attention_mask.shape[0]
        # The ragged batch's offsets come from the mask: a batch that disagrees would read other rows' tokens. Value's
        # batch is checked where the call goes: by the op (tilegen.attention, varlen_attention_padded), or below.
        if shape_k[0] != batch or rows != batch:
            _check_batch(batch, key=shape_k[0], attention_mask=rows)
        if layout is None:  # packed sequences' ids
            if n_q != n_k or attention_mask.shape != (batch, n_q):
                raise ValueError(f"tilegen attention: attention_mask: packed sequences' ids [batch, n] need n queries "
                                 f"and n keys; got ids {tuple(attention_mask.shape)} for {n_q} queries and {n_k} keys")
            layout = _layout(attention_mask, n_q, n_k, causal, _segments_layout)
            return _in_place(layout, query, key, value, causal, window, softcap, scaling), None

        if layout.keys != n_k:
            # A static cache: its keys past the mask's length are not written yet (FlashAttention-2's path cuts them
            # too).
            n_k = layout.keys
            key, value = key[:, :, :n_k], value[:, :, :n_k]
            shape_k = key.shape
        if n_k == 0:  # no key: every query sees none, and its row is zeros, as a padded one's
            if _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
                # The op's zeros, which have a grad_fn: new ones would leave the inputs no gradient (None, not 0).
                return _dense(query, key, value, causal, window, softcap, scaling), None
            return query.new_zeros(batch, n_q, shape_q[1], value.shape[3]), None
        if layout.full:
            return _dense(query, key, value, causal, window, softcap, scaling), None
        if n_q == 1 and layout.decodes:
            out = _decode(query, key, value, attention_mask, n_k, window, softcap, scaling, layout.steps,
                          (shape_q, shape_k))
            if out is not None:
                return out, None
        if layout.rows_q is None:  # each row's real tokens are one run: read in place
            return _in_place(layout, query, key, value, causal, window, softcap, scaling), None
        if window is not None:
            # A row with holes: transformers counts a window in positions, the gathered batch in real tokens.
            return _fallback("holes", module, query, key, value, attention_mask, dropout, scaling, causal,
                             sliding_window, softcap, kwargs)
        _check_batch(batch, value=value.shape[0])
        heads, dim = shape_q[1], shape_q[3]
        q = query.transpose(1, 2).reshape(batch * n_q, heads, dim).index_select(0, layout.rows_q)
        k = key.transpose(1, 2).reshape(batch * n_k, key.shape[1], dim).index_select(0, layout.rows_k)
        v = value.transpose(1, 2).reshape(batch * n_k, value.shape[1], value.shape[3]).index_select(0, layout.rows_k)
        out = varlen_attention(q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, causal=causal,
                               window=window, softcap=softcap, scale=scaling)
        # Padded query rows stay zeros; index_copy (not in place) keeps the scatter differentiable.
        full = out.new_zeros(batch * n_q, heads, out.shape[2]).index_copy(0, layout.rows_q, out)
        return full.view(batch, n_q, heads, out.shape[2]), None
    except ValueError:
        if _served_dims(query, value):
            raise
        return _fallback("head_dim", module, query, key, value, attention_mask, dropout, scaling, causal,
                         sliding_window, softcap, kwargs)


def _served_dims(query, value) -> bool:
    """Whether the kernels take query's and value's head dims (values of any type: the op names a bad one)."""
    dims = getattr(query, "shape", (0,))[-1:] + getattr(value, "shape", (0,))[-1:]
    return all(d in SUPPORTED_HEAD_DIMS for d in dims)


def _in_place(layout: _Layout, query, key, value, causal, window, softcap, scaling) -> torch.Tensor:
    """``varlen_attention_padded`` on the layout's offsets, whose key (a quarter of the call's host time) the layout
    keeps for each module's arguments: every layer of a forward makes the same call on the same offsets."""
    args = (causal, window, softcap, scaling)
    # With the arguments' types, as call_key has them (True == 1 == 1.0, but a scale of True is refused); causal is
    # a bool, and the window's bounds ints (attention_forward checks sliding_window).
    memo = (args, softcap.__class__, scaling.__class__)
    try:
        call = layout.calls.get(memo)
    except TypeError:  # an unhashable argument: the op says which
        return varlen_attention_padded(query, key, value, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k,
                                       causal=causal, window=window, softcap=softcap, scale=scaling)
    fresh = call is None
    if fresh:
        call = call_key(layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, *args)
    out = padded_call(call, query, key, value, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, *args)
    # Kept once the op took the arguments (a NaN scale, refused, would add one a call), and not while Dynamo
    # traces: it guards the dictionary on what this frame found there.
    if fresh and not torch.compiler.is_compiling():
        layout.calls[memo] = call
    return out


def _check_batch(batch: int, **sizes: int) -> None:
    for name, size in sizes.items():
        if size != batch:
            raise ValueError(f"tilegen attention: {name} has a batch of {size}, query of {batch}")


def _decode(query, key, value, mask, n_k, window, softcap, scaling, steps: dict, shapes) -> torch.Tensor | None:
    """A padded decoding step (one query a row, at its row's last key) on ``PagedDecode``, reading transformers'
    cache where it lies: each key a page of one slot, the page table listing each row's real keys. ``None`` (the
    caller takes the ragged path) when the cache's layout cannot be read so, a gradient is wanted (the decode
    kernel has no backward) or the call is being compiled.

    ``shapes``: query's and key's. ``steps``: the mask layout's launches by everything ``PagedDecode.run`` checks
    (shapes, strides, dtypes and devices of q, k and v, the window, softcap and scale). The first call of a kind
    runs through ``PagedDecode.run`` and keeps a launch that takes transformers' tensors through views
    (``PagedDecode._launch_through``); the others (every later layer of the step) launch it, where the views, the
    layer's cache and ``run``'s checks cost about twice the rest of the call's host time (CPU machine)."""
    # Under torch.compile the ragged path's op runs (a PagedDecode plan would have to be made outside the trace).
    if _compiling() or (_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)):
        return None
    # A contiguous tensor's strides follow from its shape, and asking is_contiguous() costs half of reading them;
    # not for dims of one element, which address nothing but in a cache of one key: its token stride sets the
    # distance between rows in slots (_slots). n_k is not in the key: the steps are the layout's, whose length and
    # key's shape fix it. The arguments enter with their types (True == 1.0, but a scale of True is refused).
    step_key = (*shapes, value.shape, query.is_contiguous() or query.stride(),
                key.stride() if n_k == 1 else key.is_contiguous() or key.stride(),
                value.stride() if n_k == 1 else value.is_contiguous() or value.stride(), query.dtype, key.dtype,
                value.dtype, query.device, key.device, value.device, window, softcap, scaling, softcap.__class__,
                scaling.__class__)
    step = steps.get(step_key)
    if step is not None:
        replay, tail, out_like = step
        out = _empty_like(out_like)
        # The step's own launch: its key fixes every view, so its replay needs no key of its own.
        replay(None, query, key, value, out, out, *tail)
        return out
    _check_batch(query.shape[0], value=value.shape[0])  # once a kind of step: its key holds value's shape
    # What PagedDecode refuses (dtypes or head dims that disagree, a dtype it does not take) goes to the ragged
    # path, whose op names the caller's query, key and value, as an unpadded call's does, rather than the pages.
    if shapes[1][3] != shapes[0][3]:
        return None
    if query.shape[0] * n_k > _MAX_SLOTS:  # the page table's entries, one a key of the padded batch
        return None
    pages = _slots(key, n_k)
    v_pages = _slots(value, n_k)
    if pages is None or v_pages is None or pages[1] != v_pages[1]:
        return None
    # The window is the table's: it lists the keys the query sees by position, so holes in a row count as
    # transformers counts them.
    left = None if window is None else window[0]
    table = _layout(mask, 1, n_k, (pages[1], left), _slot_table)
    try:
        # The first layer's cache is checked whole; the other layers' pages, laid out alike, take its checks. The
        # table keeps it without pages: a layer's K and V must not outlive its call.
        if table.cache is None:
            cache = PagedKVCache(pages[0], v_pages[0], *table.pages)
            table.cache = cache._without_pages()
        else:
            cache = table.cache.with_pages(pages[0], v_pages[0])
        plan_key = (query.shape[1], query.dtype, cache._layout, softcap, scaling, softcap.__class__,
                    scaling.__class__)
        decode = table.plans.get(plan_key)
        if decode is None:
            decode = PagedDecode()
            # n_k (or the window) bounds every row; the longest real row would need a synchronization to read.
            decode.plan(cache, heads_q=query.shape[1], softcap=softcap, scale=scaling,
                        max_seqlen_k=n_k if left is None else min(n_k, left + 1), q_dtype=query.dtype)
            table.plans[plan_key] = decode
    except (ValueError, TypeError):
        return None
    out = decode.run(query.select(2, 0), cache).unsqueeze(1)
    slots = functools.partial(_slot_pages, n=n_k)
    steps[step_key] = (*decode._launch_through(cache, {1: slots, 2: slots, 3: _heads_first}),
                       empty_like_template(out.shape, out.dtype, out.device))
    return out


def _slot_pages(t: torch.Tensor, n: int) -> torch.Tensor:
    return _slots(t, n)[0]


def _heads_first(out: torch.Tensor) -> torch.Tensor:
    """The decode launcher's ``[batch, heads, 1, dim]`` view of a ``[batch, 1, heads, dim]`` output."""
    return out.transpose(1, 2)


# The page table's token positions are int32 (PagedKVCache's bound).
_MAX_SLOTS = 2 ** 31 - 1


def _slots(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int] | None:
    """``t`` ``[batch, heads, n, dim]`` seen as pages of one slot ``[slots, 1, heads, dim]`` in place, with the
    slot of row ``b``'s token ``i`` at ``b * row + i``: ``(pages, row)``, or ``None`` when the strides do not allow
    it. Slots between rows alias other heads' keys (a head-major cache); the page table never lists them."""
    batch, heads, _, dim = t.shape
    s_batch, s_head, s_token, s_dim = t.stride()
    if (s_dim != 1 and dim > 1) or s_token <= 0 or s_batch % s_token:
        return None
    row = s_batch // s_token
    slots = (batch - 1) * row + n
    if slots > _MAX_SLOTS:  # page ids are int32
        return None
    try:
        return t.as_strided((slots, 1, heads, dim), (s_token, s_token, s_head, 1)), row
    except RuntimeError:  # past the storage: a view whose rows are not laid out at a fixed distance
        return None


@dataclass
class _SlotTable:
    """A padding mask's page table over one-slot pages (within a window, when the call has one): ``pages``
    ``(indptr, indices, last_page_len)``, the ``PagedDecode`` plans made on it (one per head count, dtype, softcap
    and scale) and the first layer's cache over it, holding no pages (``PagedKVCache.with_pages`` gives it each
    layer's)."""

    pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    plans: dict = field(default_factory=dict)
    cache: PagedKVCache | None = None


def _slot_table(mask: torch.Tensor, n_q: int, n_k: int, pattern: tuple[int, int | None]) -> _SlotTable:
    row, left = pattern
    mask_k = mask[:, -n_k:] if mask.shape[1] > n_k else mask
    if left is not None:  # the query sits at key n_k - 1 and sees the left keys before it
        mask_k = mask_k & (torch.arange(n_k, device=mask.device) >= n_k - 1 - left)
    batch = mask_k.shape[0]
    lens = mask_k.sum(-1)
    indptr = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    # Each row's real keys first, in order; entry e of the table is key e - indptr[b] of its row b. Computed
    # for every slot of the padded batch (the entries past indptr[-1] are never read): no synchronization.
    real_first = torch.sort((~mask_k).to(torch.int8), dim=1, stable=True).indices
    entry = torch.arange(batch * n_k, device=mask.device)
    b = (torch.searchsorted(indptr[1:], entry, right=True)).clamp_max(batch - 1)
    i = (entry - indptr[b]).clamp(0, n_k - 1)
    indices = (b * row + real_first.reshape(-1)[b * n_k + i]).to(torch.int32)
    return _SlotTable((indptr.to(torch.int32), indices, (lens > 0).to(torch.int32)))


def _as_offsets(cu: torch.Tensor) -> torch.Tensor:
    # transformers' collators give int64 (or int32) offsets; the kernel reads contiguous int32.
    return cu if cu.dtype == torch.int32 and cu.is_contiguous() else cu.to(torch.int32).contiguous()


@dataclass(frozen=True)
class _Layout:
    """A mask's ragged batch: rows of the flattened ``[batch * n]`` tensors that are real tokens, their
    offsets per sequence and the host-side max lengths."""

    full: bool  # no padding at all: the dense kernel, with no gather
    # Every row's queries are real, or it has no key: with one query a row (a decoding step), each query sits at
    # its row's last key, so PagedDecode serves the call (_decode).
    decodes: bool
    # None: the flattened tensors are the ragged batch (each row's real tokens one run), no gather
    rows_q: torch.Tensor | None
    rows_k: torch.Tensor | None
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None
    max_q: int
    max_k: int
    batch: int  # the mask's rows
    # The keys the call reads: a static cache's keys past the mask's length are not written yet
    keys: int
    # A padded decoding step's launches (_decode), one per kind of layer: kept with the mask, and with the layout
    # when a CUDA graph captures it, since they hold the page table and the plans' partials that the graph replays.
    steps: dict = field(default_factory=dict, compare=False)
    # The in-place calls' keys of their arguments past q, k and v (varlen's call_key), by those arguments
    calls: dict = field(default_factory=dict, compare=False)


# transformers hands every layer the same mask object in one forward; its ragged layout (a host
# synchronization for the max lengths, a few small kernels) is computed by the first layer and reused by
# the others. Keyed by id() and validated by a weak reference plus the tensor's version counter: an id
# or data_ptr alone can be reused by the next forward's mask once this one is freed, with other values.
_layouts: dict[tuple, tuple[weakref.ref, int, Any]] = {}
_MAX_LAYOUTS = 16
# Layouts a CUDA graph was captured with, by id: the graph replays their tensors (offsets, page tables, a decode
# plan's partials) long after their mask and its entry above are gone, so they live as long as the process.
_captured: dict[int, Any] = {}
# The last layout found, (the weak reference to its mask, the mask's version, the other arguments, the layout):
# the next call's first look, a third of the dictionary's host time, since every layer asks for the same one. It
# keeps that one layout past its mask's life, until a call with another mask.
_last: tuple = (lambda: None, -1, None, None)


def _capturing(t: torch.Tensor) -> bool:
    # Not asked while Dynamo traces: the question is about an eager capture, and tracing it could break a graph
    # that torch.compile(fullgraph=True) needs whole. Nothing captures on the legacy default stream (raw stream
    # 0), and asking which stream is current costs 0.15 us on the H200's host, asking the driver whether it
    # captures 0.35.
    return t.is_cuda and not _compiling() and (
        _raw_stream(t.get_device()) != 0 and torch.cuda.is_current_stream_capturing())


def _layout(mask: torch.Tensor, n_q: int, n_k: int, pattern, build):
    global _last
    try:
        version = mask._version
    except RuntimeError:  # a tensor made under torch.inference_mode counts no versions (the module docstring)
        version = -1
    args = (n_q, n_k, pattern, build)
    last = _last
    if last[0]() is mask and last[1] == version and last[2] == args:
        layout = last[3]
    else:
        key = (id(mask), *args)
        entry = _layouts.get(key)
        if entry is None or entry[0]() is not mask or entry[1] != version:
            # Of normal tensors whatever the caller's mode: one made under torch.inference_mode (an evaluation) and
            # kept with the mask would hold offsets that a later training call on that mask cannot save for its
            # backward.
            with torch.inference_mode(False):
                layout = build(mask, n_q, n_k, pattern)
            if len(_layouts) >= _MAX_LAYOUTS:
                _layouts.clear()
            # The entry goes with its mask (generation makes a new one every step): a decode table holds plans'
            # buffers. The dictionary's pop is bound here: at interpreter exit a mask may die after the module's
            # globals are set to None.
            entry = _layouts[key] = (weakref.ref(mask, lambda _, key=key, pop=_layouts.pop: pop(key, None)), version,
                                     layout)
        _last = (entry[0], entry[1], args, entry[2])
        layout = entry[2]
    # A capture finds its layout made by the warm-up calls before it (making one synchronizes).
    if _capturing(mask):
        _captured.setdefault(id(layout), layout)
    return layout


def _padding_layout(mask: torch.Tensor, n_q: int, n_k: int, aligned: bool) -> _Layout:
    """``n_k``: the call's keys, of which it reads the mask's length at most (``_Layout.keys``). ``aligned``: the
    queries are the last n_q of the keys (a causal call, or a window, which counts positions of one sequence), so
    the mask pads them too; else it pads the keys only."""
    batch, length = mask.shape
    n_k = min(n_k, length)
    mask_k = mask[:, length - n_k:]
    if aligned:
        # A causal layer's queries are the last n_q of its keys (a cached decode step or chunked prefill); queries
        # before the first key see none (their rows are zeros, as padding's). A window needs its query and key runs
        # to be the same tokens: the ragged kernel aligns a sequence's queries on its keys bottom-right.
        mask_q = _query_rows(mask_k, n_q)
    else:
        # A bidirectional call may be cross-attention, even with as many queries as keys (seq2seq with fixed
        # padding), and nothing the call gets tells it from self-attention: masking queries by the keys' padding
        # would zero real decoder rows, while a padded query's row is ignored by the model.
        mask_q = mask_k.new_ones(mask_k.shape[0], n_q)
    lens_q = mask_q.sum(-1, dtype=torch.int32)
    lens_k = mask_k.sum(-1, dtype=torch.int32)
    runs = mask_k[:, :1].sum(-1) + (mask_k[:, 1:] & ~mask_k[:, :-1]).sum(-1)  # mask_q's: a suffix's, or one
    before_q, starts_q = _runs(mask_q, lens_q)
    before_k, starts_k = _runs(mask_k, lens_k)
    # Sequence i of the queries pairs with sequence i of the keys: [padding queries, no keys], [no queries,
    # padding keys], [real queries, real keys], ... (see _runs).
    cu_q = torch.stack([before_q, starts_q, starts_q], -1).view(-1)
    cu_k = torch.stack([before_k, before_k, starts_k], -1).view(-1)
    # The in-place batch's longest sequences: its padding runs are sequences too.
    max_q, max_k, max_runs, real, run_q, run_k, decodes = torch.stack(
        [lens_q.max(), lens_k.max(), runs.max(), lens_q.sum() + lens_k.sum(), cu_q.diff().max(),
         cu_k.diff().max(), ((lens_q == n_q) | (lens_k == 0)).all()]).tolist()
    full = real == batch * (n_q + n_k)
    if full:
        return _Layout(True, True, None, None, None, None, n_q, n_k, batch, n_k)
    if max_runs <= 1:
        return _Layout(False, bool(decodes), None, None, cu_q, cu_k, run_q, run_k, batch, n_k)
    zero = lens_q.new_zeros(1)
    return _Layout(False, bool(decodes), mask_q.reshape(-1).nonzero().view(-1), mask_k.reshape(-1).nonzero().view(-1),
                   torch.cat([zero, lens_q.cumsum(0, dtype=torch.int32)]),
                   torch.cat([zero, lens_k.cumsum(0, dtype=torch.int32)]), max_q, max_k, batch, n_k)


def _query_rows(mask_k: torch.Tensor, n_q: int) -> torch.Tensor:
    """Which of a causal call's n_q queries are real, from its keys' padding mask (queries aligned bottom-right)."""
    n_k = mask_k.shape[1]
    if n_q <= n_k:
        return mask_k[:, n_k - n_q:]
    return torch.cat([mask_k.new_zeros(mask_k.shape[0], n_q - n_k), mask_k], 1)


def _runs(mask: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a mask whose rows each hold one run of real tokens (left or right padding), where in the
    flattened ``[batch * n]`` tensor the padding before each row's run starts, and where the run starts;
    one more entry past the last row, for the padding after it.

    Offsets made of them make the padded tensor itself a ragged batch: each row's run is a sequence,
    and each run of padding two more, one of queries paired with no keys (written as zeros, the padded
    rows' output) and one of keys that no query reads. No token is gathered, no padded query attends a
    key, and the padding's values (whatever a cache holds there) never reach a real row.
    """
    batch, n = mask.shape
    # A row's run starts at its first real token (an empty row's, anywhere: it has none).
    starts = torch.arange(batch + 1, dtype=torch.int32, device=mask.device) * n
    if n:
        starts[:batch] += mask.to(torch.int8).argmax(-1).to(torch.int32)
    # The padding before a run starts where the last run ended.
    return torch.cat([starts.new_zeros(1), starts[:batch] + lens]), starts


def _padding_of_dense(mask: torch.Tensor, n_q: int, n_k: int, pattern) -> torch.Tensor | None:
    """The 2-d padding mask a ``[batch, 1, n_q, n_k]`` mask (bool, or additive float: 0 or very negative)
    is made of, given the call's causal pattern and window; ``None`` when it is not made that way.
    A key no query attends counts as padding, and so, in a causal mask, does its query row, whose output is then
    zeros (transformers' padded rows: no key at all, or, right of the sequence, arbitrary)."""
    causal, sliding_window, batch = pattern
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] != 1 or mask.shape[2:] != (n_q, n_k):
        return None
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        if not bool((allowed | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            return None  # a bias, not a mask
    else:
        return None
    padding = allowed.any(dim=2)[:, 0]
    keys = n_k
    if causal and n_q and n_k:
        # The 2-d mask stands for the queries as its last n_q keys (_padding_layout), but a static cache's mask ends
        # with slots not written yet, past the last query. A row's last allowed key is at most its query's position,
        # and is that position where the query's own key is real: the latest over the rows places the last query.
        # The keys past it no query attends; they are cut, as mask_forward cuts a 2-d mask there.
        last = torch.where(allowed[:, 0], torch.arange(n_k, device=mask.device), -1).amax(-1)
        reach = int(torch.where(last >= 0, last + torch.arange(n_q, 0, -1, device=mask.device), 0).amax())
        if 0 < reach < n_k:
            keys = reach
            padding, allowed = padding[:, :keys], allowed[..., :keys]
    expected = _dense_mask(padding, mask.shape[0], n_q, keys, causal, sliding_window, mask.device)
    # Only a causal call's queries are known to be its last keys (see _padding_layout): a bidirectional mask must
    # give every query row the keys' padding.
    rows = _query_rows(padding, n_q) if causal else padding.new_ones(padding.shape[0], n_q)
    same = (expected == allowed) | ~rows[:, None, :, None]
    if not bool(same.all()):
        return None
    return padding.expand(batch, keys).contiguous()  # one row broadcast over the batch: the same padding in each


def _segments_layout(ids: torch.Tensor, n_q: int, n_k: int, causal: bool) -> _Layout:
    batch, n = ids.shape
    # Distinct ids across rows, so that a sequence never continues into the next row.
    flat = (ids + torch.arange(batch, device=ids.device)[:, None] * (n + 1)).reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    cu = torch.cat([starts.nonzero().view(-1), flat.new_tensor([batch * n])]).to(torch.int32)
    longest = int(cu.diff().max()) if batch * n else 0
    return _Layout(False, False, None, None, cu, cu, longest, longest, batch, n)


def _check_dense_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
    """A 4-d mask the fallback hands to SDPA: one that broadcasts over ``[batch, heads, n_q, n_k]``, its keys past
    n_k cut (as transformers' SDPA path cuts them)."""
    want = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if any(m not in (1, w) for m, w in zip(mask.shape[:3], want)) or 1 < mask.shape[3] < want[3]:
        raise ValueError(f"tilegen attention: attention_mask: a 4-d mask of shape {tuple(mask.shape)} does not "
                         f"broadcast over [batch, heads, n_q, n_k] = {list(want)}")


def _fallback(reason, module, query, key, value, mask, dropout, scaling, causal, sliding_window, softcap, kwargs):
    """The call in SDPA, or in the model's own eager attention when SDPA cannot take it (softcap,
    attention sinks, the attention weights), on the mask transformers would have built."""
    eager = None
    if softcap is not None or kwargs.get("s_aux") is not None or kwargs.get("output_attentions"):
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise NotImplementedError(f"tilegen attention: {_MESSAGES[reason]}, and {type(module).__name__}'s "
                                      "module has no eager_attention_forward to fall back to")
    _warn_once(reason, "eager attention" if eager is not None else "SDPA")
    n_q, n_k = query.shape[2], key.shape[2]
    keys = n_k
    built = mask is None or mask.dim() != 4
    if not built and mask.shape[3] > n_k:
        mask = mask[:, :, :, :n_k]
    if built:
        if mask is not None and mask.dtype == torch.bool and mask.shape[1] < n_k:
            key, value, n_k = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]], mask.shape[1]
        # Eager attention has no is_causal: it gets the causal pattern as a mask, where SDPA gets the flag.
        mask = _dense_mask(mask, query.shape[0], n_q, n_k, causal, sliding_window, query.device,
                           explicit=eager is not None)
    unattended = None
    if mask is not None and mask.dtype == torch.bool and built:
        # Padded query rows see no key: SDPA would give NaN there, tilegen gives zeros.
        unattended = ~mask.any(-1, keepdim=True)
        mask = mask | unattended
    if eager is not None:
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min)
        out, weights = eager(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                             sliding_window=sliding_window, softcap=softcap, **kwargs)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
            is_causal=mask is None and causal and n_q > 1, enable_gqa=query.shape[1] != key.shape[1])
        out, weights = out.transpose(1, 2).contiguous(), None
    if unattended is not None:
        out = out.masked_fill(unattended[:, 0, :, :, None], 0.0)  # [batch, n_q, 1, 1] over [batch, n_q, heads, dim]
    if weights is not None and n_k < keys:
        # The keys past the mask (a static cache's slots not written yet) have weight zero in eager attention, and
        # the caller's weights span them, as they would there.
        weights = torch.nn.functional.pad(weights, (0, keys - n_k))
    return out, weights


_MESSAGES = {
    "dropout": "attention dropout while training is not supported",
    "output_attentions": "output_attentions asks for the attention weights, which tilegen does not form",
    "s_aux": "attention sinks (s_aux) are not supported",
    "mask": "a mask that is not causal, sliding-window, padding or packed sequences (a 4-d mask, or one "
            "built with a custom or overlay mask function)",
    "holes": "a sliding window over a padding mask whose real tokens are not one run",
    "head_dim": f"a head dim other than a multiple of 8 in [{SUPPORTED_HEAD_DIMS[0]}, {SUPPORTED_HEAD_DIMS[-1]}]",
}


def _dense_mask(mask, batch, n_q, n_k, causal, sliding_window, device, explicit=False) -> torch.Tensor | None:
    """The ``[batch, 1, n_q, n_k]`` bool mask of a call's 2-d mask (padding or packed ids), causal
    pattern and window; ``None`` when there is none, or (unless ``explicit``) when that is the plain causal
    one SDPA's ``is_causal`` serves."""
    if mask is None and sliding_window is None and (not causal or (n_q == n_k and not explicit)):
        return None
    i = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=device)[None, :]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        allowed = j <= i
        if sliding_window is not None:
            allowed = allowed & (j > i - sliding_window)
    elif sliding_window is not None:
        allowed = (i - j).abs() <= sliding_window
    allowed = allowed[None, None].expand(batch, 1, n_q, n_k)
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        mask_k = mask[:, mask.shape[1] - n_k:]
        allowed = allowed & mask_k[:, None, None, :]
        if causal:  # padded queries see no key: their rows are zeros, as on tilegen's paths (_padding_layout)
            allowed = allowed & _query_rows(mask_k, n_q)[:, None, :, None]
        return allowed
    return allowed & (mask[:, None, :, None] == mask[:, None, None, :])


def mask_forward(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """The mask builder ``register()`` installs (transformers' ``AttentionMaskInterface`` contract).

    For the patterns ``attention_forward`` serves (causal or bidirectional, optionally a causal sliding
    window, packed sequences), it returns what FlashAttention-2's builder does, with nothing of size
    n_q x n_k: ``None`` when there is no padding, else the 2-d bool padding mask of the call's keys (transformers'
    columns ``kv_offset`` on), and for a causal pattern no further than the last query (``q_offset + q_length``);
    for packed sequences, their ids ``[batch, n]``. The window itself reaches the attention function as its
    ``sliding_window`` argument, as it does FlashAttention-2's. Any other pattern gets SDPA's 4-d mask, which
    ``attention_forward`` hands to the fallback. A causal mask that ends before the last query is refused: its
    queries cannot be placed on its columns; but one of exactly the call's keys' columns is taken as this builder's own
    cut (generate hands a static cache's prebuilt mask back to the model).
    """
    from transformers import masking_utils

    pattern = _pattern(mask_function if mask_function is not None else masking_utils.causal_mask_function,
                       masking_utils)
    if pattern is None:
        return masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                       q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                                       attention_mask=attention_mask, **kwargs)
    if isinstance(pattern, torch.Tensor):  # packed sequences' ids
        return pattern
    # transformers' layout: key j is the 2-d mask's column kv_offset + j, query i sits at position q_offset + i.
    kv_offset = int(kv_offset)  # a static cache's offsets are tensors: reading one synchronizes once a forward
    if pattern == "causal":
        # A static cache holds kv_length slots, of which the keys past the last query are not written yet: the
        # dense call's bottom-right causal pattern would read them, and the ragged one takes the mask's last n_q
        # columns for its queries. A mask that ends at the last query cuts those slots (attention_forward reads
        # no key past the mask) and puts the queries where transformers has them, whatever length the caller's
        # mask has (a decoding loop may pass one of the cache's full length, zeros where nothing is written).
        end = int(q_offset) + q_length
        written = end - kv_offset
        if attention_mask is None:
            if written < kv_length:
                return torch.ones(batch_size, max(written, 0), dtype=torch.bool, device=kwargs.get("device", "cpu"))
            return None
        # A mask of exactly the keys' columns is one this builder cut already: generate builds a static cache's mask
        # ahead of the forward and hands it to the model as its 2-d mask, whose columns then start at kv_offset.
        cut = kv_offset and attention_mask.shape[1] == written
        if (end > attention_mask.shape[1] and not cut) or written > kv_length:
            raise ValueError(f"tilegen attention: a 2-d attention_mask of {attention_mask.shape[1]} positions for "
                             f"queries at positions {int(q_offset)} to {end - 1} over {kv_length} keys from position "
                             f"{kv_offset}: the mask must cover every query's position")
        if not cut:
            attention_mask = attention_mask[:, kv_offset:end]
    elif attention_mask is not None:
        # Keys past the mask are padding to transformers, and attention_forward reads none of them.
        attention_mask = attention_mask[:, kv_offset:kv_offset + kv_length]
    if attention_mask is not None and attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _pattern(fn, masking_utils) -> torch.Tensor | str | None:
    """What a transformers mask function computes, from how it was composed: ``None`` when it is not
    causal or bidirectional with at most a causal sliding window and packed sequences; the packed
    sequences' ids when there are some, else ``"causal"`` or ``"bidirectional"``."""
    found = {"base": None, "window": False, "packed": None}

    def walk(f) -> bool:
        if f is masking_utils.causal_mask_function:
            found["base"] = "causal" if found["base"] in (None, "causal") else "mixed"
            return True
        if f is masking_utils.bidirectional_mask_function:
            found["base"] = "bidirectional" if found["base"] in (None, "bidirectional") else "mixed"
            return True
        cells = dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__ or ()))) \
            if hasattr(f, "__code__") else {}
        name = getattr(f, "__qualname__", "")
        if name == "and_masks.<locals>.and_mask":
            return all(walk(g) for g in cells.get("mask_functions", (None,)))
        if name == "sliding_window_overlay.<locals>.inner_mask":
            found["window"] = True
            return True
        if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
            return walk(cells.get("mask_function"))
        if name == "packed_sequence_mask_function.<locals>.inner_mask":
            found["packed"] = cells.get("packed_sequence_mask")
            return isinstance(found["packed"], torch.Tensor)
        return False

    if not walk(fn) or found["base"] not in ("causal", "bidirectional"):
        return None
    if found["window"] and found["base"] != "causal":
        return None
    return found["packed"] if found["packed"] is not None else found["base"]


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` run ``attention_forward`` in every transformers model that
    dispatches through ``AttentionInterface``, with ``mask_forward`` as its mask builder; returns ``name``.

    A mask builder must be registered under the same name: transformers builds no mask at all for a name
    without one, and padding would be ignored silently.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError("tilegen.integrations.transformers.register: needs transformers with AttentionInterface "
                          "and masking_utils.AttentionMaskInterface") from error
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward)
    return name


def use_tilegen(model: Any, name: str = NAME) -> Any:
    """Register tilegen (``register(name)``) and switch ``model``, its sub-models included, to it;
    returns ``model``."""
    register(name)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # transformers before set_attn_implementation
        model.config._attn_implementation = name
    return model
