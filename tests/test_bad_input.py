"""Every bad argument to ``tilegen.attention`` is refused with an error that names it.

The checks run before any kernel is generated or launched, so these tests are fast.
Messages start with the argument's name (``"q: ..."``, ``"window: ..."``); the tests
match that prefix.
"""

from __future__ import annotations

import math

import pytest
import torch

import tilegen


def qkv(device, *, b=1, hq=2, hkv=2, nq=8, nk=8, d=64, dv=None, dtype=torch.float16):
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return randn(b, hq, nq, d), randn(b, hkv, nk, d), randn(b, hkv, nk, d if dv is None else dv)


def raises(exc, prefix):
    """``pytest.raises`` for a message that starts with ``prefix`` (an argument name and a colon)."""
    import re

    return pytest.raises(exc, match="^" + re.escape(prefix))


# ------------------------------------------------------------------------------ tensors

@pytest.mark.parametrize(
    "which,shape",
    [
        pytest.param("q", (2, 8, 64), id="q-rank3"),
        pytest.param("k", (1, 2, 2, 8, 64), id="k-rank5"),
        pytest.param("v", (8, 64), id="v-rank2"),
    ],
)
def test_wrong_rank(device, which, shape):
    args = dict(zip("qkv", qkv(device)))
    args[which] = torch.randn(*shape, device=device, dtype=torch.float16)
    with raises(ValueError, f"{which}: expected 4 dims"):
        tilegen.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_not_a_tensor(device, which):
    args = dict(zip("qkv", qkv(device)))
    args[which] = args[which].cpu().numpy()
    with raises(TypeError, f"{which}: expected a torch.Tensor"):
        tilegen.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int32, torch.bool, torch.float8_e4m3fn], ids=lambda d: str(d).split(".")[-1]
)
def test_unsupported_dtype(device, dtype):
    q, k, v = (t.to(dtype) for t in qkv(device, dtype=torch.float32))
    with raises(TypeError, "q: expected dtype float16, bfloat16 or float32"):
        tilegen.attention(q, k, v)


@pytest.mark.parametrize("which", ["k", "v"])
def test_dtype_mismatch(device, which):
    args = dict(zip("qkv", qkv(device)))
    args[which] = args[which].to(torch.bfloat16)
    with raises(TypeError, f"{which}: dtype torch.bfloat16 differs from q's torch.float16"):
        tilegen.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which", ["k", "v"])
def test_device_mismatch(device, which):
    """A KV tensor elsewhere than q; the meta device stands in for a second device without one."""
    args = dict(zip("qkv", qkv(device)))
    args[which] = args[which].to("meta")
    with raises(ValueError, f"{which}: on meta while q is on {device}"):
        tilegen.attention(args["q"], args["k"], args["v"])


@pytest.mark.gpu
def test_device_mismatch_cpu_and_cuda():
    q, k, v = qkv("cuda")
    with raises(ValueError, "k: on cpu while q is on cuda"):
        tilegen.attention(q, k.cpu(), v)


def test_unsupported_device():
    q, k, v = (t.to("meta") for t in qkv("cpu"))
    with raises(ValueError, "q: device meta is not supported"):
        tilegen.attention(q, k, v)


@pytest.mark.parametrize("value", ["0", ""], ids=["zero", "empty"])
def test_cpu_tensors_without_the_interpreter(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    q, k, v = qkv("cpu")
    with raises(ValueError, "q: tensors are on the CPU") as info:
        tilegen.attention(q, k, v)
    assert "TRITON_INTERPRET=1" in str(info.value)


# ------------------------------------------------------------------------------- shapes

def test_batch_mismatch_k(device):
    q, _, _ = qkv(device, b=2)
    _, k, v = qkv(device, b=3)
    with raises(ValueError, "k, v: batch sizes 3, 3 differ from q's 2"):
        tilegen.attention(q, k, v)


def test_batch_mismatch_v(device):
    q, k, _ = qkv(device, b=2)
    _, _, v = qkv(device, b=1)
    with raises(ValueError, "k, v: batch sizes 2, 1 differ from q's 2"):
        tilegen.attention(q, k, v)


def test_head_dim_mismatch_q_k(device):
    q, _, v = qkv(device, d=64)
    _, k, _ = qkv(device, d=128)
    with raises(ValueError, "k: head_dim 128 differs from q's 64"):
        tilegen.attention(q, k, v)


@pytest.mark.parametrize(
    "heads,seq", [pytest.param(1, 8, id="heads"), pytest.param(2, 9, id="seq")]
)
def test_v_heads_or_seq_mismatch(device, heads, seq):
    q, k, _ = qkv(device, hkv=2, nk=8)
    _, _, v = qkv(device, hkv=heads, nk=seq)
    with raises(ValueError, "v: heads and seq"):
        tilegen.attention(q, k, v)


@pytest.mark.parametrize("hq,hkv", [(6, 4), (3, 2), (1, 2), (4, 0)], ids=lambda x: str(x))
def test_query_heads_not_a_multiple_of_kv_heads(device, hq, hkv):
    q, _, _ = qkv(device, hq=hq)
    _, k, v = qkv(device, hkv=hkv)
    message = f"q: {hq} query heads is not a multiple of k's {hkv} KV heads" if hkv else "k: no KV head"
    with raises(ValueError, message):
        tilegen.attention(q, k, v)


@pytest.mark.parametrize("d", [0, 65, 8, 12, 264, 512])
def test_unsupported_head_dim(device, d):
    q, k, v = qkv(device, d=d)
    with raises(ValueError, "q: head_dim:"):
        tilegen.attention(q, k, v)


@pytest.mark.parametrize("dv", [65, 4, 512])
def test_unsupported_value_head_dim(device, dv):
    q, k, v = qkv(device, d=64, dv=dv)
    with raises(ValueError, "v: head_dim_v:"):
        tilegen.attention(q, k, v)


def test_sequence_too_long(device):
    # Expanded views: the huge sequence is never allocated.
    q = torch.zeros(1, 1, 1, 64, device=device, dtype=torch.float16).expand(1, 1, 1 << 29, 64)
    k = torch.zeros(1, 1, 1, 64, device=device, dtype=torch.float16).expand(1, 1, 16, 64)
    with raises(ValueError, "q, k: sequence lengths"):
        tilegen.attention(q, k, k)


# ------------------------------------------------------------------------------ numbers

@pytest.mark.parametrize(
    "window,prefix",
    [
        pytest.param((-1, 0), "window: left must be", id="negative-left"),
        pytest.param((0, -3), "window: right must be", id="negative-right"),
        pytest.param((1.5, 2), "window: left must be", id="float-left"),
        pytest.param((4, True), "window: right must be", id="bool-right"),
        pytest.param((4, "2"), "window: right must be", id="str-right"),
        pytest.param(5, "window: expected (left, right)", id="int"),
        pytest.param((1, 2, 3), "window: expected (left, right)", id="three-values"),
        pytest.param("ab", "window: expected (left, right)", id="str"),
        pytest.param({"left": 1, "right": 2}, "window: expected (left, right)", id="dict"),
    ],
)
def test_bad_window(device, window, prefix):
    q, k, v = qkv(device)
    with pytest.raises((TypeError, ValueError)) as info:
        tilegen.attention(q, k, v, window=window)
    assert str(info.value).startswith(prefix), str(info.value)


@pytest.mark.parametrize("right", [1, 7])
def test_causal_with_right_window(device, right):
    q, k, v = qkv(device)
    with raises(ValueError, f"window: causal=True sees no key right of the diagonal, but right={right}"):
        tilegen.attention(q, k, v, causal=True, window=(4, right))


@pytest.mark.parametrize("causal", [1, "yes", None], ids=["int", "str", "none"])
def test_causal_not_a_bool(device, causal):
    q, k, v = qkv(device)
    with raises(TypeError, "causal: expected a bool"):
        tilegen.attention(q, k, v, causal=causal)


@pytest.mark.parametrize(
    "scale",
    [math.nan, math.inf, -math.inf, "0.1", True, torch.tensor(0.1)],
    ids=["nan", "inf", "-inf", "str", "bool", "tensor"],
)
def test_bad_scale(device, scale):
    q, k, v = qkv(device)
    with raises(ValueError, "scale: expected a finite number"):
        tilegen.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [3e38, -2.4e38])
def test_a_scale_that_overflows_in_base_2_is_refused(device, scale):
    """The kernels take the scale to base 2 (times log2(e)) in fp32: past 2.36e38 it is inf, and every output NaN."""
    q, k, v = qkv(device)
    with raises(ValueError, f"scale: {scale!r} overflows fp32 once the kernels take it to base 2"):
        tilegen.attention(q, k, v, scale=scale)
    tilegen.attention(q, k, v, scale=1e37)


@pytest.mark.parametrize(
    "arg, value, prefix",
    [
        pytest.param("scale", 10**400, "scale: ", id="scale"),
        pytest.param("scale", -(10**400), "scale: ", id="negative-scale"),
        pytest.param("softcap", 10**400, "softcap: expected None or a finite positive number", id="softcap"),
    ],
)
def test_an_int_past_the_largest_float_is_refused_by_name(device, arg, value, prefix):
    """Python's ints have no bound: one that no float holds is refused naming its argument, not by the
    OverflowError of its conversion."""
    q, k, v = qkv(device)
    with raises(ValueError, prefix):
        tilegen.attention(q, k, v, **{arg: value})


@pytest.mark.parametrize(
    "softcap",
    [0.0, -1.0, 0, math.nan, math.inf, "30", True],
    ids=["zero", "negative", "int-zero", "nan", "inf", "str", "bool"],
)
def test_bad_softcap(device, softcap):
    q, k, v = qkv(device)
    with raises(ValueError, "softcap: expected None or a finite positive number"):
        tilegen.attention(q, k, v, softcap=softcap)


@pytest.mark.parametrize("softcap", [1e-39, 2.0 ** -127], ids=["1e-39", "2^-127"])
def test_a_softcap_past_fp32s_normal_range_is_refused(device, softcap):
    """The forward would run, but the backward's 1/softcap overflows fp32 and its gradients would be NaN."""
    q, k, v = qkv(device)
    with raises(ValueError, "softcap: expected None or a number >= 1.175e-38"):
        tilegen.attention(q, k, v, softcap=softcap)
    tilegen.attention(q, k, v, softcap=2.0 ** -126)  # the smallest normal itself is a number the kernels take


def test_bad_input_is_refused_before_any_kernel_is_generated(device, monkeypatch):
    """Validation comes first: a refused call never renders or imports a kernel."""
    import tilegen.ops.attention as attention_module

    def fail(*args, **kwargs):
        raise AssertionError("a kernel was launched for a bad call")

    monkeypatch.setattr(attention_module, "run_with_config", fail)
    monkeypatch.setattr(attention_module, "_plan_for", fail)
    monkeypatch.setattr(attention_module.dispatch, "table_on", fail)
    q, k, v = qkv(device)
    with raises(ValueError, "softcap:"):
        tilegen.attention(q, k, v, softcap=-2.0)
    with raises(ValueError, "window:"):
        tilegen.attention(q, k, v, window=(-1, None))


def test_explain_validates_like_the_op(device):
    q, k, v = qkv(device)
    with raises(ValueError, "window: left must be"):
        tilegen.explain(q, k, v, window=(-2, 0))


# ------------------------------------------------------------------------------ out=

@pytest.mark.parametrize(
    "make,exc,prefix",
    [
        pytest.param(lambda q: q.new_empty(1, 2, 8, 32), ValueError, "out: expected shape", id="shape"),
        pytest.param(lambda q: q.new_empty(1, 2, 8, 64, dtype=torch.float32), TypeError, "out: expected dtype",
                     id="dtype"),
        pytest.param(lambda q: q.new_empty(1, 2, 8, 64).cpu().numpy(), TypeError, "out: expected a torch.Tensor",
                     id="numpy"),
        pytest.param(lambda q: q.new_empty(1, 2, 8, 64, device="meta"), ValueError, "out: on meta", id="device"),
    ],
)
def test_bad_out(device, make, exc, prefix):
    q, k, v = qkv(device)
    for _ in range(2):  # the first call checks everything; the second reuses the checked plan
        with raises(exc, prefix):
            tilegen.attention(q, k, v, out=make(q))
        tilegen.attention(q, k, v)


# ------------------------------------------------------------------------------ repeated calls

@pytest.mark.parametrize(
    "good,bad,prefix",
    [
        pytest.param({"softcap": 1}, {"softcap": True}, "softcap:", id="softcap-true-after-1"),
        pytest.param({"scale": 1}, {"scale": True}, "scale:", id="scale-true-after-1"),
        pytest.param({"window": (1, 0)}, {"window": (True, 0)}, "window:", id="window-true-after-1"),
        pytest.param({"causal": False}, {"causal": 0}, "causal:", id="causal-0-after-false"),
        pytest.param({"return_lse": True}, {"return_lse": 1}, "return_lse:", id="return-lse-1-after-true"),
    ],
)
def test_a_checked_call_does_not_let_an_equal_bad_value_through(device, good, bad, prefix):
    """``True == 1`` in Python: a value equal to one already checked is still refused for its type."""
    q, k, v = qkv(device)
    tilegen.attention(q, k, v, **good)
    with pytest.raises((TypeError, ValueError), match="^" + prefix):
        tilegen.attention(q, k, v, **bad)


# ------------------------------------------------------------------------------ ragged and paged
#
# What the host knows without reading the device: every inconsistency of offsets, max lengths
# and page tables with the tensors' sizes is one error naming the argument. (Wrong values only
# the device holds are TILEGEN_DEBUG=1's, and otherwise clamped by the kernels: test_varlen.py,
# test_decode.py, test_kv_append.py.)

def _offsets(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _ragged(device):
    q = torch.randn(10, 4, 32, device=device)
    k = torch.randn(12, 2, 32, device=device)
    return dict(q=q, k=k, v=k.clone(), cu_seqlens_q=_offsets([4, 6], device), cu_seqlens_k=_offsets([5, 7], device),
                max_seqlen_q=6, max_seqlen_k=7)


def _strided(cu):
    wide = torch.zeros(2 * cu.numel(), dtype=cu.dtype, device=cu.device)
    wide[::2] = cu
    return wide[::2]


@pytest.mark.parametrize(
    "change, exc, prefix",
    [
        pytest.param({"max_seqlen_q": 4}, ValueError,
                     "max_seqlen_q: 2 sequences of at most 4 tokens cannot hold q's 10 rows; expected at least 5",
                     id="max-q-below-the-rows"),
        pytest.param({"max_seqlen_k": 5}, ValueError,
                     "max_seqlen_k: 2 sequences of at most 5 tokens cannot hold k's 12 rows; expected at least 6",
                     id="max-k-below-the-rows"),
        pytest.param({"cu_seqlens_q": "empty-batch", "cu_seqlens_k": "empty-batch"}, ValueError,
                     "cu_seqlens_q: no sequence, but q has 10 rows", id="no-sequence-for-the-rows"),
        pytest.param({"cu_seqlens_q": "strided"}, ValueError, "cu_seqlens_q: expected a contiguous tensor",
                     id="strided-offsets"),
        pytest.param({"cu_seqlens_k": "expanded"}, ValueError, "cu_seqlens_k: expected a contiguous tensor",
                     id="expanded-offsets"),
        pytest.param({"cu_seqlens_k": "int64"}, ValueError, "cu_seqlens_k: expected a 1-d int32 tensor",
                     id="offsets-dtype"),
        pytest.param({"cu_seqlens_q": "meta"}, ValueError, "cu_seqlens_q: on meta", id="offsets-device"),
        pytest.param({"cu_seqlens_k": "longer"}, ValueError, "cu_seqlens_k: 4 entries, cu_seqlens_q has 3",
                     id="offsets-disagree-on-the-batch"),
    ],
)
def test_ragged_offsets_that_contradict_the_tensors(device, change, exc, prefix):
    args = _ragged(device)
    for name, what in change.items():
        cu = args[name]
        args[name] = {"empty-batch": cu[:1], "strided": _strided(cu), "expanded": cu[:1].expand(3),
                      "int64": cu.long(), "meta": cu.to("meta"),
                      "longer": torch.cat([cu, cu[-1:]])}.get(what, what) if isinstance(what, str) else what
    for _ in range(2):  # the second call, shaped like a checked one, is refused too
        with raises(exc, prefix):
            tilegen.varlen_attention(**args)


def test_a_strided_offsets_tensor_after_a_checked_contiguous_one(device):
    args = _ragged(device)
    tilegen.varlen_attention(**args)
    args["cu_seqlens_q"] = _strided(args["cu_seqlens_q"])
    with raises(ValueError, "cu_seqlens_q: expected a contiguous tensor"):
        tilegen.varlen_attention(**args)


def _cache(device, *, pages=4, indptr=(0, 1, 2), indices=(0, 3), last=(8, 1), heads=2, dim=32):
    k_pages = torch.randn(pages, 8, heads, dim, device=device)
    return k_pages, k_pages.clone(), *(torch.tensor(x, dtype=torch.int32, device=device)
                                       for x in (indptr, indices, last))


def test_paged_run_refuses_more_rows_than_the_planned_sequences_hold(device):
    cache = tilegen.PagedKVCache(*_cache(device))
    attn = tilegen.PagedAttention()
    attn.plan(_offsets([2, 1], device), cache, heads_q=4, max_seqlen_q=2, max_seqlen_k=8)
    with raises(ValueError, "q: 2 sequences of at most 2 tokens cannot hold q's 5 rows; expected at most 4 rows, "
                            "as planned"):
        attn.run(torch.randn(5, 4, 32, device=device), cache)


@pytest.mark.parametrize(
    "which, make, prefix",
    [
        pytest.param("indices", lambda t: t[:1].expand(2), "indices: expected a contiguous tensor", id="expanded"),
        pytest.param("indptr", _strided, "indptr: expected a contiguous tensor", id="strided"),
        pytest.param("last_page_len", lambda t: t[:1], "last_page_len: expected 2 entries", id="short"),
        pytest.param("indptr", lambda t: t[:0], "indptr: expected batch + 1 entries", id="empty"),
        pytest.param("indices", lambda t: t.long(), "indices: expected a 1-d int32 tensor", id="dtype"),
        pytest.param("indices", lambda t: t.to("meta"), "indices: on meta", id="device"),
    ],
)
def test_page_tables_that_contradict_the_cache(device, which, make, prefix):
    parts = dict(zip(("k_pages", "v_pages", "indptr", "indices", "last_page_len"), _cache(device)))
    parts[which] = make(parts[which])
    with raises(ValueError, prefix):
        tilegen.PagedKVCache(**parts)


def test_a_page_table_for_a_cache_of_no_page(device):
    with raises(ValueError, "k_pages: no page, but indices has 2 entries"):
        tilegen.PagedKVCache(*_cache(device, pages=0))


def test_a_page_table_past_the_kernels_int32_positions(device):
    # On the meta device: the 2**28 entries are never allocated.
    k_pages, v_pages, indptr, _, last = _cache(device)
    indices = torch.zeros(1 << 28, dtype=torch.int32, device="meta")
    assert indices.numel() * 8 > 2**31 - 1
    with raises(ValueError, "indices: 268435456 pages of 8 tokens exceed"):
        tilegen.PagedKVCache(k_pages.to("meta"), v_pages.to("meta"), indptr.to("meta"), indices, last.to("meta"))


def test_append_refuses_strided_offsets(device):
    cache = tilegen.PagedKVCache(*_cache(device))
    k = torch.randn(3, 2, 32, device=device)
    cu = _offsets([2, 1], device)
    tilegen.append_kv(cache, k, k.clone(), cu)
    with raises(ValueError, "cu_seqlens: expected a contiguous tensor"):
        tilegen.append_kv(cache, k, k.clone(), _strided(cu))


# ------------------------------------------------------------------------------ every entry point
#
# The other entry points' bad arguments, and more of attention's; each refused before any kernel runs.

def _plan(op, cache, **options):
    planner = op()
    offsets = (_offsets([1] * cache.batch, cache.k_pages.device),) if op is tilegen.PagedAttention else ()
    planner.plan(*offsets, cache, **{"heads_q": 4, **options})
    return planner


def _ffn(device, d_model, d_ffn):
    x = torch.randn(2, d_model, device=device)
    return dict(x=x, w_norm=torch.ones(d_model, device=device), w_up=torch.randn(d_ffn, d_model, device=device),
                w_down=torch.randn(d_model, d_ffn, device=device))


def _layer_config(**changes):
    return tilegen.LayerConfig(**{"d_model": 32, "heads_q": 2, "heads_kv": 1, "head_dim": 16, "d_ffn": 64, **changes})


def _ragged_with(device, **changes):
    args = {**_ragged(device), **changes}
    return tilegen.varlen_attention(**args)


def _no_tokens(batch, device):
    """Offsets of ``batch`` sequences of no token."""
    return torch.zeros(batch + 1, dtype=torch.int32, device=device)


PAGED_OPS = [tilegen.PagedDecode, tilegen.PagedAttention]

ENTRY_POINT_CASES = [
    pytest.param(lambda d: tilegen.attention(*qkv(d, hq=0)), ValueError,
                 "q: no query head; expected a positive multiple of k's 2 KV heads", id="attention-no-query-head"),
    pytest.param(lambda d: tilegen.attention(*qkv(d), return_lse="no"), TypeError,
                 "return_lse: expected a bool, got 'no'", id="attention-return-lse-str"),
    pytest.param(lambda d: tilegen.attention(*(t.requires_grad_() for t in qkv(d)), return_lse="no"), TypeError,
                 "return_lse: expected a bool, got 'no'", id="attention-training-return-lse-str"),
    pytest.param(lambda d: tilegen.attention(*qkv(d), out=torch.empty(1, 2, 8, 64, device=d, dtype=torch.float16,
                                                                       requires_grad=True)),
                 NotImplementedError, "tilegen.attention: out requires grad, but a result written into `out` cannot",
                 id="attention-out-requires-grad"),
    pytest.param(lambda d: tilegen.explain(*qkv(d), backward="yes"), TypeError, "backward: expected a bool",
                 id="explain-backward-str"),
    *(pytest.param(lambda d, value=value: tilegen.spec_from_json(value), tilegen.SpecError,
                   "spec: expected JSON text or a dict", id=f"spec-from-{type(value).__name__}")
      for value in (None, [])),
    pytest.param(lambda d: _ragged_with(d, q=torch.randn(10, 0, 32, device=d)), ValueError,
                 "q: no query head", id="varlen-no-query-head"),
    pytest.param(lambda d: tilegen.attention(*(t[:, :0] for t in qkv(d))), ValueError,
                 "k: no KV head (shape (1, 0, 8, 64)); expected at least one", id="attention-no-head-at-all"),
    pytest.param(lambda d: _ragged_with(d, q=torch.randn(10, 0, 32, device=d), k=torch.randn(12, 0, 32, device=d),
                                        v=torch.randn(12, 0, 32, device=d)),
                 ValueError, "k: no KV head (shape (12, 0, 32)); expected at least one", id="varlen-no-head-at-all"),
    pytest.param(lambda d: _ragged_with(d, q=torch.ones(10, 4, 32, device=d, dtype=torch.int32)), TypeError,
                 "q: expected dtype float16, bfloat16 or float32, got torch.int32", id="varlen-int-q"),
    # q, k and v of one unsupported dtype, so no mismatch is named first, through each of the op's paths.
    *(pytest.param(lambda d, grad=grad, mods=mods: _ragged_with(
        d, **{n: torch.randn(*shape, device=d, dtype=torch.float64, requires_grad=grad)
              for n, shape in (("q", (10, 4, 32)), ("k", (12, 2, 32)), ("v", (12, 2, 32)))},
        **({"score_mod": lambda score, b, h, q_idx, kv_idx: score} if mods else {})),
        TypeError, "q: expected dtype float16, bfloat16 or float32, got torch.float64", id=f"varlen-float64-{path}")
      for path, grad, mods in (("qkv", False, False), ("training", True, False), ("mods", False, True))),
    pytest.param(lambda d: _ragged_with(d, q=torch.randn(10, 4, 0, device=d), k=torch.randn(12, 2, 0, device=d),
                                        v=torch.randn(12, 2, 0, device=d)),
                 ValueError, "q: head_dim: expected", id="varlen-head-dim-0"),
    pytest.param(lambda d: _ragged_with(d, return_lse=1), TypeError, "return_lse: expected a bool",
                 id="varlen-return-lse-int"),
    pytest.param(lambda d: _ragged_with(d, q=torch.randn(10, 4, 32, device=d, requires_grad=True), return_lse=1),
                 TypeError, "return_lse: expected a bool", id="varlen-training-return-lse-int"),
    pytest.param(lambda d: _ragged_with(d, out=torch.empty(10, 4, 32, device=d, requires_grad=True)),
                 NotImplementedError, "tilegen.varlen_attention: out requires grad", id="varlen-out-requires-grad"),
    pytest.param(lambda d: _ragged_with(d, q=torch.zeros(0, 4, 32, device=d), k=torch.zeros(0, 2, 32, device=d),
                                        v=torch.zeros(0, 2, 32, device=d), cu_seqlens_q=_no_tokens(65536, d),
                                        cu_seqlens_k=_no_tokens(65536, d)),
                 ValueError, "cu_seqlens_q: 65536 sequences exceed the 65535 one launch takes", id="varlen-65536-seqs"),
    pytest.param(lambda d: _ragged_with(d, q=torch.zeros(0, 4, 32, device=d, requires_grad=True),
                                        k=torch.zeros(0, 2, 32, device=d), v=torch.zeros(0, 2, 32, device=d),
                                        cu_seqlens_q=_no_tokens(16384, d), cu_seqlens_k=_no_tokens(16384, d)),
                 ValueError, "cu_seqlens_q: 65536 (sequence, head) pairs of the backward exceed the 65535",
                 id="varlen-training-65536-sequence-heads"),
    *(pytest.param(lambda d, op=op: _plan(op, tilegen.PagedKVCache(
        torch.zeros(1, 8, 2, 32, device=d), torch.zeros(1, 8, 2, 32, device=d), _no_tokens(65536, d),
        torch.zeros(0, dtype=torch.int32, device=d), torch.zeros(65536, dtype=torch.int32, device=d))),
        ValueError, "cache: 65536 sequences exceed the 65535 one launch takes", id=f"{op.__name__}-65536-seqs")
      for op in PAGED_OPS),
    *(pytest.param(lambda d, op=op: _plan(op, tilegen.PagedKVCache(*_cache(d, dim=0))), ValueError,
                   "cache: head_dim: expected", id=f"{op.__name__}-head-dim-0") for op in PAGED_OPS),
    *(pytest.param(lambda d, op=op: _plan(op, tilegen.PagedKVCache(*_cache(d, heads=0))), ValueError,
                   "cache: no KV head", id=f"{op.__name__}-no-kv-head") for op in PAGED_OPS),
    *(pytest.param(lambda d, op=op: _plan(op, tilegen.PagedKVCache(*_cache(d)), return_lse=None), TypeError,
                   "return_lse: expected a bool", id=f"{op.__name__}-return-lse-none") for op in PAGED_OPS),
    pytest.param(lambda d: _plan(tilegen.PagedAttention, tilegen.PagedKVCache(*_cache(d)), head_dim="32"),
                 ValueError, "head_dim: '32' differs from the cache's 32", id="paged-head-dim-a-str"),
    pytest.param(lambda d: tilegen.CascadeAttention().plan(
        (c := tilegen.PagedKVCache(*_cache(d))), tilegen.cascade_levels(c), heads_q=4, return_lse=0),
        TypeError, "return_lse: expected a bool", id="cascade-return-lse-0"),
    pytest.param(lambda d: tilegen.cascade_levels(tilegen.PagedKVCache(*_cache(d)), causal=1), TypeError,
                 "causal: expected a bool", id="cascade-levels-causal-int"),
    pytest.param(lambda d: tilegen.cascade_levels(tilegen.PagedKVCache(*_cache(d, indptr=(0, 1, 3)))), ValueError,
                 "indptr: ends at 3, past the 2 entries of indices", id="cascade-levels-of-a-bad-page-table"),
    pytest.param(lambda d: tilegen.PagedKVCache.from_block_table(
        torch.zeros(4, 8, 32, device=d), torch.zeros(4, 8, 32, device=d), torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32)),
        ValueError, "k_pages: expected a [num_pages, page_size, kv_heads, head_dim] tensor", id="block-table-3d-pages"),
    pytest.param(lambda d: tilegen.PagedKVCache.from_block_table(
        torch.zeros(2, 8, 2, 32, device=d), torch.zeros(2, 8, 2, 32, device=d),
        torch.tensor([[0, 1], [2, 3]], device=d), torch.tensor([9, 3], device=d)),
        ValueError, "block_table: a page the sequences use lies outside the 2 pages of k_pages",
        id="block-table-page-outside-the-cache"),
    pytest.param(lambda d: tilegen.PagedKVCache.empty(-1, 8, 2, 32, torch.zeros(1, 1, dtype=torch.int32, device=d),
                                                      torch.ones(1, dtype=torch.int32, device=d)),
                 ValueError, "num_pages: expected an int >= 0, got -1", id="empty-cache-negative-pages"),
    pytest.param(lambda d: tilegen.PagedKVCache.empty(
        2, 8, 1, 16, torch.zeros(1, 1, dtype=torch.int32, device=d), torch.ones(1, dtype=torch.int32, device=d),
        dtype=torch.float8_e4m3fn, k_scale=10**400, v_scale=1.0),
        ValueError, "k_scale: expected finite positive scales", id="empty-cache-int-scale-past-the-largest-float"),
    pytest.param(lambda d: tilegen.PagedKVCache.empty(4, 8, 2, 32, [[0]], torch.ones(1, dtype=torch.int32)),
                 ValueError, "block_table: expected a [batch, max_pages] tensor, got list",
                 id="empty-cache-list-table"),
    pytest.param(lambda d: tilegen.blockwise_ffn(**_ffn(d, 0, 8)), ValueError, "x: d_model: expected",
                 id="ffn-d-model-0"),
    pytest.param(lambda d: tilegen.blockwise_ffn(**_ffn(d, 16, 0)), ValueError, "w_up: d_ffn: expected",
                 id="ffn-d-ffn-0"),
    pytest.param(lambda d: tilegen.blockwise_layer(torch.zeros(2, 32, device=d), {}, {"d_model": 32}), TypeError,
                 "config: expected a tilegen.LayerConfig, got dict", id="layer-config-a-dict"),
    pytest.param(lambda d: tilegen.BlockwiseLayer({"d_model": 32}), TypeError,
                 "config: expected a tilegen.LayerConfig, got dict", id="layer-module-config-a-dict"),
    pytest.param(lambda d: tilegen.blockwise_layer(
        torch.zeros(2, 32, device=d), {"self_attn.q_proj.weight": torch.zeros(32, 32), "self_attn.k_proj.weight":
                                       torch.zeros(16, 32), "mlp.up_proj.weight": torch.zeros(64, 32)}, heads_q=0),
        ValueError, "heads_q: expected a positive int, got 0", id="layer-heads-q-0"),
    *(pytest.param(lambda d, field=field, value=value: _layer_config(**{field: value}), ValueError,
                   f"{field}: expected a finite positive number", id=f"layer-config-{field}-{value}")
      for field in ("eps", "rope_theta") for value in (math.inf, True)),
    *(pytest.param(lambda d, field=field: _layer_config(**{field: 10**400}), ValueError,
                   f"{field}: expected a finite positive number", id=f"layer-config-{field}-int-past-the-largest-float")
      for field in ("eps", "rope_theta")),
]


@pytest.mark.parametrize("call, exc, prefix", ENTRY_POINT_CASES)
def test_every_entry_point_names_the_bad_argument(call, exc, prefix, device):
    with raises(exc, prefix):
        call(device)


@pytest.mark.parametrize("op", PAGED_OPS, ids=lambda op: op.__name__)
def test_debug_plans_refuse_a_max_seqlen_k_below_the_longest_sequence(op, device, monkeypatch):
    """Keys past max_seqlen_k may go unread (a wrong answer): TILEGEN_DEBUG=1 checks it against the page table."""
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    cache = tilegen.PagedKVCache(*_cache(device))  # sequences of 8 and 1 tokens
    with raises(ValueError, "max_seqlen_k: 7, but the cache holds a sequence of 8 tokens"):
        _plan(op, cache, max_seqlen_k=7)
    _plan(op, cache, max_seqlen_k=8)


@pytest.mark.parametrize("rows", [3, 5], ids=["fewer", "more"])
def test_debug_paged_run_refuses_q_rows_other_than_the_planned_offsets_end(rows, device, monkeypatch):
    """A q of more rows than cu_seqlens_q ends at leaves rows unwritten, one of fewer pairs rows with other
    sequences' keys: TILEGEN_DEBUG=1's run checks it, as varlen_attention's does."""
    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    cache = tilegen.PagedKVCache(*_cache(device))  # sequences of 8 and 1 tokens
    attn = tilegen.PagedAttention()
    attn.plan(_offsets([3, 1], device), cache, heads_q=4, max_seqlen_q=3, max_seqlen_k=8)
    out = torch.full((rows, 4, 32), math.nan, device=device)
    with raises(ValueError, f"q: {rows} tokens, but the planned cu_seqlens_q ends at 4"):
        attn.run(torch.randn(rows, 4, 32, device=device), cache, out=out)
    assert out.isnan().all()
    assert not attn.run(torch.randn(4, 4, 32, device=device), cache).isnan().any()


def test_debug_paged_plan_refused_keeps_the_previous_plan(device, monkeypatch):
    """A plan(...) that TILEGEN_DEBUG=1 refuses leaves the object as it was (as PagedDecode's does): run goes on
    with the plan made before, never with the refused one, whose max_seqlen_q would leave rows unwritten."""
    from tilegen.families.attention_fwd.reference import attention_reference

    monkeypatch.setenv("TILEGEN_DEBUG", "1")
    cache = tilegen.PagedKVCache(*_cache(device))  # sequences of 8 and 1 tokens
    attn = tilegen.PagedAttention()
    attn.plan(_offsets([6, 1], device), cache, heads_q=4, causal=True)
    with raises(ValueError, "cu_seqlens_q: a sequence of 6 tokens exceeds max_seqlen 2"):
        attn.plan(_offsets([6, 1], device), cache, heads_q=4, causal=True, max_seqlen_q=2)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(7, 4, 32, generator=gen).to(device)
    out = attn.run(q, cache, out=torch.full((7, 4, 32), math.nan, device=device))
    keys = cache.k_pages[0].transpose(0, 1)[None]  # sequence 0's 8 keys, [1, heads_kv, 8, dim]
    want, _ = attention_reference(q[:6].transpose(0, 1)[None], keys, cache.v_pages[0].transpose(0, 1)[None],
                                  causal=True)
    torch.testing.assert_close(out[:6].double(), want[0].transpose(0, 1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_ragged_calls_refuse_a_longest_sequence_past_int32(name, device):
    """The kernels count a sequence's positions in int32: a max length past 2**31 - 1 would wrap their tile
    offsets (negative rows read and written), so it is refused where it is given."""
    big = {name: 2 ** 31 + 5}
    cache = tilegen.PagedKVCache(*_cache(device))
    with raises(ValueError, f"{name}: expected a host int from 0 to 2147483647 (the longest sequence), got {2 ** 31 + 5}"):
        tilegen.PagedAttention().plan(_offsets([1, 1], device), cache, heads_q=4, **big)
    q = torch.randn(2, 4, 32, device=device)
    with raises(ValueError, f"{name}: expected a host int from 0 to 2147483647"):
        tilegen.varlen_attention(q, q[:, :2], q[:, :2], _offsets([1, 1], device), _offsets([1, 1], device),
                                 **{"max_seqlen_q": 1, "max_seqlen_k": 1, **big})


@pytest.mark.parametrize("op", [tilegen.PagedDecode, tilegen.CascadeAttention, tilegen.PagedAttention],
                         ids=lambda op: op.__name__)
def test_paged_plans_refuse_a_cache_on_a_device_the_kernels_cannot_reach(op):
    """A cache on a device tilegen's kernels do not run on (meta here; mps or xpu alike) is refused by name at
    plan, before anything reads its lengths back."""
    cache = tilegen.PagedKVCache(*_cache("meta"))
    planner = op()
    args = {tilegen.PagedDecode: (cache,), tilegen.PagedAttention: (_offsets([1, 1], "meta"), cache)}.get(op)
    if args is None:
        levels = [tilegen.CascadeLevel(*(torch.tensor(x, dtype=torch.int32, device="meta")
                                         for x in ((0, 1, 2), (0, 1, 2), (0, 3), (8, 1))))]
        args = (cache, levels)
    with raises(ValueError, "cache: device meta is not supported; expected cuda"):
        planner.plan(*args, heads_q=4)


def test_cascade_refuses_an_out_that_requires_grad(device):
    cache = tilegen.PagedKVCache(*_cache(device))
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=4)
    out = torch.full((2, 4, 32), math.nan, device=device).requires_grad_()
    with raises(NotImplementedError, "tilegen.CascadeAttention.run: out requires grad"):
        cascade.run(torch.zeros(2, 4, 32, device=device), cache, out=out)
    assert out.isnan().all()


def test_fp8_scales_that_require_grad_are_refused_by_every_paged_op(device):
    """An FP8 cache's scales held as parameters (a calibration that learns them) require grad; no paged op has a
    backward for them, so each refuses them by name rather than return an output without a grad_fn."""
    k_pages, v_pages, *table = _cache(device)
    k_scale, v_scale = (torch.full((2,), 0.5, device=device, requires_grad=True) for _ in range(2))
    cache = tilegen.PagedKVCache(k_pages.to(torch.float8_e4m3fn), v_pages.to(torch.float8_e4m3fn), *table,
                                 k_scale, v_scale)
    q = torch.randn(2, 4, 32, device=device, dtype=torch.bfloat16)
    decode, prefill, cascade = tilegen.PagedDecode(), tilegen.PagedAttention(), tilegen.CascadeAttention()
    decode.plan(cache, heads_q=4)
    prefill.plan(_offsets([1, 1], device), cache, heads_q=4)
    cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=4)
    for name, call in (("PagedDecode.run", lambda: decode.run(q, cache)),
                       ("PagedAttention.run", lambda: prefill.run(q, cache)),
                       ("CascadeAttention.run", lambda: cascade.run(q, cache)),
                       ("append_kv", lambda: tilegen.append_kv(cache, q[:, :2], q[:, :2], _offsets([1, 1], device)))):
        with raises(NotImplementedError, f"tilegen.{name}: cache.k_scale requires grad"):
            call()
    with torch.no_grad():
        decode.run(q, cache)


def test_an_empty_cache_of_an_unsupported_page_size_names_page_size(device):
    with raises(ValueError, "page_size: 3 is not supported; expected one of"):
        tilegen.PagedKVCache.empty(4, 3, 2, 32, torch.zeros(1, 1, dtype=torch.int32, device=device),
                                   torch.ones(1, dtype=torch.int32, device=device), device=device)


def test_a_prefill_run_over_a_cache_of_no_pages_is_refused(device):
    """A run may take another layer's cache of the planned layout; one of no pages at all would have the kernel
    clamp the planned page ids into an empty range and read before the pages, so it is refused by name. Its batch
    is the planned one, which run checks first."""
    cache = tilegen.PagedKVCache(*_cache(device))
    prefill = tilegen.PagedAttention()
    prefill.plan(_offsets([1, 1], device), cache, heads_q=4)
    empty = tilegen.PagedKVCache(*_cache(device, pages=0, indptr=(0, 0, 0), indices=(), last=(0, 0)))
    with raises(ValueError, "cache: has no pages, but the plan's page table lists some"):
        prefill.run(torch.randn(2, 4, 32, device=device), empty)


def test_cascade_over_an_empty_batch_gives_an_empty_output(device):
    """cascade_levels of a cache of no sequence gives a level of no node, which plans and runs to nothing."""
    cache = tilegen.PagedKVCache(*_cache(device, indptr=(0,), indices=(), last=()))
    cascade = tilegen.CascadeAttention()
    cascade.plan(cache, tilegen.cascade_levels(cache), heads_q=4, return_lse=True)
    out, lse = cascade.run(torch.zeros(0, 4, 32, device=device), cache)
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)


@pytest.mark.parametrize("n_q, batch", [(9, 3), (1, 5)], ids=["dense", "decode-route"])
def test_a_batch_past_the_launch_grid_runs_in_slices(n_q, batch, device, monkeypatch):
    """More (batch, head) pairs than a launch grid's second axis takes (65535 on CUDA; 4 here) run a slice of the
    batch at a time, to the same answer, the LSE and a given out included."""
    from tilegen.families.attention_fwd.reference import attention_reference
    from tilegen.ops import attention, tensors

    for module in (attention, tensors):
        monkeypatch.setattr(module, "MAX_GRID_YZ", 4)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(batch, 2, n, 16, generator=gen).to(device) for n in (n_q, 12, 12))
    out = torch.full_like(q, math.nan)
    result, lse = tilegen.attention(q, k, v, causal=True, return_lse=True, out=out)
    expected, expected_lse = attention_reference(q, k, v, causal=True)
    assert result is out
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)
    # The same slices writing transformers' layout (the batch leads there too).
    assert torch.equal(attention.attention_seq_major(q, k, v, causal=True), out.transpose(1, 2))
    with raises(ValueError, f"q: {batch * 2} (batch, head) pairs with mods exceed the 4 one launch takes"):
        tilegen.attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score + 1.0)
    with raises(ValueError, f"q: {batch * 2} (batch, head) pairs of the backward exceed the 4 one launch takes"):
        tilegen.attention(q.requires_grad_(), k, v)


def test_numpy_scalars_pass_as_python_numbers(device):
    """A scale, softcap or window side read from an array: the launch values are Python's, as for a Python number."""
    import numpy as np

    from tilegen.ops.attention import prepare_call

    q, k, v = qkv(device)
    expected = prepare_call(q, k, v, False, (2, 0), 3.0, 0.25, False)
    given = prepare_call(q, k, v, False, (np.int64(2), np.int32(0)), np.float32(3.0), np.float32(0.25), False)
    assert given == expected and all(type(a) is type(b) for a, b in zip(given, expected))
