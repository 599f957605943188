"""The plan/run objects (``PagedAttention``, ``PagedDecode``, ``CascadeAttention``) under ``torch.compile``.

Their ``plan`` reads lengths and page tables on the host and fixes a config, buffers and a replayed launch; their
``run`` launches what the plan fixed on one layer's pages. A compiled function therefore takes ``run`` and leaves
``plan`` outside, once per batch or step, as FlashInfer's plan stays outside a CUDA graph. Under ``torch.compile``
``run`` is the custom op ``tilegen::planned_run``: the graph holds the object's handle, an int fixed for the object's
life, and the layer's tensors; the op runs the object's current plan eagerly. A new plan on the same object therefore
runs in the same graph; another object's handle is another constant, so it recompiles.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import weakref

import torch

from tilegen.ops.kv_cache import PagedKVCache
from tilegen.ops.tensors import check_distinct, refuse_grad

__all__ = ["Planner", "mod_tensor_names"]

_handles = itertools.count()
_planners: weakref.WeakValueDictionary[int, Planner] = weakref.WeakValueDictionary()


def mod_tensor_names(tensors) -> dict:
    """The mods' captured tensors by the names a refusal gives them."""
    return {f"a captured tensor of the mods (#{i})": t for i, t in enumerate(tensors)}


class Planner:
    """Base of the plan/run objects: ``self._plan`` (None until ``plan``) and the handle the compiled op finds the
    object by. A subclass names itself (``op``, as errors call it) and implements ``run``."""

    op = "tilegen.Planner"

    def __init__(self) -> None:
        if torch.compiler.is_compiling():  # its handle must outlive the trace: the graph holds it
            raise NotImplementedError(f"{self.op.removesuffix('.run')}: make and plan it outside the compiled "
                                      "function; run(...) compiles")
        self._plan = None
        self._register()

    def _register(self) -> None:
        self._handle = next(_handles)
        _planners[self._handle] = self

    def __setstate__(self, state: dict) -> None:
        # copy.copy's copy (sharing the plan, its buffers included) is another object: its own handle, or a
        # compiled graph of the copy would run the original's plan.
        self.__dict__.update(state)
        self._register()

    def __deepcopy__(self, memo: dict) -> Planner:
        # A plan holds its launcher's compiled module, which nothing copies: refused by name, not by pickle's
        # "cannot pickle 'module' object".
        if self._plan is not None:
            raise TypeError(f"{self.op.removesuffix('.run')}: a planned object cannot be deep-copied (its plan holds "
                            "compiled kernels); deep-copy it before plan(...), or plan(...) a copy.copy of it, which "
                            "shares the plan until then")
        twin = object.__new__(type(self))
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self.__dict__, memo))
        return twin

    def _refuse_plan_compiling(self) -> None:
        # plan() reads device values on the host and builds Python state, which a graph cannot hold.
        if torch.compiler.is_compiling():
            raise NotImplementedError(f"{self.op.removesuffix('.run')}.plan: plan outside the compiled function "
                                      "(it reads the page table on the host, once per batch); run(...) compiles")

    def _query_as_planned(self, q: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``q``, which ``run`` found of another dtype or device than the plan's ``dtype`` and the cache's ``device``,
        cast to ``dtype`` in an autocast region of that dtype for its device, as SDPA casts its inputs there; else a
        ``ValueError`` naming q. The pages, a cache, keep their dtype: only a region of the plan's can cast the query
        to it, and one of another dtype is named. Called only on a mismatch, so a query of the plan's pays nothing."""
        region = None
        if q.device == device and q.is_floating_point() and torch.is_autocast_enabled(device.type):
            region = torch.get_autocast_dtype(device.type)
            if region == dtype and q.dtype != torch.float64:  # autocast leaves float64 as it is
                return q.to(dtype)
        note = f" (in an autocast region of {region}, which cannot cast the cache's pages)" if region else ""
        raise ValueError(f"q: {q.dtype} on {q.device} differs from the plan's {dtype} on the cache's {device}{note}")

    def _compiled_run(self, q: torch.Tensor, cache: PagedKVCache, out: torch.Tensor | None):
        """``run`` traced by Dynamo: what the graph can check, then the custom op (which checks the rest as an eager
        ``run`` does, and launches)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{self.op}: call plan(...) first")
        if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
            # torch generates no per-sample fallback for the op (it failed with "Batching rule not implemented").
            raise NotImplementedError(f"{self.op}: not supported under a torch.func transform (vmap, grad); run it "
                                      "outside, on the batch it was planned for")
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected a tilegen.PagedKVCache, got {type(cache).__name__}")
        if not isinstance(q, torch.Tensor):
            raise ValueError(f"q: expected a tensor, got {type(q).__name__}")
        pages, v_pages = cache.k_pages, cache.v_pages
        if q.dtype != plan.q_dtype and q.device == pages.device and torch.is_autocast_enabled(q.device.type):
            # As an eager run casts it, before the op, whose output the fake implementation gives q's dtype.
            q = self._query_as_planned(q, plan.q_dtype, pages.device)
        mod_tensors = plan.mod_tensors
        # The eager run's test and names: an FP8 cache's scales go through the op too, with no backward either.
        if torch.is_grad_enabled() and (q.requires_grad or pages.requires_grad or v_pages.requires_grad
                                        or cache._scales_require_grad() or (out is not None and out.requires_grad)
                                        or any(t.requires_grad for t in mod_tensors)):
            refuse_grad(self.op, q=q, out=out, **cache._named_tensors(), **mod_tensor_names(mod_tensors))
        return_lse = plan.spec.return_lse
        # The mods' captured tensors are inputs of the op, so a write to one earlier in the compiled function is
        # ordered before it (and, functionalized, the op reads the written value).
        mod_tensors = list(mod_tensors)
        result, lse = torch.ops.tilegen.planned_run(self._handle, q, pages, v_pages, cache.indptr, cache.indices,
                                                    cache.last_page_len, cache.k_scale, cache.v_scale, mod_tensors,
                                                    return_lse)
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.shape != result.shape or out.dtype != q.dtype \
                    or out.device != q.device:
                raise ValueError(f"out: expected {list(result.shape)} {q.dtype} on {q.device}")
            # Strides only: traced code cannot read storage addresses, so an out sharing the pages' memory is
            # written after the op has read them (an eager run refuses it).
            check_distinct("out", out)
            result = out.copy_(result)  # the op allocates its output: a given one receives a copy
        return (result, lse) if return_lse else result


# Not capturable by torch.compile's CUDA graphs: a replay would launch the traced plan's kernels with its buffers,
# which a new plan on the object frees and replaces. mode="reduce-overhead" therefore leaves the op outside its
# graphs (with torch._inductor.config.graph_partition, Inductor splits its graphs around it).
@torch.library.custom_op("tilegen::planned_run", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _planned_run(
    handle: int, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, indptr: torch.Tensor,
    indices: torch.Tensor, last_page_len: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    mod_tensors: list[torch.Tensor], return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    planner = _planners.get(handle)
    if planner is None:
        raise RuntimeError("tilegen: the PagedAttention, PagedDecode or CascadeAttention object this compiled "
                           "function was traced with no longer exists")
    plan = planner._plan
    planned = plan.mod_tensors
    if len(mod_tensors) != len(planned):  # Dynamo retraces first: a guard reads them
        raise RuntimeError(f"{planner.op}: planned with {len(planned)} captured tensors, traced with "
                           f"{len(mod_tensors)}")
    if any(a is not b for a, b in zip(mod_tensors, planned)):
        # The graph's values of the captured tensors (written in it): the plan run with them, in a stand-in object.
        stand_in = object.__new__(type(planner))
        stand_in.__dict__.update(planner.__dict__, _plan=dataclasses.replace(plan, mod_tensors=tuple(mod_tensors)))
        planner = stand_in
    cache = PagedKVCache(k_pages, v_pages, indptr, indices, last_page_len, k_scale, v_scale)
    # Into a contiguous output, as the fake implementation gives it (an eager run lays a new one out as q).
    out = q.new_empty((*q.shape[:-1], v_pages.shape[-1])) if q.dim() == 3 else None
    result = planner.run(q, cache, out=out)
    out, lse = result if isinstance(result, tuple) else (result, None)
    if (lse is not None) != return_lse:  # a guard on the plan's return_lse makes Dynamo retrace first
        raise RuntimeError(f"{planner.op}: planned with return_lse={lse is not None} after the compiled function "
                           f"was traced with return_lse={return_lse}")
    # A custom op returns tensors only: an empty one stands for "no LSE".
    return out, lse if lse is not None else q.new_empty((0,), dtype=torch.float32)


@_planned_run.register_fake
def _(handle, q, k_pages, v_pages, indptr, indices, last_page_len, k_scale, v_scale, mod_tensors, return_lse):
    # Every plan/run op writes [tokens, heads_q, head_dim_v] in q's dtype, and an fp32 LSE [tokens, heads_q].
    return (q.new_empty((*q.shape[:-1], v_pages.shape[-1])),
            q.new_empty(q.shape[:-1] if return_lse else (0,), dtype=torch.float32))
