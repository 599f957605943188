"""``tilegen.append_kv``: write a ragged batch's new K and V into a paged KV cache, in one launch.

It launches as every op does (``tilegen.dispatch.planned``): a plan per call signature, the
config chosen for its token count, the launcher's replay, a tuned row that fails at the first
launch skipped for the next choice.

FP8 caches (``float8_e4m3fn``/``float8_e5m2`` pages with their scales) take new K and V in
fp16, bf16 or fp32 and quantize them on the way in: value / scale, saturated to the format's
largest finite value (448 for e4m3fn, 57344 for e5m2), rounded to nearest."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tilegen import dispatch, env
from tilegen.dtypes import SPEC_DTYPES, SPEC_KV_DTYPES
from tilegen.families.kv_append import KVAppendSpec
from tilegen.families.kv_append.spec import MAX_HEAD_DIM
from tilegen.ir import SpecError
from tilegen.ops.kv_cache import _MAX_TOKENS, PagedKVCache
from tilegen.ops.memo import memoized
from tilegen.ops.tensors import check_device, count_writes, first_overlap, refuse_grad

__all__ = ["append_kv", "explain_append"]


def append_kv(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Write the new tokens' K and V of a ragged batch into their pages: one kernel launch.

    The page table of ``cache`` must already describe every sequence *including* its new
    tokens (update it first, then append, as FlashInfer does): sequence ``b`` then holds
    ``seq_len[b]`` tokens, and its ``n_new[b] = cu_seqlens[b + 1] - cu_seqlens[b]`` new ones
    are written at positions ``seq_len[b] - n_new[b] .. seq_len[b] - 1``. Nothing else in
    the cache changes.

    Args:
        cache: the ``tilegen.PagedKVCache`` to write into (its pages are modified in place).
        k: ``[total_new, kv_heads, head_dim]``, the cache's dtype and device, any strides; for
            an FP8 cache, float16, bfloat16 or float32 (quantized with the cache's ``k_scale``).
        v: ``[total_new, kv_heads, head_dim_v]``, likewise (``k``'s dtype; ``v_scale``).
        cu_seqlens: int32 ``[batch + 1]`` on the cache's device: the new tokens per sequence in
            FlashAttention's varlen convention (rows ``cu_seqlens[b] .. cu_seqlens[b + 1] - 1`` of
            ``k`` and ``v`` are sequence ``b``'s); ``batch`` is the cache's.

    Checks. On the host, every call (no synchronization; a call shaped like an earlier one
    reuses that call's checked plan): ``cache`` is a ``PagedKVCache``; ``k`` and ``v`` are
    3-d tensors of the cache's dtype and device with its KV heads and head dims and the same
    token count; ``cu_seqlens`` is a 1-d int32 tensor on the cache's device with one entry
    more than the cache has sequences; a batch of no sequence gets no token. With
    ``TILEGEN_DEBUG=1`` each call also checks on the device, at the cost of one
    synchronization: ``cu_seqlens`` starts at 0, never decreases and ends at ``k``'s token
    count; ``n_new[b] <= seq_len[b]`` for every sequence; and the page table itself
    (``PagedKVCache.validate``), since it may have changed in place after the cache was built.
    Without it, values that break these rules are not detected, but the kernel still reads and
    writes only inside its tensors: it reads the page table clamped into them, as the attention
    kernels do, and skips a row whose sequence, page or slot does not fit.

    The launch does not synchronize or allocate, so a CUDA graph can capture it when the
    shapes are fixed. Under ``torch.compile`` the call goes through the custom op
    ``tilegen::append_kv`` (it mutates the pages), so ``fullgraph=True`` traces it; the
    ``TILEGEN_DEBUG`` checks, which read device values on the host, run in eager calls only.
    """
    if torch.compiler.is_compiling():
        _check(cache, k, v, cu_seqlens)
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or cache.k_pages.requires_grad
                                        or cache.v_pages.requires_grad):
            _refuse_grad(cache, k, v)
        torch.ops.tilegen.append_kv(
            cache.k_pages, cache.v_pages, cache.indptr, cache.indices, cache.last_page_len, k, v, cu_seqlens,
            cache.k_scale, cache.v_scale,
        )
        return
    try:
        kp = cache.k_pages
        key = (
            kp.shape, cache.v_pages.shape, kp.dtype, kp.device, cache.indptr.shape,
            k.shape, v.shape, k.dtype, v.dtype, k.device, v.device,
            cu_seqlens.shape, cu_seqlens.stride(), cu_seqlens.dtype, cu_seqlens.device, cache._scale_kinds,
        )
        plan = _plans.get(key) if cache.__class__ is PagedKVCache else None
    except AttributeError:  # not a cache or not tensors: the checks say which
        key = plan = None
    if plan is None:
        plan = _plan(cache, k, v, cu_seqlens)
        if key is not None:
            _plans.put(key, plan)
    # No backward: pages written through raw pointers would silently hold values outside the graph.
    # Inline, as it runs every call.
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or cache.k_pages.requires_grad
                                    or cache.v_pages.requires_grad or cache._scales_require_grad()):
        _refuse_grad(cache, k, v)
    if env.debug():
        _check_device_values(cache, k, cu_seqlens)
    if plan.launches:
        k_pages, v_pages = cache.k_pages, cache.v_pages
        # Addresses change from call to call, so this is not part of the plan.
        _check_apart(k, v, k_pages, v_pages)
        count_writes((k_pages, v_pages))
        # The plan fixes the shapes and dtypes the launcher reads, but for the page table's length, which
        # grows with the cache (the kernel clamps page ids into it); that and the strides complete the replay key.
        indices = cache.indices
        plan.launch((k.stride(), v.stride(), k_pages.stride(), v_pages.stride(), indices.shape[0]),
                    k, v, cu_seqlens, k_pages, v_pages, cache.indptr, indices, cache.last_page_len, *cache._scales)


def _check_apart(k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
    """Raise when ``k`` or ``v`` shares memory with the pages: the kernel reads them while writing the pages, so
    a row already overwritten would be read back silently wrong."""
    for name, t in (("k", k), ("v", v)):
        pages = first_overlap(t, {"cache.k_pages": k_pages, "cache.v_pages": v_pages})
        if pages is not None:
            raise ValueError(f"{name}: overlaps {pages} in memory, which the append writes; "
                             "pass a tensor of its own (a copy)")


def _refuse_grad(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor) -> None:
    refuse_grad("tilegen.append_kv", k=k, v=v, **cache._named_tensors())


def explain_append(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> dispatch.Choice:
    """Which config ``append_kv`` runs these arguments with, and where it comes from."""
    spec = _check(cache, k, v, cu_seqlens)
    return dispatch.table_on(spec, k.device).choose(k.shape[0])


@dataclass(frozen=True, slots=True)
class _Plan:
    launches: bool  # False when there is no row to write
    launch: Callable[..., Any]  # launch(key, *launcher arguments): the launcher's replay (dispatch.planned)
    choice: dispatch.Choice


_plans = dispatch.plan_cache()


def _plan(cache, k, v, cu_seqlens) -> _Plan:
    spec = _check(cache, k, v, cu_seqlens)
    launcher = dispatch.launcher_for(spec)
    launches = k.shape[0] > 0 and k.shape[1] > 0

    def make(choice: dispatch.Choice) -> _Plan:
        return _Plan(launches=launches, launch=launcher.replay(choice.config.to_dict()), choice=choice)

    return dispatch.planned(dispatch.table_on(spec, k.device), k.shape[0], make)


def _check(cache, k, v, cu_seqlens) -> KVAppendSpec:
    """Every host-side check, raising with the argument's name at the first that fails; the spec."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a tilegen.PagedKVCache, got {type(cache).__name__}")
    pages = cache.k_pages
    dtype, device = pages.dtype, pages.device
    page_dtype = SPEC_KV_DTYPES.get(dtype)
    if dtype not in SPEC_DTYPES and page_dtype is None:
        raise TypeError(f"cache: pages of dtype {dtype} are not supported; expected float16, bfloat16, float32, "
                        "float8_e4m3fn or float8_e5m2")
    check_device("cache", device, "pages")
    kv_heads, dim, dim_v = cache.kv_heads, pages.shape[3], cache.v_pages.shape[3]
    for name, t, d, what in (("k", k, dim, "head_dim"), ("v", v, dim_v, "head_dim_v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name}: expected 3 dims [total_new, kv_heads, {what}], got shape {tuple(t.shape)}")
        if page_dtype is None and t.dtype != dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from the cache's {dtype}")
        if page_dtype is not None and t.dtype not in SPEC_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be quantized into {dtype} pages; expected float16, "
                            "bfloat16 or float32")
        if page_dtype is not None and name == "v" and t.dtype != k.dtype:
            raise TypeError(f"v: dtype {t.dtype} differs from k's {k.dtype}")
        if t.device != device:
            raise ValueError(f"{name}: on {t.device} while the cache is on {device}")
        if t.shape[1] != kv_heads:
            raise ValueError(f"{name}: {t.shape[1]} KV heads, the cache has {kv_heads}")
        if t.shape[2] != d:
            raise ValueError(f"{name}: {what} {t.shape[2]} differs from the cache's {d}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v: {v.shape[0]} tokens while k has {k.shape[0]}")
    if k.shape[0] > _MAX_TOKENS:
        raise ValueError(f"k: {k.shape[0]} tokens exceed the supported {_MAX_TOKENS}")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens: expected a 1-d int32 tensor, got {cu_seqlens.dtype} of shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: on {cu_seqlens.device} while the cache is on {device}")
    if not cu_seqlens.is_contiguous():
        raise ValueError(f"cu_seqlens: expected a contiguous tensor, got strides {cu_seqlens.stride()}")
    if cu_seqlens.numel() != cache.batch + 1:
        raise ValueError(f"cu_seqlens: {cu_seqlens.numel()} entries, expected batch + 1 = {cache.batch + 1} "
                         f"(the cache's page table holds {cache.batch} sequences)")
    if cache.batch == 0 and k.shape[0] > 0:
        raise ValueError(f"k: {k.shape[0]} new tokens for a cache of no sequence")
    return _spec_for(SPEC_DTYPES[k.dtype], dim, dim_v, cache.page_size, page_dtype)


@memoized
def _spec_for(dtype: str, dim: int, dim_v: int, page_size: int, page_dtype: str | None = None) -> KVAppendSpec:
    try:
        return KVAppendSpec(head_dim=dim, head_dim_v=dim_v, page_size=page_size, dtype=dtype, page_dtype=page_dtype)
    except SpecError as e:
        arg = {"head_dim": "k", "head_dim_v": "v", "page_size": "cache"}.get(e.field, e.field)
        if e.field in ("head_dim", "head_dim_v"):
            raise ValueError(f"{arg}: head dim {dim if arg == 'k' else dim_v} is not supported; "
                             f"expected 1..{MAX_HEAD_DIM}") from None
        raise ValueError(f"{arg}: {e}") from None


def _check_device_values(cache: PagedKVCache, k: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """``TILEGEN_DEBUG=1``: the values the host never reads, checked on the device (one synchronization)."""
    cache.validate()
    cu = cu_seqlens
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens: must start at 0, starts at {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens: must be non-decreasing")
    if int(cu[-1]) != k.shape[0]:
        raise ValueError(f"cu_seqlens: ends at {int(cu[-1])} but k has {k.shape[0]} tokens")
    n_new = cu[1:] - cu[:-1]
    too_many = n_new > cache.seq_lens()
    if bool(too_many.any()):
        b = int(too_many.nonzero()[0, 0])
        raise ValueError(f"cu_seqlens: sequence {b} appends {int(n_new[b])} tokens but the page table gives it "
                         f"only {int(cache.seq_lens()[b])} (update the page table before appending)")


@torch.library.custom_op("tilegen::append_kv", mutates_args=("k_pages", "v_pages"))
def _append_op(
    k_pages: torch.Tensor, v_pages: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
    last_page_len: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    append_kv(PagedKVCache(k_pages, v_pages, indptr, indices, last_page_len, k_scale, v_scale), k, v, cu_seqlens)


@_append_op.register_fake
def _(k_pages, v_pages, indptr, indices, last_page_len, k, v, cu_seqlens, k_scale=None, v_scale=None) -> None:
    return None
