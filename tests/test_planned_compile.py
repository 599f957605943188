"""``PagedAttention``, ``PagedDecode`` and ``CascadeAttention`` under ``torch.compile(fullgraph=True)``: ``run`` is the
custom op ``tilegen::planned_run``, ``plan`` stays outside the compiled function.

Each compiled run is checked against the float64 reference and against the eager run (the same kernels, so the same
bits); a new plan on the same object reuses the graph, a changed ``return_lse`` retraces, FP8 pages pass their scales,
mods bound at plan time run, and what cannot be compiled (``plan`` inside, a gradient) is refused by name.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from test_cascade import tree_cache
from test_fp8_kv import fp8_cache
from test_varlen import _cu, make_cache, paged_reference

import tilegen
from tilegen.families import relative_error
from tilegen.mods import library

D = 16
K_LENS, Q_LENS = [40, 1, 17, 0], [7, 1, 17, 0]  # history and new tokens, one token, a prefill, an empty request


def _q(gen, tokens, heads, dtype, device):
    return torch.randn(tokens, heads, D, generator=gen).to(device=device, dtype=dtype)


def _check(got, eager, ref, dtype):
    """``got`` (compiled) is ``eager``'s result bit for bit and within tolerance of the float64 ``ref``."""
    got, eager, ref = (x if isinstance(x, tuple) else (x,) for x in (got, eager, ref))
    assert len(got) == len(eager)
    for g, e in zip(got, eager):
        assert torch.equal(g.isnan(), e.isnan()) and torch.equal(g.nan_to_num(), e.nan_to_num())
    assert not torch.isnan(got[0]).any(), "output elements never written"
    assert relative_error(got[0].cpu(), ref[0])[0] < (1e-4 if dtype == torch.float32 else 1e-2)
    if len(got) == 2:
        seen = torch.isfinite(ref[1])
        assert torch.equal(torch.isneginf(got[1].cpu()), ~seen)
        assert (got[1].cpu().double()[seen] - ref[1][seen]).abs().max() < 1e-4


def _compiled(fn, backend="eager"):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(fn, fullgraph=True, backend=backend)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_decode_run_compiles(backend, device):
    gen = torch.Generator().manual_seed(1)
    cache = make_cache(K_LENS, 16, 2, D, torch.float32, device, gen)
    q = torch.randn(cache.batch, 8, D, generator=gen).to(device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=8, return_lse=True, num_splits=2)
    step = _compiled(lambda q, cache: decode.run(q, cache), backend)
    _check(step(q, cache), decode.run(q, cache),
           paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32)), torch.float32)


def test_a_compiled_run_refuses_an_out_whose_elements_share_memory_by_name(device):
    gen = torch.Generator().manual_seed(1)
    cache = make_cache(K_LENS, 16, 2, D, torch.float32, device, gen)
    q = torch.randn(cache.batch, 8, D, generator=gen).to(device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=8)
    torch._dynamo.reset()
    step = torch.compile(lambda q, cache, out: decode.run(q, cache, out=out), fullgraph=True, backend="eager")
    with pytest.raises(Exception) as caught:
        step(q, cache, q[:1].expand(q.shape))
    assert "out: overlaps itself (stride 0" in str(caught.value) + str(caught.value.__cause__)


@pytest.mark.parametrize("causal", [True, False])
def test_paged_prefill_run_compiles(causal, device):
    gen = torch.Generator().manual_seed(2 + causal)
    cache = make_cache(K_LENS, 8, 1, D, torch.bfloat16, device, gen)
    cu_q = _cu(Q_LENS, device)
    q = _q(gen, sum(Q_LENS), 4, torch.bfloat16, device)
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, cache, heads_q=4, causal=causal)
    out = torch.full((q.shape[0], 4, D), math.nan, dtype=q.dtype, device=device)
    result = _compiled(lambda q, cache, out: attn.run(q, cache, out=out))(q, cache, out)
    assert result is out, "a given output receives the result"
    _check(out, attn.run(q, cache), paged_reference(q, cache, cu_q, causal=causal), torch.bfloat16)


def test_cascade_run_compiles(device):
    gen = torch.Generator().manual_seed(3)
    cache = tree_cache(8, 2, torch.float32, device, gen)
    q = torch.randn(cache.batch, 4, 32, generator=gen).to(device)
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=4, return_lse=True)
    got = _compiled(lambda q, cache: cascade.run(q, cache))(q, cache)
    _check(got, cascade.run(q, cache), paged_reference(q, cache, torch.arange(cache.batch + 1, dtype=torch.int32)),
           torch.float32)


def test_fp8_pages_pass_their_scales(device):
    gen = torch.Generator().manual_seed(4)
    cache, dequantized = fp8_cache([33, 5], "e4m3", True, device, gen)
    q = torch.randn(2, cache.kv_heads * 2, cache.k_pages.shape[3], generator=gen).to(device, torch.bfloat16)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=q.shape[1], q_dtype=torch.bfloat16)
    got = _compiled(lambda q, cache: decode.run(q, cache))(q, cache)
    _check(got, decode.run(q, cache), paged_reference(q, dequantized, torch.arange(3, dtype=torch.int32))[0],
           torch.bfloat16)


def test_mods_bound_at_plan_time_run_compiled(device):
    gen = torch.Generator().manual_seed(5)
    slopes = torch.rand(4, generator=gen).to(device)
    cache = make_cache(K_LENS, 16, 2, D, torch.float32, device, gen)
    cu_q = _cu(Q_LENS, device)
    q = _q(gen, sum(Q_LENS), 4, torch.float32, device)
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, cache, heads_q=4, causal=True, score_mod=library.alibi(slopes), return_lse=True)
    layer = _compiled(lambda q, cache: attn.run(q, cache))
    for _ in range(2):  # the plan's captured tensors are read at every run: values written in place take effect
        ref = paged_reference(q, cache, cu_q, causal=True, score_mod=library.alibi(slopes), paged_positions=True)
        _check(layer(q, cache), attn.run(q, cache), ref, torch.float32)
        slopes.mul_(3)


def test_a_new_plan_runs_in_the_same_graph_and_a_new_return_lse_retraces(device):
    """A decode loop: each step plans its lengths anew on the same object and calls the compiled layer."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(6)
    k_pages = torch.randn(8, 8, 2, D, generator=gen).to(device)
    v_pages = torch.randn(8, 8, 2, D, generator=gen).to(device)
    table = torch.arange(8, dtype=torch.int32, device=device).reshape(2, 4)
    decode = tilegen.PagedDecode()
    step = _compiled(lambda q, cache: decode.run(q, cache))
    graphs = []
    # Three pages, then four (the page table's length becomes dynamic: one retrace), then five, then with LSE.
    steps = [([5, 9], False), ([6, 10], False), ([7, 17], False), ([8, 25], False), ([9, 26], True), ([9, 27], True)]
    for lens, lse in steps:
        cache = tilegen.PagedKVCache.from_block_table(k_pages, v_pages, table, torch.tensor(lens, device=device))
        decode.plan(cache, heads_q=4, return_lse=lse)
        q = torch.randn(2, 4, D, generator=gen).to(device)
        ref = paged_reference(q, cache, torch.arange(3, dtype=torch.int32))
        _check(step(q, cache), decode.run(q, cache), ref if lse else ref[0], torch.float32)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 2, 2, 3, 3]


def test_the_op_passes_opcheck(device):
    gen = torch.Generator().manual_seed(7)
    cache = make_cache([9, 20], 8, 1, D, torch.float32, device, gen)
    q = torch.randn(2, 2, D, generator=gen).to(device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=2, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # opcheck's NaN-aware comparison warns about the pages' NaN slots
        # A contiguous q, and one laid out head-major (an eager run's output takes q's layout, the op's never).
        for q in (q, q.transpose(0, 1).contiguous().transpose(0, 1)):
            args = (decode._handle, q, cache.k_pages, cache.v_pages, cache.indptr, cache.indices,
                    cache.last_page_len, None, None, [], True)
            torch.library.opcheck(torch.ops.tilegen.planned_run.default, args)
    # A CUDA graph of torch.compile must not replay a plan that a new one replaced (and freed the buffers of).
    assert torch.Tag.cudagraph_unsafe in torch.ops.tilegen.planned_run.default.tags


def test_plan_inside_the_compiled_function_is_refused(device):
    gen = torch.Generator().manual_seed(8)
    cache = make_cache([9, 20], 8, 1, D, torch.float32, device, gen)
    decode = tilegen.PagedDecode()

    def step(q, cache):
        decode.plan(cache, heads_q=2)
        return decode.run(q, cache)

    with pytest.raises(Exception, match=r"PagedDecode\.plan: plan outside the compiled function"):
        _compiled(step)(torch.randn(2, 2, D).to(device), cache)


def test_gradients_are_refused_by_name(device):
    gen = torch.Generator().manual_seed(9)
    cache = make_cache([9, 20], 8, 1, D, torch.float32, device, gen)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=2)
    q = torch.randn(2, 2, D, device=device, requires_grad=True)
    with pytest.raises(Exception, match=r"tilegen\.PagedDecode\.run: q requires grad"):
        _compiled(lambda q, cache: decode.run(q, cache))(q, cache)


@pytest.mark.parametrize("scale", ["cache.k_scale", "cache.v_scale"])
@pytest.mark.parametrize("op", [tilegen.PagedDecode, tilegen.PagedAttention, tilegen.CascadeAttention],
                         ids=lambda op: op.__name__)
def test_an_fp8_scale_that_requires_grad_is_refused_by_its_name(op, scale, device):
    """A learned scale of FP8 pages has no gradient either: the compiled run names it as the eager run does."""
    gen = torch.Generator().manual_seed(17)
    cache, _ = fp8_cache([33, 5], "e4m3", True, device, gen)
    q = torch.randn(2, cache.kv_heads * 2, cache.k_pages.shape[3], generator=gen).to(device, torch.bfloat16)
    planner = op()
    if op is tilegen.PagedAttention:
        planner.plan(_cu([1, 1], device), cache, heads_q=q.shape[1], q_dtype=torch.bfloat16)
    elif op is tilegen.CascadeAttention:
        planner.plan(cache, tilegen.cascade_levels(cache), heads_q=q.shape[1], q_dtype=torch.bfloat16)
    else:
        planner.plan(cache, heads_q=q.shape[1], q_dtype=torch.bfloat16)
    {"cache.k_scale": cache.k_scale, "cache.v_scale": cache.v_scale}[scale].requires_grad_()
    message = rf"{planner.op}: {scale} requires grad".replace(".", r"\.")
    with pytest.raises(NotImplementedError, match=message):
        planner.run(q, cache)
    with pytest.raises(Exception, match=message):
        _compiled(lambda q, cache: planner.run(q, cache))(q, cache)


def test_a_run_before_any_plan_and_a_wrong_cache_are_refused(device):
    gen = torch.Generator().manual_seed(10)
    cache = make_cache([9, 20], 8, 1, D, torch.float32, device, gen)
    q = torch.randn(2, 2, D, device=device)
    with pytest.raises(Exception, match=r"PagedDecode: make and plan it outside the compiled function"):
        _compiled(lambda q, cache: tilegen.PagedDecode().run(q, cache))(q, cache)
    decode = tilegen.PagedDecode()
    with pytest.raises(Exception, match=r"PagedDecode\.run: call plan"):
        _compiled(lambda q, cache: decode.run(q, cache))(q, cache)
    decode.plan(cache, heads_q=2)
    with pytest.raises(Exception, match="cache: expected a tilegen.PagedKVCache"):
        _compiled(lambda q, cache: decode.run(q, cache))(q, (cache.k_pages, cache.v_pages))
    # What the graph cannot see, the op checks as an eager run does, with the same message.
    with pytest.raises(ValueError, match=r"q: expected \[2, 2, 16\]"):
        _compiled(lambda q, cache: decode.run(q, cache))(q[:1], cache)


def test_a_handle_whose_object_is_gone_is_refused(device):
    gen = torch.Generator().manual_seed(11)
    cache = make_cache([9], 8, 1, D, torch.float32, device, gen)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=1)
    handle = decode._handle
    del decode
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.tilegen.planned_run(handle, torch.randn(1, 1, D, device=device), cache.k_pages, cache.v_pages,
                                      cache.indptr, cache.indices, cache.last_page_len, None, None, [], False)


def test_a_copy_runs_its_own_plan_when_compiled(device):
    import copy

    gen = torch.Generator().manual_seed(14)
    cache = make_cache([30, 12], 8, 1, D, torch.float32, device, gen)
    q = torch.randn(2, 2, D, generator=gen).to(device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=2, window=(3, 0))
    twin = copy.copy(decode)
    assert twin._handle != decode._handle
    twin.plan(cache, heads_q=2)  # no window
    step = _compiled(lambda q, cache: twin.run(q, cache))
    assert torch.equal(step(q, cache), twin.run(q, cache))
    assert not torch.equal(step(q, cache), decode.run(q, cache))


def test_a_planned_object_refuses_a_deep_copy_by_name(device):
    """An unplanned object deep-copies (with a handle of its own); a planned one, whose plan holds compiled kernels,
    is refused with the object's name and what to do instead."""
    import copy

    gen = torch.Generator().manual_seed(16)
    cache = make_cache([9], 8, 1, D, torch.float32, device, gen)
    for planner, plan in ((tilegen.PagedDecode(), lambda p: p.plan(cache, heads_q=1)),
                          (tilegen.PagedAttention(),
                           lambda p: p.plan(torch.tensor([0, 1], dtype=torch.int32, device=device), cache, heads_q=1))):
        twin = copy.deepcopy(planner)
        assert twin._plan is None and twin._handle != planner._handle
        plan(planner)
        name = type(planner).__name__
        with pytest.raises(TypeError, match=f"tilegen.{name}: a planned object cannot be deep-copied"):
            copy.deepcopy(planner)
        plan(twin)  # the copy plans and runs on its own
        assert twin._plan is not None


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_head_major_query_and_a_captured_tensor_written_in_the_compiled_function(backend, device):
    gen = torch.Generator().manual_seed(15)
    slopes = torch.rand(4, generator=gen).to(device)
    cache = make_cache([33, 9], 8, 2, D, torch.float32, device, gen)
    q = torch.randn(4, 2, D, generator=gen).to(device).transpose(0, 1)  # [batch, heads, dim], head-major
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=4, score_mod=library.alibi(slopes))

    def step(q, cache):
        slopes.mul_(2)  # read by this run: the op takes the captured tensors as inputs
        return decode.run(q, cache)

    got = _compiled(step, backend)(q, cache)
    ref = paged_reference(q, cache, torch.arange(3, dtype=torch.int32), score_mod=library.alibi(slopes),
                          paged_positions=True)[0]
    assert relative_error(got.cpu(), ref)[0] < 1e-4
    assert torch.equal(got, decode.run(q, cache))  # slopes as written, read again eagerly


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_whole_decode_step_traces_without_a_break(backend, device):
    """RoPE on the new token's q and k, its K and V appended to the pages, decode over them: one graph, and the
    decode reads the pages the append wrote."""
    gen = torch.Generator().manual_seed(12)
    lens = [9, 20]  # including the new token
    cache = make_cache(lens, 8, 2, D, torch.float32, device, gen)
    q, k, v = (torch.randn(2, heads, D, generator=gen).to(device) for heads in (4, 2, 2))
    angles = torch.rand(2, D // 2, generator=gen).to(device).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    one_each = torch.arange(3, dtype=torch.int32, device=device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=4)

    def step(q, k, v, cache):
        q, k = tilegen.apply_rope(q, cos, sin), tilegen.apply_rope(k, cos, sin)
        tilegen.append_kv(cache, k, v, one_each)
        return decode.run(q, cache)

    eager_pages = (cache.k_pages.clone(), cache.v_pages.clone())
    eager_cache = tilegen.PagedKVCache(*eager_pages, cache.indptr, cache.indices, cache.last_page_len)
    want = step(q, k, v, eager_cache)
    got = _compiled(step, backend)(q, k, v, cache)
    assert torch.equal(cache.k_pages.nan_to_num(), eager_pages[0].nan_to_num()), "the append wrote the pages"
    rotated = tilegen.apply_rope(q, cos, sin)
    _check(got, want, paged_reference(rotated, cache, one_each), torch.float32)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 1 and not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.gpu
def test_reduce_overhead_graphs_never_replay_a_replaced_plan():
    """mode="reduce-overhead" over a decode loop that plans every step anew, lengths growing past a split's chunk:
    each step matches its eager run (a CUDA graph replaying the first plan's launches would read too few keys and
    write into the freed partials of a replaced plan)."""
    gen = torch.Generator().manual_seed(13)
    k_pages = torch.randn(64, 16, 2, 128, generator=gen).to("cuda", torch.bfloat16)
    v_pages = torch.randn(64, 16, 2, 128, generator=gen).to("cuda", torch.bfloat16)
    table = torch.arange(64, dtype=torch.int32, device="cuda").reshape(2, 32)
    decode = tilegen.PagedDecode()
    torch._dynamo.reset()
    step = torch.compile(lambda q, cache: decode.run(q, cache) * 1.0, mode="reduce-overhead")
    for lens in ([40, 17], [41, 18], [300, 200], [500, 511]):
        cache = tilegen.PagedKVCache.from_block_table(k_pages, v_pages, table, torch.tensor(lens, device="cuda"))
        decode.plan(cache, heads_q=8)
        q = torch.randn(2, 8, 128, generator=gen).to("cuda", torch.bfloat16)
        want = decode.run(q, cache)
        for _ in range(3):  # recorded, then replayed
            got = step(q, cache)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_captured_tensor_that_requires_grad_is_refused_by_name(device):
    """The paged paths have no backward: eagerly and compiled, a learned captured tensor is refused, not dropped."""
    gen = torch.Generator().manual_seed(16)
    slopes = torch.rand(2, generator=gen).to(device).requires_grad_()
    cache = make_cache([20, 9], 8, 1, D, torch.float32, device, gen)
    q = torch.randn(2, 2, D, generator=gen).to(device)
    decode = tilegen.PagedDecode()
    decode.plan(cache, heads_q=2, score_mod=library.alibi(slopes))
    message = r"tilegen\.PagedDecode\.run: a captured tensor of the mods \(#0\) requires grad"
    with pytest.raises(NotImplementedError, match=message):
        decode.run(q, cache)
    with pytest.raises(Exception, match=message):
        _compiled(lambda q, cache: decode.run(q, cache))(q, cache)
    with torch.no_grad():
        assert torch.equal(_compiled(lambda q, cache: decode.run(q, cache))(q, cache), decode.run(q, cache))


def _under_vmap_and_fake(run, q, cache, refused=None):
    """``run(q, cache)`` under torch.func.vmap (two samples, each equal to its own run; or refused, matching
    ``refused``) and under a FakeTensorMode (the eager run's shapes and dtypes)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    want = run(q, cache)
    stacked = torch.stack([q, q.flip(0)])
    if refused is not None:
        with pytest.raises(NotImplementedError, match=refused):
            torch.func.vmap(lambda q: run(q, cache))(stacked)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "no batching rule, performance drop"
            got = torch.func.vmap(lambda q: run(q, cache))(stacked)
        assert torch.equal(got[0].nan_to_num(), want.nan_to_num())
        assert torch.equal(got[1].nan_to_num(), run(q.flip(0), cache).nan_to_num())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = run(mode.from_tensor(q), cache)
    assert isinstance(fake, FakeTensor) and (fake.shape, fake.dtype) == (want.shape, want.dtype)


def _planned(op, dtype, device, seed):
    """``(planner, q, cache)``: ``op`` planned over a small cache of ``dtype`` (a prefix tree for the cascade), and an
    fp32 query for its run."""
    gen = torch.Generator().manual_seed(seed)
    planner = op()
    if op is tilegen.CascadeAttention:
        cache = tree_cache(8, 2, dtype, device, gen)
        planner.plan(cache, tilegen.cascade_levels(cache), heads_q=4)
        return planner, torch.randn(cache.batch, 4, 32, generator=gen).to(device), cache
    cache = make_cache([9, 20], 8, 1, D, dtype, device, gen)
    if op is tilegen.PagedAttention:
        planner.plan(_cu([2, 1], device), cache, heads_q=2, causal=True)
    else:
        planner.plan(cache, heads_q=2)
    return planner, torch.randn(3 if op is tilegen.PagedAttention else 2, 2, D, generator=gen).to(device), cache


@pytest.mark.parametrize("op", [tilegen.PagedDecode, tilegen.PagedAttention, tilegen.CascadeAttention],
                         ids=lambda op: op.__name__)
def test_a_run_under_vmap_or_fake_tensors_takes_the_op(op, device):
    """A run launched its plan on the tensors as given: under vmap torch's "Cannot access storage of
    BatchedTensorImpl", under a FakeTensorMode a failed storage assignment. Fakes now take tilegen::planned_run's fake
    implementation; vmap, for whose op torch makes no per-sample fallback, is refused by name."""
    planner, q, cache = _planned(op, torch.float32, device, 18)
    message = rf"^{re.escape(planner.op)}: not supported under a torch\.func transform"
    _under_vmap_and_fake(lambda q, cache: planner.run(q, cache), q, cache, refused=message)


def test_rope_and_merge_states_under_vmap_or_fake_tensors_take_their_ops(device):
    gen = torch.Generator().manual_seed(19)
    x, o_b = (torch.randn(5, 2, D, generator=gen).to(device) for _ in range(2))
    cos, sin, lse_a, lse_b = (torch.randn(5, n, generator=gen).to(device) for n in (D, D, 2, 2))
    _under_vmap_and_fake(lambda x, _: tilegen.apply_rope(x, cos, sin), x, None)
    _under_vmap_and_fake(lambda o, _: tilegen.merge_states(o, lse_a, o_b, lse_b)[0], x, None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("op", [tilegen.PagedDecode, tilegen.PagedAttention, tilegen.CascadeAttention],
                         ids=lambda op: op.__name__)
def test_an_autocast_region_of_the_plans_dtype_casts_the_query(op, compiled, device):
    """In an autocast region of the plan's dtype (the cache's) an fp32 query runs cast to it, as SDPA and
    tilegen.attention cast their inputs there: the output is the cast query's run, bit for bit. The pages cannot be
    cast, so a region of another dtype is refused naming q and the region. The runs refused an autocast model's
    fp32 query as a dtype that differs from the plan's."""
    planner, q, cache = _planned(op, torch.bfloat16, device, 20)
    run = _compiled(lambda q, cache: planner.run(q, cache)) if compiled else planner.run
    want = planner.run(q.bfloat16(), cache)
    region = torch.device(device).type
    with torch.autocast(region, dtype=torch.bfloat16):
        got = run(q, cache)
    assert got.dtype == torch.bfloat16 and torch.equal(got.nan_to_num(), want.nan_to_num())
    with torch.autocast(region, dtype=torch.float16):
        with pytest.raises(Exception) as caught:
            run(q, cache)
    assert "q: torch.float32" in str(caught.value) + str(caught.value.__cause__)
    assert "autocast region of torch.float16" in str(caught.value) + str(caught.value.__cause__)
