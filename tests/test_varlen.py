"""Ragged and paged attention against the float64 reference, gathered per sequence.

Every output buffer starts as NaN (an unwritten element fails), unused pages and the unused
slots of last pages are NaN too (a kernel that reads outside its pages fails), pages sit in
shuffled order, and lengths are mixed so that none is a multiple of a block.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_guard_bands, inside, nan_outputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegen
from tilegen.families import relative_error
from tilegen.families.attention_varlen.reference import gather_pages, varlen_reference
from tilegen.ops.varlen import varlen_attention_padded

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
LSE_TOL = 1e-4


def _cu(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def _randn(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _check(out, lse, ref, ref_lse, dtype):
    assert not torch.isnan(out).any(), f"{torch.isnan(out).sum().item()} output elements never written"
    error, _ = relative_error(out, ref)
    assert error < TOL[dtype], f"relative error {error:.2e}"
    if lse is not None:
        assert not torch.isnan(lse).any()
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse must be -inf exactly on empty rows"
        seen = torch.isfinite(ref_lse)
        if seen.any():
            assert (lse.double()[seen] - ref_lse[seen]).abs().max() < LSE_TOL


# ------------------------------------------------------------------------------- ragged

RAGGED = [
    pytest.param([17, 0, 1, 40, 5], {}, torch.float32, 1, id="fp32-mha-full-empty-and-single"),
    pytest.param([33, 1, 0, 20], {"causal": True}, torch.bfloat16, 4, id="bf16-gqa4-causal"),
    pytest.param([0, 9, 50], {"window": (7, 3)}, torch.float16, 8, id="fp16-gqa8-window"),
    pytest.param([21, 2], {"causal": True, "softcap": 5.0, "scale": 0.3}, torch.float32, 2, id="fp32-softcap-scale"),
]


@pytest.mark.parametrize("lengths, kwargs, dtype, group", RAGGED)
def test_ragged_matches_reference(lengths, kwargs, dtype, group, device):
    gen = torch.Generator().manual_seed(sum(lengths))
    kv_heads, dim = 2, 64
    k_lens = [n + (3 if i % 2 else 0) for i, n in enumerate(lengths)]  # queries shorter than keys for some
    q = _randn(gen, sum(lengths), kv_heads * group, dim, dtype=dtype, device=device)
    k = _randn(gen, sum(k_lens), kv_heads, dim, dtype=dtype, device=device)
    v = _randn(gen, sum(k_lens), kv_heads, 40, dtype=dtype, device=device)  # a V dim of its own
    cu_q, cu_k = _cu(lengths, device), _cu(k_lens, device)
    out = torch.full((q.shape[0], q.shape[1], 40), math.nan, dtype=dtype, device=device)
    result, lse = tilegen.varlen_attention(q, k, v, cu_q, cu_k, max(lengths), max(k_lens), return_lse=True, out=out,
                                           **kwargs)
    assert result is out
    cu = cu_k.tolist()
    ref, ref_lse = varlen_reference(q, [k[a:b] for a, b in zip(cu, cu[1:])], [v[a:b] for a, b in zip(cu, cu[1:])],
                                    cu_q.cpu(), **kwargs)
    _check(out, lse, ref, ref_lse, dtype)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    extra=st.integers(0, 9),
    causal=st.booleans(),
    group=st.sampled_from([1, 4]),
)
def test_ragged_hypothesis_batches(lengths, extra, causal, group, device):
    gen = torch.Generator().manual_seed(len(lengths) * 100 + extra)
    k_lens = [n + extra for n in lengths]
    q = _randn(gen, sum(lengths), 2 * group, 32, dtype=torch.float32, device=device)
    k = _randn(gen, sum(k_lens), 2, 32, dtype=torch.float32, device=device)
    v = _randn(gen, sum(k_lens), 2, 32, dtype=torch.float32, device=device)
    cu_q, cu_k = _cu(lengths, device), _cu(k_lens, device)
    out, lse = tilegen.varlen_attention(q, k, v, cu_q, cu_k, max(lengths), max(k_lens), causal=causal, return_lse=True)
    cu = cu_k.tolist()
    ref, ref_lse = varlen_reference(q, [k[a:b] for a, b in zip(cu, cu[1:])], [v[a:b] for a, b in zip(cu, cu[1:])],
                                    cu_q.cpu(), causal=causal)
    _check(out, lse, ref, ref_lse, torch.float32)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autocast_runs_in_its_dtype_as_the_dense_call_does(compiled, device):
    """In an autocast region fp32 (or mixed) inputs run in the region's dtype, the result coming out in it, as
    tilegen.attention and SDPA do, the padded form too; an fp32 leaf gets an fp32 gradient through the cast. The
    ragged calls ignored autocast (an fp32 result) and refused mixed dtypes."""
    gen = torch.Generator().manual_seed(12)
    lengths = [9, 0, 17]
    cu = torch.tensor([0, 9, 9, 26], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(26, 2, 16, generator=gen).to(device).requires_grad_() for _ in range(3))
    call = tilegen.varlen_attention
    padded = (torch.randn(2, 2, 9, 16, generator=gen).to(device) for _ in range(3))
    padded = [t.requires_grad_() for t in padded]
    cu_padded = torch.tensor([0, 5, 18], dtype=torch.int32, device=device)
    call_padded = varlen_attention_padded
    if compiled:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True, backend="aot_eager")
        call_padded = torch.compile(call_padded, fullgraph=True, backend="aot_eager")
    for dtype in (torch.bfloat16, torch.float16):
        for inputs in ((q, k, v), (q.to(dtype), k, v)):
            want = tilegen.varlen_attention(*(t.detach().to(dtype) for t in inputs), cu, cu, max(lengths),
                                            max(lengths), causal=True)
            with torch.autocast(torch.device(device).type, dtype=dtype):
                got = call(*inputs, cu, cu, max(lengths), max(lengths), causal=True)
            assert got.dtype == dtype
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        want = varlen_attention_padded(*(t.detach().to(dtype) for t in padded), cu_padded, cu_padded, 9, 9)
        with torch.autocast(torch.device(device).type, dtype=dtype):
            got_padded = call_padded(*padded, cu_padded, cu_padded, 9, 9)
        assert got_padded.dtype == dtype
        torch.testing.assert_close(got_padded, want, rtol=0, atol=0)
    for leaf, out in ((v, got), (padded[2], got_padded)):
        (grad,) = torch.autograd.grad(out.float().sum(), leaf)
        assert grad.dtype == torch.float32 and grad.abs().max() > 0


def test_a_strided_q_after_a_contiguous_one_gets_a_contiguous_output(device):
    """The plan, made by the contiguous call, is reused by the strided one (the same key but for strides): its
    output is laid out as new_empty lays it out, not as q is."""
    gen = torch.Generator().manual_seed(5)
    lengths = [7, 0, 12]
    q = _randn(gen, 4, sum(lengths), 32, dtype=torch.float32, device=device).transpose(0, 1)  # heads outermost
    k, v = (_randn(gen, sum(lengths), 2, 32, dtype=torch.float32, device=device) for _ in "kv")
    cu = _cu(lengths, device)
    tilegen.varlen_attention(q.contiguous(), k, v, cu, cu, 12, 12, causal=True)
    out = tilegen.varlen_attention(q, k, v, cu, cu, 12, 12, causal=True)
    assert out.is_contiguous() and out.shape == q.shape
    c = cu.tolist()
    ref, _ = varlen_reference(q, [k[a:b] for a, b in zip(c, c[1:])], [v[a:b] for a, b in zip(c, c[1:])], cu.cpu(),
                              causal=True)
    _check(out, None, ref, None, torch.float32)


@pytest.mark.parametrize("layout", ["token-major", "head-major"])
@pytest.mark.parametrize("kwargs", [{"causal": True}, {"window": (4, 0), "softcap": 5.0, "scale": 0.4}],
                         ids=["causal", "window-softcap"])
def test_a_padded_batch_is_read_in_place(layout, kwargs, device, monkeypatch):
    """varlen_attention_padded: [batch, heads, n, dim] tensors whose flattened rows are the ragged batch (a row
    split into sequences, an empty one, one across a row's end as packed training has none, but the offsets
    allow). Its output, [batch, n, heads, dv], is every element written (buffers start as NaN), twice (the second
    call takes the cached plan), and equal to varlen_attention's on the flattened tensors; a head-major tensor,
    which does not flatten in place, is flattened by a copy."""
    gen = torch.Generator().manual_seed(11)
    batch, n, heads, kv_heads, dim, dim_v = 3, 17, 4, 2, 32, 16

    def tensor(h, d):
        if layout == "token-major":  # transformers' projections, [batch, n, heads, dim] transposed
            return _randn(gen, batch, n, h, d, dtype=torch.float32, device=device).transpose(1, 2)
        return _randn(gen, batch, h, n, d, dtype=torch.float32, device=device)

    q, k, v = tensor(heads, dim), tensor(kv_heads, dim), tensor(kv_heads, dim_v)
    cu = _cu([5, 12, 0, 20, 11, 3], device)
    flat = [t.transpose(1, 2).reshape(batch * n, t.shape[1], t.shape[3]) for t in (q, k, v)]
    want = tilegen.varlen_attention(*flat, cu, cu, 20, 20, **kwargs).view(batch, n, heads, dim_v)
    c = cu.tolist()
    ref, _ = varlen_reference(flat[0], [flat[1][a:b] for a, b in zip(c, c[1:])],
                              [flat[2][a:b] for a, b in zip(c, c[1:])], cu.cpu(), **kwargs)
    nan_outputs(monkeypatch)
    for _ in range(2):
        out = varlen_attention_padded(q, k, v, cu, cu, 20, 20, **kwargs)
        assert out.shape == (batch, n, heads, dim_v) and out.is_contiguous()
        assert torch.equal(out, want)
        _check(out.view(batch * n, heads, dim_v), None, ref, None, torch.float32)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 3), n=st.integers(1, 21), cuts=st.lists(st.integers(0, 63), max_size=5),
       layout=st.sampled_from(["token-major", "head-major", "a slice of a longer cache"]), causal=st.booleans(),
       seed=st.integers(0, 99))
def test_a_padded_batch_read_in_place_property(batch, n, cuts, layout, causal, seed, device):
    """Any split of the flattened rows into sequences (empty ones included), over tensors laid out as transformers
    lays them out, as its dynamic cache does, or as a static cache's first n positions (which do not flatten in
    place): the reference per sequence, every element written."""
    gen = torch.Generator().manual_seed(seed)
    total = batch * n
    bounds = sorted({0, total, *(c % (total + 1) for c in cuts)})
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))

    def tensor(heads):
        if layout == "token-major":
            return _randn(gen, batch, n, heads, 16, dtype=torch.float32, device=device).transpose(1, 2)
        if layout == "head-major":
            return _randn(gen, batch, heads, n, 16, dtype=torch.float32, device=device)
        return _randn(gen, batch, heads, n + 5, 16, dtype=torch.float32, device=device)[:, :, :n]

    q, k, v = tensor(4), tensor(2), tensor(2)
    with pytest.MonkeyPatch.context() as patch:
        nan_outputs(patch)
        out = varlen_attention_padded(q, k, v, cu, cu, longest, longest, causal=causal)
    assert out.shape == (batch, n, 4, 16)
    flat = [t.transpose(1, 2).reshape(total, t.shape[1], 16) for t in (q, k, v)]
    ref, _ = varlen_reference(flat[0], [flat[1][a:b] for a, b in zip(bounds, bounds[1:])],
                              [flat[2][a:b] for a, b in zip(bounds, bounds[1:])], cu.cpu(), causal=causal)
    _check(out.reshape(total, 4, 16), None, ref, None, torch.float32)


def test_a_padded_batch_trains_as_the_flattened_call(device):
    """Under autograd varlen_attention_padded is varlen_attention on the flattened views: the same gradients."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = (_randn(gen, 2, 9, h, 16, dtype=torch.float32, device=device).transpose(1, 2) for h in (4, 2, 2))
    cu = _cu([4, 5, 9], device)
    grads = []
    for padded in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if padded:
            out = varlen_attention_padded(*leaves, cu, cu, 9, 9, causal=True)
        else:
            flat = [t.transpose(1, 2).reshape(18, t.shape[1], 16) for t in leaves]
            out = tilegen.varlen_attention(*flat, cu, cu, 9, 9, causal=True).view(2, 9, 4, 16)
        out.backward(torch.ones_like(out))
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_padded_batch_of_the_wrong_rank_names_the_argument(device):
    q = torch.randn(18, 4, 16, device=device)
    k = torch.randn(2, 2, 9, 16, device=device)
    with pytest.raises(ValueError, match=r"q: expected \[batch, heads, n, head_dim\]"):
        varlen_attention_padded(q, k, k, _cu([9, 9], device), _cu([9, 9], device), 9, 9)


@pytest.mark.parametrize("strided", [False, True], ids=["in-place", "copied"])
@pytest.mark.parametrize("bad", ["k batch", "v batch", "v length"])
def test_a_padded_batch_whose_rows_disagree_names_the_argument(bad, strided, device):
    # Each disagreeing tensor flattens to as many rows as the good one: only the check tells them apart.
    q = torch.randn(2, 4, 9, 16, device=device)
    k = torch.randn(2, 2, 9, 16, device=device)
    v = torch.randn(2, 2, 9, 16, device=device)
    if bad == "k batch":
        k = torch.randn(1, 2, 18, 16, device=device)
    elif bad == "v batch":
        v = torch.randn(1, 2, 18, 16, device=device)
    else:
        v = torch.randn(3, 2, 6, 16, device=device)
    if strided:  # a tensor that does not flatten in place takes the flattening call
        q = torch.randn(2, 9, 4, 32, device=device)[..., ::2].transpose(1, 2)
    match = {"k batch": r"k: a batch of 1, q has 2", "v batch": r"v: a batch of 1, q has 2",
             "v length": r"v: a batch of 3, q has 2"}[bad]
    with pytest.raises(ValueError, match=match):
        varlen_attention_padded(q, k, v, _cu([9, 9], device), _cu([9, 9], device), 9, 9)


def test_a_padded_batch_whose_values_are_shorter_names_the_argument(device):
    q = torch.randn(2, 4, 9, 16, device=device)
    k = torch.randn(2, 2, 9, 16, device=device)
    with pytest.raises(ValueError, match=r"v: 8 tokens a row, k has 9"):
        varlen_attention_padded(q, k, k[:, :, :8], _cu([9, 9], device), _cu([9, 9], device), 9, 9)


# -------------------------------------------------------------------------------- paged

def make_cache(k_lens, page_size, kv_heads, dim, dtype, device, gen, spare=3, dim_v=None):
    """A cache holding ``k_lens`` tokens per sequence in shuffled pages (V's of ``dim_v`` columns, else ``dim``);
    every unused slot is NaN."""
    counts = [math.ceil(n / page_size) for n in k_lens]
    num_pages = sum(counts) + spare
    k_pages = torch.full((num_pages, page_size, kv_heads, dim), math.nan, dtype=dtype, device=device)
    dim_v = dim if dim_v is None else dim_v
    v_pages = torch.full((num_pages, page_size, kv_heads, dim_v), math.nan, dtype=dtype, device=device)
    order = torch.randperm(num_pages, generator=gen)
    # Entries past a sequence's pages hold garbage, as a vLLM block table may.
    block_table = torch.full((len(k_lens), max([*counts, 1]) + 1), num_pages + 7, dtype=torch.int32)
    used = 0
    for b, (n, count) in enumerate(zip(k_lens, counts)):
        for i in range(count):
            page = int(order[used])
            used += 1
            block_table[b, i] = page
            held = min(page_size, n - i * page_size)
            k_pages[page, :held] = _randn(gen, held, kv_heads, dim, dtype=dtype, device=device)
            v_pages[page, :held] = _randn(gen, held, kv_heads, dim_v, dtype=dtype, device=device)
    return tilegen.PagedKVCache.from_block_table(k_pages, v_pages, block_table.to(device),
                                                 torch.tensor(k_lens, device=device))


def paged_reference(q, cache, cu_q, **kwargs):
    """The float64 reference on the CPU; score and mask mods run on ``q``'s device, where their captured tensors
    are."""
    for name in ("score_mod", "mask_mod"):
        if kwargs.get(name) is not None:
            kwargs[name] = _on_device(kwargs[name], q.device)
    table = (cache.indptr.cpu(), cache.indices.cpu(), cache.last_page_len.cpu())
    keys = [gather_pages(cache.k_pages.cpu(), *table, b) for b in range(cache.batch)]
    values = [gather_pages(cache.v_pages.cpu(), *table, b) for b in range(cache.batch)]
    return varlen_reference(q.cpu(), keys, values, cu_q.cpu(), **kwargs)


def _on_device(mod, device):
    return lambda *args: mod(*(a.to(device) for a in args)).cpu()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"gqa{g}")
def test_paged_append_matches_reference(page_size, group, device):
    """Chunked prefill: each sequence's last n_q tokens attend causally to the whole cached prefix."""
    gen = torch.Generator().manual_seed(page_size * 10 + group)
    k_lens = [0, 1, page_size - 1 or 2, page_size, page_size + 1, 1000]
    q_lens = [0, 1, 1, 3, page_size + 1, 7]
    dtype = torch.bfloat16 if group == 4 else torch.float32
    cache = make_cache(k_lens, page_size, 1 if group == 8 else 2, 32, dtype, device, gen)
    cache.validate()
    q = _randn(gen, sum(q_lens), cache.kv_heads * group, 32, dtype=dtype, device=device)
    cu_q = _cu(q_lens, device)
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, cache, heads_q=q.shape[1], causal=True, return_lse=True)
    out = torch.full_like(q, math.nan)
    result, lse = attn.run(q, cache, out=out)
    assert result is out
    ref, ref_lse = paged_reference(q, cache, cu_q, causal=True)
    _check(out.cpu(), lse.cpu(), ref, ref_lse, dtype)


def test_one_plan_serves_every_layer(device):
    gen = torch.Generator().manual_seed(3)
    k_lens, q_lens = [40, 17, 5], [40, 2, 5]
    first = make_cache(k_lens, 16, 2, 32, torch.float32, device, gen)
    # A second layer: its own pages, the same page table.
    second = tilegen.PagedKVCache(torch.randn_like(first.k_pages), torch.randn_like(first.v_pages), first.indptr,
                                  first.indices, first.last_page_len)
    cu_q = _cu(q_lens, device)
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, first, heads_q=4, window=(9, 0), max_seqlen_q=40, max_seqlen_k=40)
    for cache in (first, second):
        q = _randn(gen, sum(q_lens), 4, 32, dtype=torch.float32, device=device)
        out = attn.run(q, cache)
        ref, _ = paged_reference(q, cache, cu_q, window=(9, 0))
        error, _ = relative_error(out.cpu(), ref)
        assert error < 1e-4


def test_paged_run_of_a_strided_q_gets_a_contiguous_output(device):
    gen = torch.Generator().manual_seed(8)
    k_lens, q_lens = [30, 9], [4, 9]
    cache = make_cache(k_lens, 16, 2, 32, torch.float32, device, gen)
    cu_q = _cu(q_lens, device)
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, cache, heads_q=4, causal=True)
    q = _randn(gen, 4, sum(q_lens), 32, dtype=torch.float32, device=device).transpose(0, 1)  # heads outermost
    attn.run(q.contiguous(), cache)
    out = attn.run(q, cache)
    assert out.is_contiguous() and out.shape == q.shape
    ref, _ = paged_reference(q, cache, cu_q, causal=True)
    _check(out.cpu(), None, ref, None, torch.float32)


def test_block_table_gives_flashinfer_csr(device):
    k_pages = torch.randn(6, 8, 1, 16, device=device)
    table = torch.tensor([[4, 1, 5], [2, 0, 0], [3, 3, 3]], dtype=torch.int32, device=device)
    cache = tilegen.PagedKVCache.from_block_table(k_pages, k_pages.clone(), table, torch.tensor([17, 8, 0]))
    assert cache.indptr.tolist() == [0, 3, 4, 4]
    assert cache.indices.tolist() == [4, 1, 5, 2]
    assert cache.last_page_len.tolist() == [1, 8, 0]
    assert cache.seq_lens().tolist() == [17, 8, 0]


# ---------------------------------------------------------------------------- bad input

def _ragged_args(device):
    q = torch.randn(10, 4, 32, device=device)
    k = torch.randn(12, 2, 32, device=device)
    cu_q, cu_k = _cu([4, 6], device), _cu([5, 7], device)
    return q, k, k.clone(), cu_q, cu_k, 6, 7


@pytest.mark.parametrize(
    "change, needle",
    [
        pytest.param({3: "int64"}, "cu_seqlens_q", id="cu-seqlens-dtype"),
        pytest.param({4: "short"}, "cu_seqlens_k", id="cu-seqlens-length"),
        pytest.param({5: -1}, "max_seqlen_q", id="negative-max"),
        pytest.param({6: 7.0}, "max_seqlen_k", id="max-not-an-int"),
        pytest.param({0: "heads3"}, "query heads", id="heads-not-a-multiple"),
        pytest.param({2: "fp16"}, "v:", id="dtype-mismatch"),
        pytest.param({0: "2d"}, "q:", id="q-rank"),
    ],
)
def test_ragged_bad_input_names_the_argument(change, needle, device):
    args = list(_ragged_args(device))
    for index, what in change.items():
        if what == "int64":
            args[index] = args[index].long()
        elif what == "short":
            args[index] = args[index][:2]
        elif what == "heads3":
            args[index] = torch.randn(10, 3, 32, device=device)
        elif what == "fp16":
            args[index] = args[index].half()
        elif what == "2d":
            args[index] = args[index][:, 0]
        else:
            args[index] = what
    with pytest.raises((ValueError, TypeError), match=needle):
        tilegen.varlen_attention(*args)


@pytest.mark.parametrize(
    "cu_q, needle",
    [
        pytest.param([1, 4, 10], "must start at 0", id="not-from-zero"),
        pytest.param([0, 7, 4], "must not decrease", id="not-monotone"),
        pytest.param([0, 4, 9], "ends at 9", id="disagrees-with-q"),
    ],
)
def test_debug_mode_checks_cu_seqlens_on_the_device(cu_q, needle, device, monkeypatch):
    q, k, v, _, cu_k, _, max_k = _ragged_args(device)
    cu = torch.tensor(cu_q, dtype=torch.int32, device=device)
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    with pytest.raises(ValueError, match=needle):
        tilegen.varlen_attention(q, k, v, cu, cu_k, 7, max_k)


def test_debug_mode_checks_lengths_against_max_seqlen(device, monkeypatch):
    q, k, v, cu_q, cu_k, _, max_k = _ragged_args(device)
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    with pytest.raises(ValueError, match="exceeds max_seqlen 5"):
        tilegen.varlen_attention(q, k, v, cu_q, cu_k, 5, max_k)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        pytest.param("indices", [0, 9], "outside the cache", id="page-outside"),
        pytest.param("last_page_len", [9, 1], "last_page_len", id="last-page-too-long"),
        pytest.param("last_page_len", [0, 1], "last_page_len", id="last-page-empty"),
        pytest.param("indptr", [0, 2, 1], "non-decreasing", id="indptr-decreasing"),
        pytest.param("indptr", [1, 1, 2], "start at 0", id="indptr-not-from-zero"),
    ],
)
def test_cache_validation_names_the_field(field, value, needle, device):
    pages = torch.randn(4, 8, 1, 16, device=device)
    tables = {"indptr": [0, 1, 2], "indices": [0, 3], "last_page_len": [8, 1]}
    tables[field] = value
    cache = tilegen.PagedKVCache(pages, pages.clone(), *(torch.tensor(tables[n], dtype=torch.int32, device=device)
                                                         for n in ("indptr", "indices", "last_page_len")))
    with pytest.raises(ValueError, match=needle):
        cache.validate()


def test_cache_construction_checks_shapes_and_page_size(device):
    i32 = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="page size 12 is not supported"):
        tilegen.PagedKVCache(torch.randn(2, 12, 1, 16, device=device), torch.randn(2, 12, 1, 16, device=device),
                             i32, i32, i32[:1])
    with pytest.raises(ValueError, match="v_pages"):
        tilegen.PagedKVCache(torch.randn(2, 8, 1, 16, device=device), torch.randn(2, 8, 2, 16, device=device),
                             i32, i32, i32[:1])
    with pytest.raises(ValueError, match="last_page_len: expected 1"):
        tilegen.PagedKVCache(torch.randn(2, 8, 1, 16, device=device), torch.randn(2, 8, 1, 16, device=device),
                             i32, i32, i32)
    with pytest.raises(ValueError, match="indptr: expected a 1-d int32"):
        tilegen.PagedKVCache(torch.randn(2, 8, 1, 16, device=device), torch.randn(2, 8, 1, 16, device=device),
                             i32.long(), i32, i32[:1])


def test_paged_run_checks_q_and_cache_against_the_plan(device):
    gen = torch.Generator().manual_seed(0)
    cache = make_cache([20, 3], 16, 2, 32, torch.float32, device, gen)
    attn = tilegen.PagedAttention()
    with pytest.raises(RuntimeError, match="plan"):
        attn.run(torch.randn(3, 4, 32, device=device), cache)
    with pytest.raises(ValueError, match="heads_q"):
        attn.plan(_cu([2, 1], device), cache, heads_q=3)
    with pytest.raises(ValueError, match="cu_seqlens_q: 4 entries"):
        attn.plan(_cu([2, 1, 1], device), cache, heads_q=4)
    attn.plan(_cu([2, 1], device), cache, heads_q=4)
    with pytest.raises(ValueError, match=r"q: expected \[total_q, 4, 32\]"):
        attn.run(torch.randn(3, 2, 32, device=device), cache)
    with pytest.raises(ValueError, match="q: torch.float16"):
        attn.run(torch.randn(3, 4, 32, device=device).half(), cache)
    other = make_cache([20, 3], 8, 2, 32, torch.float32, device, gen)
    with pytest.raises(ValueError, match="cache: page size"):
        attn.run(torch.randn(3, 4, 32, device=device), other)


def test_paged_run_refuses_a_cache_of_another_batch_without_debug(device, monkeypatch):
    """A stale plan: the cache's page table has another number of sequences than the planned one, which run
    reads. Its length is on the host, so run says so whatever TILEGEN_DEBUG is, not by a wrong answer."""
    monkeypatch.delenv("TILEGEN_DEBUG", raising=False)
    gen = torch.Generator().manual_seed(0)
    cache = make_cache([20, 3], 16, 2, 32, torch.float32, device, gen)
    attn = tilegen.PagedAttention()
    attn.plan(_cu([2, 1], device), cache, heads_q=4)
    q = torch.randn(3, 4, 32, device=device)
    attn.run(q, cache)
    for lens in ([20, 3, 5], [20]):
        other = make_cache(lens, 16, 2, 32, torch.float32, device, gen)
        with pytest.raises(ValueError, match=rf"cache: a page table of {len(lens)} sequences, but the plan's has 2"):
            attn.run(q, other)


def test_debug_plan_refuses_more_queries_than_cached_tokens(device, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    cache = make_cache([4, 3], 16, 2, 32, torch.float32, device, gen)
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    with pytest.raises(ValueError, match="more new tokens than the cache holds"):
        tilegen.PagedAttention().plan(_cu([5, 1], device), cache, heads_q=4)


def test_debug_run_refuses_a_cache_the_plan_does_not_cover(device, monkeypatch):
    """run reads the planned page table and the planned longest sequence: under TILEGEN_DEBUG a cache that grew past
    the plan in place, one with another page table, or one that was spoiled since is refused at run, not answered
    wrongly; a cache of another layer that shares the table (with_pages) and one with an equal copy pass."""
    gen = torch.Generator().manual_seed(2)
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    cache = make_cache([11, 13], 8, 2, 32, torch.float32, device, gen, spare=6)
    q = torch.randn(3, 4, 32, generator=gen).to(device)
    attn = tilegen.PagedAttention()
    attn.plan(_cu([2, 1], device), cache, heads_q=4)
    attn.run(q, cache)
    attn.run(q, cache.with_pages(cache.k_pages.clone(), cache.v_pages.clone()))
    copy = tilegen.PagedKVCache(cache.k_pages, cache.v_pages, cache.indptr.clone(), cache.indices.clone(),
                                cache.last_page_len.clone())
    attn.run(q, copy)
    other = make_cache([11, 13], 8, 2, 32, torch.float32, device, gen, spare=6)
    with pytest.raises(ValueError, match=r"cache: its page table \(indptr, indices, last_page_len\) differs"):
        attn.run(q, other)
    cache.last_page_len[1] = 8  # the second sequence grows from 13 to 16 tokens in its last page
    with pytest.raises(ValueError, match="cache: a sequence of 16 tokens, past the 13 the plan covers"):
        attn.run(q, cache)
    cache.indices[0] = cache.num_pages + 2
    with pytest.raises(ValueError, match="indices"):
        attn.run(q, cache)


# ------------------------------------------------------------- offsets wrong in value only
#
# Values only the device holds, run without TILEGEN_DEBUG: the kernels clamp what they read, so
# the process survives, the well-formed sequences keep their answer, and nothing outside the
# tensors is read (inputs sit between NaN rows, and every output row must stay finite) or
# written (outputs sit between rows of a pattern, which must stay bit for bit). Most wrong
# offsets point just past a tensor, into those bands, so a kernel without the clamps fails
# here rather than corrupting the heap.

PAD = 8
OUT_FILL = -77.0
UNWRITTEN = 1e3  # finite: a row left unwritten must not pass for a read of NaN


def _rows(cu, sequences):
    return [r for b in sorted(sequences) for r in range(cu[b], cu[b + 1])]


WRONG_RAGGED = [
    # (which offsets, entry, value, max_seqlen_q or None for the true one, sequences it spoils)
    pytest.param("q", 4, 32 + 5, None, {3}, id="q-ends-past-the-rows"),
    pytest.param("q", 3, 1000, None, {2, 3}, id="q-far-past-the-rows"),
    pytest.param("q", 0, -3, None, {0}, id="q-negative-start"),
    pytest.param("q", 2, 10, None, {0, 1, 2}, id="q-decreasing"),  # sequence 2's rows now overlap 0's
    pytest.param("k", 4, 37 + 6, None, {3}, id="k-ends-past-the-rows"),
    pytest.param("k", 1, -4, None, {0, 1}, id="k-negative"),
    pytest.param("k", 3, 2, None, {2, 3}, id="k-decreasing"),
    pytest.param("q", 0, 0, 8, {0, 3}, id="max-seqlen-q-too-small"),
]


@pytest.mark.parametrize("which, entry, value, max_q, spoiled", WRONG_RAGGED)
def test_ragged_offsets_wrong_in_value_stay_inside_the_tensors(which, entry, value, max_q, spoiled, device,
                                                                monkeypatch):
    monkeypatch.delenv("TILEGEN_DEBUG", raising=False)
    gen = torch.Generator().manual_seed(entry)
    q_lens, k_lens = [17, 5, 1, 9], [20, 5, 3, 9]
    q, _ = inside(_randn(gen, sum(q_lens), 4, 32, dtype=torch.float32, device=device), PAD, math.nan)
    k, _ = inside(_randn(gen, sum(k_lens), 2, 32, dtype=torch.float32, device=device), PAD, math.nan)
    v, _ = inside(_randn(gen, sum(k_lens), 2, 32, dtype=torch.float32, device=device), PAD, math.nan)
    cu = {"q": _cu(q_lens, device), "k": _cu(k_lens, device)}
    ck = cu["k"].tolist()
    ref, _ = varlen_reference(q, [k[a:b] for a, b in zip(ck, ck[1:])], [v[a:b] for a, b in zip(ck, ck[1:])],
                              cu["q"].cpu(), causal=True)
    good = _rows(cu["q"].tolist(), set(range(4)) - spoiled)
    wrong = {name: t.clone() for name, t in cu.items()}
    wrong[which][entry] = value
    out, out_buffer = inside(torch.full((q.shape[0], 4, 32), UNWRITTEN, device=device), PAD, OUT_FILL)
    tilegen.varlen_attention(q, k, v, wrong["q"], wrong["k"], max_q or max(q_lens), max(k_lens), causal=True,
                             out=out)
    assert_guard_bands(out_buffer, PAD, OUT_FILL)
    assert torch.isfinite(out).all(), "a kernel read outside q, k or v"
    error, _ = relative_error(out[good], ref[good])
    assert error < 1e-4, f"a well-formed sequence changed: relative error {error:.2e}"


# Page-table faults: (name, the sequences spoiled); the batch below has 4 sequences, sequence 1
# holding 3 pages of 16.
PAGE_TABLE_FAULTS = [
    pytest.param("page-past-the-cache", {1}),
    pytest.param("page-negative", {1}),
    pytest.param("last-page-empty", {1}),
    pytest.param("last-page-too-long", {1}),
    pytest.param("indptr-past-indices", {3}),
    pytest.param("indptr-decreasing", {1, 2}),
    pytest.param("indptr-negative", {0}),
]
PAGED_K_LENS = [40, 35, 5, 20]
PAGE = 16


def guarded_cache(k_lens, page_size, kv_heads, dim, device, gen, fault=None, dtype=torch.float32):
    """``make_cache``'s cache with finite unused slots, its pages between NaN pages and its page
    table between entries of -1 (a page id that points into those NaN pages), with ``fault``
    (one of ``PAGE_TABLE_FAULTS``) written into the table."""
    cache = make_cache(k_lens, page_size, kv_heads, dim, dtype, device, gen)
    k_pages, _ = inside(cache.k_pages.nan_to_num(0.0), 2, math.nan)
    v_pages, _ = inside(cache.v_pages.nan_to_num(0.0), 2, math.nan)
    indptr, indices, last = (t.tolist() for t in (cache.indptr, cache.indices, cache.last_page_len))
    if fault == "page-past-the-cache":
        indices[indptr[1]] = cache.num_pages + 1
    elif fault == "page-negative":
        indices[indptr[1] + 1] = -1
    elif fault == "last-page-empty":
        last[1] = 0
    elif fault == "last-page-too-long":
        last[1] = page_size + 3
    elif fault == "indptr-past-indices":
        indptr[-1] = len(indices) + 3
    elif fault == "indptr-decreasing":
        indptr[2] = indptr[1] - 1
    elif fault == "indptr-negative":
        indptr[0] = -2
    else:
        assert fault is None, fault
    table = (inside(torch.tensor(x, dtype=torch.int32, device=device), 4, -1)[0] for x in (indptr, indices, last))
    return tilegen.PagedKVCache(k_pages, v_pages, *table)


@pytest.mark.parametrize("fault, spoiled", PAGE_TABLE_FAULTS, ids=[p.values[0] for p in PAGE_TABLE_FAULTS])
def test_paged_attention_with_a_wrong_page_table_stays_inside_the_cache(fault, spoiled, device, monkeypatch):
    monkeypatch.delenv("TILEGEN_DEBUG", raising=False)
    good_cache = guarded_cache(PAGED_K_LENS, PAGE, 2, 32, device, torch.Generator().manual_seed(1))
    bad_cache = guarded_cache(PAGED_K_LENS, PAGE, 2, 32, device, torch.Generator().manual_seed(1), fault)
    q_lens = [3, 17, 2, 5]
    cu_q = _cu(q_lens, device)
    q, _ = inside(_randn(torch.Generator().manual_seed(2), sum(q_lens), 4, 32, dtype=torch.float32, device=device),
                  PAD, math.nan)
    ref, _ = paged_reference(q, good_cache, cu_q, causal=True)
    out, out_buffer = inside(torch.full_like(q, UNWRITTEN), PAD, OUT_FILL)
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, bad_cache, heads_q=4, causal=True, max_seqlen_q=max(q_lens), max_seqlen_k=max(PAGED_K_LENS))
    attn.run(q, bad_cache, out=out)
    assert_guard_bands(out_buffer, PAD, OUT_FILL)
    assert torch.isfinite(out).all(), "a kernel read outside q, the pages or the page table"
    good = _rows(cu_q.tolist(), set(range(4)) - spoiled)
    error, _ = relative_error(out[good].cpu(), ref[good])
    assert error < 1e-4, f"a well-formed sequence changed: relative error {error:.2e}"


@pytest.mark.gpu
def test_paged_run_is_capturable_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(5)
    cache = make_cache([300, 17, 64], 16, 2, 64, torch.bfloat16, "cuda", gen)
    cu_q = _cu([64, 17, 1], "cuda")
    attn = tilegen.PagedAttention()
    attn.plan(cu_q, cache, heads_q=8, causal=True, max_seqlen_q=64, max_seqlen_k=300)
    q = torch.randn(82, 8, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    attn.run(q, cache, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, cache, out=out)
    q.copy_(torch.randn_like(q))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = paged_reference(q, cache, cu_q, causal=True)
    error, _ = relative_error(out.cpu(), ref)
    assert error < 1e-2


# ------------------------------------------------------------------------------- tuning

@pytest.mark.parametrize("layout", ["ragged", "paged"])
def test_tune_stores_rows_that_dispatch_and_db_list_use(layout, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tilegen import dispatch
    from tilegen.cli import app
    from tilegen.db import TuningDB
    from tilegen.device import device_info
    from tilegen.families import family_of
    from tilegen.tuning import Tuner

    spec = tilegen.spec_from_json({"family": "attention_varlen", "head_dim": 32, "q_per_kv": 2, "mask": "causal",
                                   "dtype": "fp32", "kv_layout": layout,
                                   **({"page_size": 16} if layout == "paged" else {})})
    path = tmp_path / "tuning.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(path))
    with TuningDB(path) as db, Tuner(db, device_info(), trials=2) as tuner:
        result = tuner.tune(spec, 32)
    assert result.best is not None and result.statuses["ok"] == 2
    dispatch.reset()
    choice = dispatch.table_for(spec, device_info()).choose(30)
    assert (choice.config, choice.source, choice.tuned_bucket) == (result.best.config, str(path), 32)
    listed = CliRunner().invoke(app, ["db", "--db", str(path), "list"])
    assert listed.exit_code == 0 and spec.name in listed.stdout
    assert family_of(spec).problem(spec, 32, on_gpu=False).flops() > 0
