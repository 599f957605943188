"""``tilegen.PagedDecode``: batch decode over a paged KV cache, FlashInfer's plan/run split.

``plan`` takes the cache's page table, the heads and the mask once per decode step and
decides the config (tuned per longest context and batch) and the split count (from the SM
count, the batch and the tuned ``ctas_per_sm``); it also allocates the split partials, so
``run`` allocates nothing but its output, synchronizes nothing and can be captured in a
CUDA graph.

Checks: every call checks shapes, dtypes and devices on the host; ``TILEGEN_DEBUG=1`` (or
``PagedKVCache.validate()``) checks the page table's values on the device. Without it the
kernel clamps the page table into the cache (``tilegen.ops.kv_cache``): a wrong value gives a
wrong answer for its sequence, never an access outside the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tilegen import dispatch, env
from tilegen.device import device_info
from tilegen.dtypes import SPEC_DTYPES
from tilegen.families.attention_decode import DecodeSpec
from tilegen.families.attention_decode.config import MAX_SPLITS, split_count
from tilegen.families.attention_decode.problem import decode_buffers
from tilegen.families.attention_fwd.masks import (
    launch_window,
    mask_kind,
    score_scalars,
    window_bounds,
)
from tilegen.ir import SpecError
from tilegen.dispatch import launcher_for
from tilegen.ops.kv_cache import PagedKVCache, check_heads_q, check_max_seqlen_k, check_run_cache, page_dtypes
from tilegen.ops.mods import absorb
from tilegen.ops.planned import Planner, mod_tensor_names
from tilegen.ops.tensors import check_bool, check_device, check_grid, check_out, off_eager, refuse_grad
from tilegen.ops.varlen import paged_mods

__all__ = ["PagedDecode"]


@dataclass(frozen=True)
class _Plan:
    spec: DecodeSpec
    heads_q: int
    batch: int
    launch: Any  # launch(key, *launcher arguments): a Replay of the launcher with launch_args (dispatch.planned)
    launch_args: dict[str, Any]
    part_o: torch.Tensor
    part_lse: torch.Tensor
    choice: dispatch.Choice
    # What run() compares, precomputed: (page size, KV heads, head dim, head dim v, batch + 1, torch dtype).
    cache_layout: tuple = ()
    q_dtype: torch.dtype | None = None
    q_shape: tuple[int, int, int] = ()
    out_shape: tuple[int, int, int] = ()
    out_like_q: bool = False  # head_dim_v == head_dim: the output is allocated as empty_like(q), the cheapest way
    mod_tensors: tuple = ()  # the mods' captured tensors, bound at plan time
    max_seqlen_k: int = 0  # the longest sequence the plan's chunks cover


class PagedDecode(Planner):
    """One new token per sequence attending to its whole paged context.

    Example::

        decode = tilegen.PagedDecode()
        decode.plan(caches[0], heads_q=32)              # once per step
        for layer in range(n_layers):
            out = decode.run(q[layer], caches[layer])   # q [batch, heads_q, head_dim]
    """

    op = "tilegen.PagedDecode.run"

    _plan: _Plan | None

    def plan(
        self, cache: PagedKVCache, *, heads_q: int, window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None, scale: float | None = None, return_lse: bool = False,
        max_seqlen_k: int | None = None, num_splits: int | None = None, q_dtype: torch.dtype | None = None,
        score_mod=None, mask_mod=None,
    ) -> dispatch.Choice:
        """Fix the step's layout; returns the dispatch choice (config and where it came from). A tuned
        row that fails to compile or launch at the first ``run`` is skipped with one warning and the
        plan is made again for the next choice (``tilegen.dispatch.planned``).

        ``max_seqlen_k`` (a host int) spares one synchronization; it must be at least the longest sequence
        (keys past it may go unread: a wrong answer, never a read outside the cache; ``TILEGEN_DEBUG=1``
        checks it). ``num_splits`` overrides the split rule (1 to ``MAX_SPLITS``, 128), for tests and
        experiments. The query sits at its
        sequence's last key, so a causal mask sees every key; ``window=(left, 0)`` keeps the last
        ``left + 1``. ``q_dtype``: the query's dtype, which must be the pages' unless they are FP8
        (then float16, bfloat16 or float32; bfloat16 when left out).

        ``score_mod``/``mask_mod``: as in ``PagedAttention.plan``, bound here: ``q_idx`` is the query's
        position in its sequence, ``n_k - 1``, and ``h`` its query head.
        """
        self._refuse_plan_compiling()
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected a tilegen.PagedKVCache, got {type(cache).__name__}")
        check_heads_q(cache, heads_q)
        check_grid("cache", cache.batch, "sequences")
        check_device("cache", cache.k_pages.device, "pages")  # before cache.longest() reads the lengths from it
        if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                       or not 1 <= num_splits <= MAX_SPLITS):
            raise ValueError(f"num_splits: expected an int in 1..{MAX_SPLITS} or None, got {num_splits!r}")
        if max_seqlen_k is None:
            max_seqlen_k = cache.longest()
        if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
            raise ValueError(f"max_seqlen_k: expected a host int >= 0, got {max_seqlen_k!r}")
        pages = cache.k_pages
        kv_dtype, q_dtype = page_dtypes(cache, q_dtype)
        if score_mod is not None or mask_mod is not None:  # the query sits at its last key's position: no shift
            _, window, softcap, score_mod, mask_mod = absorb(score_mod, mask_mod, False, window, softcap)
        scale_value, softcap_value = score_scalars(scale, softcap, pages.shape[3])
        left, right = window_bounds(window, False)
        check_bool("return_lse", return_lse)
        mask = mask_kind(left, right)
        try:
            spec = DecodeSpec(head_dim=pages.shape[3], head_dim_v=cache.v_pages.shape[3],
                              q_per_kv=heads_q // cache.kv_heads, mask=mask, softcap=softcap is not None,
                              dtype=SPEC_DTYPES[q_dtype], page_size=cache.page_size, return_lse=return_lse,
                              kv_dtype=kv_dtype)
        except SpecError as e:
            raise ValueError(f"cache: {e}") from None
        device = pages.device
        mod_tensors = ()
        if score_mod is not None or mask_mod is not None:
            spec, mod_tensors = paged_mods(spec, score_mod, mask_mod, device, cache.batch, heads_q, max_seqlen_k,
                                           (left, right))
        info = device_info(device.index if device.type == "cuda" else None)
        table = dispatch.table_for(spec, info)
        left, right = launch_window(mask, left, right, 1, max_seqlen_k)
        if env.debug():
            cache.validate()
            check_max_seqlen_k(cache, max_seqlen_k)
        launcher = launcher_for(spec)
        batch, kv_heads, context = cache.batch, cache.kv_heads, max(max_seqlen_k, 1)
        layout = {"heads_q": heads_q, "batch": batch, "cache_layout": cache._layout, "q_dtype": q_dtype,
                  "q_shape": (batch, heads_q, spec.head_dim), "out_shape": (batch, heads_q, spec.dv),
                  "out_like_q": spec.dv == spec.head_dim, "max_seqlen_k": max_seqlen_k}

        def make(choice: dispatch.Choice) -> _Plan:
            config = choice.config
            splits = num_splits or split_count(config, info, batch, kv_heads, max_seqlen_k)
            part_o, part_lse = decode_buffers(batch, heads_q * spec.q_tokens, spec.dv, splits, device)
            launch_args = {"chunk": math.ceil(context / splits / config.block_n) * config.block_n,
                           "num_splits": splits, "scale": scale_value, "softcap": softcap_value, "window_left": left,
                           "window_right": right, "block_n": config.block_n, "num_warps": config.num_warps,
                           "num_stages": config.num_stages}
            # The launcher takes q and out as [batch, heads, 1, dim]; replays pass the 3-d tensors themselves,
            # whose data pointers those views share.
            launch = launcher.replay(launch_args, views={0: _token_dim, 3: _token_dim})
            return _Plan(spec=spec, launch=launch, part_o=part_o, part_lse=part_lse, choice=choice,
                         launch_args=launch_args, mod_tensors=mod_tensors, **layout)

        self._plan = dispatch.planned(table, (context, batch), make)
        return self._plan.choice

    @property
    def num_splits(self) -> int:
        """The planned split count."""
        if self._plan is None:
            raise RuntimeError("PagedDecode: call plan(...) first")
        return self._plan.launch_args["num_splits"]

    def run(self, q: torch.Tensor, cache: PagedKVCache, *, out: torch.Tensor | None = None):
        """Decode ``q`` ``[batch, heads_q, head_dim]`` against one layer's ``cache``; ``(out, lse)`` with LSE. In an
        autocast region of the plan's dtype, a query of another is cast to it, as SDPA casts its inputs."""
        # Under vmap or a FakeTensorMode q has no storage to launch on: the custom op, as under compile.
        if off_eager():
            return self._compiled_run(q, cache, out)
        plan = self._plan
        if plan is None:
            raise RuntimeError("PagedDecode.run: call plan(...) first, once per step")
        spec = plan.spec
        # page size, KV heads, head dims, batch (indptr's length) and dtype, against the plan's
        planned = (cache.__class__ is PagedKVCache or isinstance(cache, PagedKVCache)) and \
            getattr(cache, "_layout", None) == plan.cache_layout
        if not planned:
            raise ValueError(f"cache: expected a tilegen.PagedKVCache shaped as planned ({spec.name}, "
                             f"batch {plan.batch})")
        if not isinstance(q, torch.Tensor) or q.shape != plan.q_shape:
            raise ValueError(f"q: expected {list(plan.q_shape)}, got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        if env.debug():
            check_run_cache(cache, plan.max_seqlen_k)
        pages, v_pages = cache.k_pages, cache.v_pages
        if q.dtype != plan.q_dtype or q.device != pages.device:  # cast in an autocast region of the plan's dtype
            q = self._query_as_planned(q, plan.q_dtype, pages.device)
        out_shape = plan.out_shape
        if out is None:
            out = torch.empty_like(q) if plan.out_like_q else q.new_empty(out_shape)
        else:
            if not isinstance(out, torch.Tensor) or out.shape != out_shape or out.dtype != q.dtype \
                    or out.device != q.device:
                raise ValueError(f"out: expected {list(out_shape)} {q.dtype} on {q.device}")
            # A program reads its query rows before anything writes their output: out may be q itself.
            check_out("out", out, {"q": q, "cache.k_pages": pages, "cache.v_pages": v_pages}, may_be=("q",))
        # No backward: an output without a grad_fn would silently cut the graph. Inline, as it runs every call.
        if torch.is_grad_enabled() and (q.requires_grad or out.requires_grad or pages.requires_grad
                                        or v_pages.requires_grad or cache._scales_require_grad()
                                        or (plan.mod_tensors and any(t.requires_grad for t in plan.mod_tensors))):
            refuse_grad("tilegen.PagedDecode.run", q=q, out=out, **cache._named_tensors(),
                        **mod_tensor_names(plan.mod_tensors))
        lse = q.new_empty((plan.batch, plan.heads_q), dtype=torch.float32) if spec.return_lse else None
        if plan.batch:
            # The plan and the checks above fix every shape and dtype the launcher reads (the scales' sizes
            # among them, in the cache's layout) but the strides
            # and the page table's extents (the kernel clamps into them): they complete the key under
            # which its launches are replayed (tilegen.triton_internals.launch.Replay).
            plan.launch((q.stride(), out.stride(), pages.stride(), v_pages.stride(), cache._bounds),
                        q, pages, v_pages, out, out if lse is None else lse, plan.part_o, plan.part_lse,
                        cache.indptr, cache.indices, cache.last_page_len, *cache._scales, *plan.mod_tensors)
        return (out, lse) if spec.return_lse else out

    def _launch_through(self, cache: PagedKVCache, views: dict[int, Any]) -> tuple[Any, tuple]:
        """``(replay, tail)``, ``replay(key, q, k, v, out, out, *tail)`` running this plan's kernels on ``cache``'s
        page table, taking q, the pages and out through ``views`` of the caller's tensors (``Replay``'s views, by
        the launcher's argument index: 0 q, 1 and 2 the pages, 3 out), with nothing checked and no LSE. ``key``
        must fix every view's shape and strides. For a caller whose own key fixes what ``run`` checks, after a
        ``run`` of its layout settled the plan's config (a tuned row failing at its first launch falls back
        there): the transformers integration's padded decoding step, over transformers' cache where it lies,
        which calls the replay itself (a closure around it cost a tenth of the step's host time)."""
        plan = self._plan
        if plan is None or plan.spec.return_lse:
            raise RuntimeError("PagedDecode._launch_through: needs a plan made without return_lse")
        if not plan.batch:
            return (lambda *args: None), ()
        replay = launcher_for(plan.spec).replay(plan.launch_args, {**views, 4: views[3]})
        return replay, (plan.part_o, plan.part_lse, cache.indptr, cache.indices, cache.last_page_len, *cache._scales,
                        *plan.mod_tensors)


def _token_dim(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(2)
