"""Score and mask mods (tilegen.mods): every library mod against the float64 reference, which applies
the same function to the whole score matrix with broadcasting index tensors (FlexAttention's
reference), on odd shapes, GQA, fp32 and bf16, outputs poisoned with NaN; varlen; the spec's
identity (equivalent functions share it, a changed constant does not); every refusal.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings

import pytest
import torch
from helpers import compile_for_sm90, tuned_row_in_a_fresh_db

import tilegen
from tilegen.codegen import source_for
from tilegen.families import relative_error, spec_from_json
from tilegen.families.attention_fwd import AttentionSpec
from tilegen.families.attention_fwd.config import wgmma_unsupported
from tilegen.families.attention_fwd.lower import lower
from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.families.attention_varlen.reference import varlen_reference
from tilegen.mods import library
from tilegen.mods.trace import trace, traced

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
D = 16  # the interpreter's time grows with the head dim; mods do not touch it


def _inputs(batch, heads_q, heads_kv, n_q, n_k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, n, D, generator=gen).to(device=device, dtype=dtype)
               for h, n in ((heads_q, n_q), (heads_kv, n_k), (heads_kv, n_k)))
    return q, k, v


def _check(q, k, v, *, return_lse=True, **kwargs):
    out = torch.full((*q.shape[:3], v.shape[3]), math.nan, dtype=q.dtype, device=q.device)
    result = tilegen.attention(q, k, v, out=out, return_lse=return_lse, **kwargs)
    out, lse = result if return_lse else (result, None)
    ref_kwargs = {key: kwargs[key] for key in ("causal", "window", "scale", "score_mod", "mask_mod") if key in kwargs}
    ref, ref_lse = attention_reference(q, k, v, **ref_kwargs)
    assert not torch.isnan(out).any(), f"{torch.isnan(out).sum().item()} output elements never written"
    error, _ = relative_error(out, ref)
    assert error < TOL[q.dtype], f"relative error {error:.2e}"
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse must be -inf exactly on empty rows"
        seen = torch.isfinite(ref_lse)
        assert (lse.double()[seen] - ref_lse[seen]).abs().max() < 1e-4
        assert (out[~seen] == 0).all(), "rows that see no key give zeros"
    return out, lse


def _library_cases(device):
    g = torch.Generator().manual_seed(1)

    def on(t):  # made on the CPU from one generator, so every device draws the same values
        return t.to(device)

    slopes, slopes_gqa = on(torch.rand(4, generator=g)), on(torch.rand(4, generator=g))
    table, table_uni = on(torch.randn(4, 8, generator=g)), on(torch.randn(2, 8, generator=g))
    slopes2 = on(torch.rand(2, generator=g))
    docs = on(torch.tensor([0] * 5 + [1] * 20 + [2] * 8))
    docs_batched = on(torch.tensor([[0] * 9 + [1] * 8, [0] * 2 + [3] * 15]))
    prefix = on(torch.tensor([5, 0], dtype=torch.int32))
    docs2 = on(torch.tensor([0] * 10 + [1] * 23))
    # (id, score_mod, mask_mod, batch, heads_q, heads_kv, n_q, n_k, dtype, extra kwargs)
    return [
        ("alibi-fp32", library.alibi(slopes), None, 2, 4, 2, 17, 33, torch.float32, {}),
        ("alibi-bf16-causal", library.alibi(slopes_gqa), None, 1, 4, 1, 33, 17, torch.bfloat16, {"causal": True}),
        ("relative-bias-fp32", library.relative_bias(table, 8, 16), None, 1, 4, 2, 33, 33, torch.float32, {}),
        ("relative-bias-uni-bf16", library.relative_bias(table_uni, 8, 16, False), None, 2, 2, 2, 1, 17,
         torch.bfloat16, {}),
        # Distances of 5 and more share a bucket: whole blocks far from the diagonal read one bias, above it and below.
        ("relative-bias-far-blocks-fp32", library.relative_bias(table, 8, 5), None, 1, 4, 2, 100, 100, torch.float32,
         {}),
        ("relative-bias-far-blocks-causal-bf16", library.relative_bias(table_uni, 6, 4), None, 1, 2, 1, 70, 130,
         torch.bfloat16, {"causal": True}),
        ("document-fp32", None, library.document_mask(docs), 1, 2, 1, 33, 33, torch.float32, {}),
        ("document-batched-bf16", None, library.document_mask(docs_batched), 2, 2, 2, 17, 17, torch.bfloat16, {}),
        ("prefix-lm-fp32", None, library.prefix_lm(prefix), 2, 2, 1, 17, 33, torch.float32, {}),
        ("sliding-global-fp32", None, library.sliding_window(4, global_tokens=2), 1, 2, 2, 33, 17, torch.float32,
         {}),
        ("sliding-both-sides-bf16", None, library.sliding_window(3, causal=False), 1, 2, 2, 17, 17,
         torch.bfloat16, {}),
        ("softcap-fp32", library.softcap(2.0), None, 1, 2, 2, 17, 33, torch.float32, {"scale": 1.5}),
        ("softcap-bf16", library.softcap(2.0), None, 1, 2, 1, 1, 33, torch.bfloat16, {"scale": 1.5}),
        ("causal-mod-fp32", None, library.causal(), 1, 2, 2, 17, 33, torch.float32, {}),
        ("alibi-and-document-window-fp32", library.alibi(slopes2), library.document_mask(docs2), 1, 2, 1, 33, 33,
         torch.float32, {"window": (6, 2)}),
    ]


@pytest.mark.parametrize("name", [c[0] for c in _library_cases("cpu")])
def test_library_mods_match_the_reference(name, device):
    case = next(c for c in _library_cases(device) if c[0] == name)
    _, score_mod, mask_mod, batch, hq, hkv, n_q, n_k, dtype, kwargs = case
    q, k, v = _inputs(batch, hq, hkv, n_q, n_k, dtype, device)
    _check(q, k, v, score_mod=score_mod, mask_mod=mask_mod, **kwargs)


def _t5_bucket(relative_position: int, num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """T5's ``_relative_position_bucket`` for one offset, in Python floats, written apart from tilegen's."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if relative_position > 0 else 0
        relative_position = abs(relative_position)
    else:
        relative_position = -min(relative_position, 0)
    max_exact = num_buckets // 2
    if relative_position < max_exact:
        return bucket + relative_position
    far = max_exact + int(math.log(relative_position / max_exact) / math.log(max_distance / max_exact)
                          * (num_buckets - max_exact))
    return bucket + min(far, num_buckets - 1)


@pytest.mark.parametrize("num_buckets, max_distance, bidirectional", [(32, 128, True), (32, 128, False), (8, 16, True),
                                                                       (16, 50, True), (10, 40, False), (7, 9, True)])
def test_relative_bias_reads_t5_buckets_at_every_offset(num_buckets, max_distance, bidirectional):
    # The mod reads buckets tabulated for offsets within max_distance: every offset, far past it too, must land
    # where T5's formula puts it, and the mod must read the table there.
    offsets = torch.arange(-3 * max_distance, 3 * max_distance + 1, dtype=torch.int32)
    expected = torch.tensor([_t5_bucket(r, num_buckets, max_distance, bidirectional) for r in offsets.tolist()])
    assert torch.equal(library.relative_buckets(offsets, num_buckets, max_distance, bidirectional), expected)
    assert expected.min() == 0 and expected.max() == num_buckets - 1 - (num_buckets % 2 if bidirectional else 0)
    heads = 3
    table = torch.randn(heads, num_buckets, dtype=torch.float64)
    mod = library.relative_bias(table, num_buckets, max_distance, bidirectional)
    q_idx = torch.arange(0, 2 * max_distance, dtype=torch.int32)[:, None]
    kv_idx = torch.arange(0, 3 * max_distance, dtype=torch.int32)[None, :]
    h = torch.arange(heads, dtype=torch.int32)[:, None, None]
    score = torch.randn(heads, q_idx.shape[0], kv_idx.shape[1], dtype=torch.float64)
    buckets = expected[kv_idx - q_idx + 3 * max_distance]
    assert torch.equal(mod(score, 0, h, q_idx, kv_idx), score + table[h, buckets])


def test_relative_bias_refuses_bad_arguments_by_name():
    with pytest.raises(TypeError, match="relative_bias: max_distance: expected an int, got 128.0"):
        library.relative_bias(torch.randn(2, 32), max_distance=128.0)
    with pytest.raises(ValueError, match="relative_bias: needs num_buckets >= 4 and max_distance above"):
        library.relative_bias(torch.randn(2, 32), max_distance=-1)
    with pytest.raises(ValueError, match=r"relative_bias: table: expected a \[heads, num_buckets\] tensor of at least"):
        library.relative_bias(torch.randn(2, 8))
    with pytest.raises(ValueError, match="relative_buckets: needs num_buckets >= 2"):
        library.relative_buckets(torch.arange(3), 1, 16, False)


def test_integer_floor_semantics_and_fully_masked_rows(device):
    """// and % floor as torch does on negative differences; rows the mask empties give 0 and -inf."""

    def striped(b, h, q_idx, kv_idx):
        return (((q_idx - kv_idx) // 3) % 2 == 0) & (q_idx % 5 != 1)

    def bucketed(score, b, h, q_idx, kv_idx):
        return score * torch.where((kv_idx - q_idx) % 4 == 3, 0.5, 1.0) - (q_idx - kv_idx) // 7

    q, k, v = _inputs(1, 2, 2, 17, 33, torch.float32, device)
    _, lse = _check(q, k, v, score_mod=bucketed, mask_mod=striped)
    assert torch.isneginf(lse[0, :, 1]).all() and torch.isneginf(lse[0, :, 11]).all()


def test_integer_floor_semantics_at_the_type_minimum(device):
    """// and % floor as torch does on int32 and int64 minimums, whose magnitudes their types do not hold."""
    x32 = torch.tensor([-2**31, -2**31 + 1, 2**31 - 1, -7], dtype=torch.int32, device=device)
    x64 = torch.tensor([-2**63, -2**63 + 1, 2**63 - 1, -7], device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        d = q_idx % 5 + 2 - h * 9  # 2..6 in head 0, -7..-3 in head 1
        x, y = x32[kv_idx % 4], x64[kv_idx % 4]
        return score + ((x // d) % 7 + x % d - (y // d) % 5 + y % d).to(torch.float32) * 0.25

    q, k, v = _inputs(1, 2, 1, 17, 33, torch.float32, device)
    _check(q, k, v, score_mod=score_mod)


def test_float_floor_semantics_at_the_edges(device):
    """Float // and % as torch's: from the exact remainder (1.0 // 0.1 is 9.0, not floor(1.0 / 0.1)), over infinite
    divisors (-5.0 // inf is -1.0, -5.0 % inf is inf), of infinities, NaN and zero divisors, with zeros' signs."""
    inf = math.inf
    x = torch.tensor([1.0, -1.0, 0.3, 7.5, -5.0, 5.0, -0.0, 0.0, inf, 2.0, 1e-30], device=device)
    y = torch.tensor([0.1, -0.1, inf, -inf, -0.5, 3.0, -0.3, 0.0, 2.0, math.nan, -3.0], device=device)

    def finite(r):  # NaN, the infinities and the zeros' signs as distinct finite values
        signed_zero = torch.where(1 / r > 0, 0.5, -0.5)
        return torch.where(r != r, -3.0, torch.where(r == inf, 2.0, torch.where(r == -inf, -2.0, torch.where(
            r == 0, signed_zero, r * 0.1))))

    def score_mod(score, b, h, q_idx, kv_idx):
        a, d = x[kv_idx % 11], y[(q_idx + h) % 11]
        return score + finite(a // d) + finite(a % d) + finite(a // -0.1) * finite(a % 0.1)

    q, k, v = _inputs(1, 2, 1, 17, 33, torch.float32, device)
    _check(q, k, v, score_mod=score_mod)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen_applies_mods_per_sequence(dtype, device):
    lengths, k_lens = [17, 0, 5, 33], [17, 0, 8, 33]
    cu_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lengths), 4, D, generator=gen).to(device, dtype)
    k = torch.randn(sum(k_lens), 2, D, generator=gen).to(device, dtype)
    v = torch.randn(sum(k_lens), 2, D, generator=gen).to(device, dtype)
    score_mod = library.alibi(torch.rand(4, generator=gen).to(device))
    if dtype == torch.float32:
        mask_mod = library.prefix_lm(torch.tensor([3, 0, 6, 40], dtype=torch.int32, device=device))
    else:  # a document mask per sequence: [sequence, position]
        mask_mod = library.document_mask(torch.randint(0, 3, (4, 33), generator=gen).sort(1).values.to(device))
    out = torch.full_like(q, math.nan)
    _, lse = tilegen.varlen_attention(q, k, v, cu_q, cu_k, max(lengths), max(k_lens), out=out, return_lse=True,
                                      score_mod=score_mod, mask_mod=mask_mod)
    cu = cu_k.tolist()
    ref, ref_lse = varlen_reference(q, [k[a:b] for a, b in zip(cu, cu[1:])], [v[a:b] for a, b in zip(cu, cu[1:])],
                                    cu_q.cpu(), score_mod=score_mod, mask_mod=mask_mod)
    assert not torch.isnan(out).any()
    assert relative_error(out, ref)[0] < TOL[dtype]
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~seen)
    assert (lse.double()[seen] - ref_lse[seen]).abs().max() < 1e-4


def test_varlen_t5_bias_reads_one_value_in_blocks_far_from_the_diagonal(device):
    """Sequences longer than a block and T5 buckets that end at distance 3: blocks of every sequence lie wholly past
    the clamp on either side of the diagonal (each reads one bias), others straddle it, one sequence is empty."""
    lengths = [100, 0, 3, 70]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(lengths), heads, D, generator=gen).to(device) for heads in (4, 2, 2))
    score_mod = library.relative_bias(torch.randn(4, 8, generator=gen).to(device), 8, 3)
    out = torch.full_like(q, math.nan)
    _, lse = tilegen.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), out=out, return_lse=True,
                                      score_mod=score_mod)
    bounds = cu.tolist()
    ref, ref_lse = varlen_reference(q, [k[a:b] for a, b in zip(bounds, bounds[1:])],
                                    [v[a:b] for a, b in zip(bounds, bounds[1:])], cu.cpu(), score_mod=score_mod)
    assert not torch.isnan(out).any()
    assert relative_error(out, ref)[0] < TOL[torch.float32]
    seen = torch.isfinite(ref_lse)
    assert (lse.double()[seen] - ref_lse[seen]).abs().max() < 1e-4


def test_a_gather_through_a_clamp_of_both_positions_reads_one_value_where_the_clamp_holds_a_block():
    """The lowering finds the gathers whose index follows the positions only through an integer clamp of both to
    constant bounds, and reads them once per block where the block's every offset lies past a bound; a clamp of one
    position (a row or column load already), of the score, with bounds that cross or come from a tensor, or with float
    work between it and the gather, keeps the plain gather."""
    from tilegen.mods.lower import _saturating_gathers, lower_mod, parse

    table, wide, ends = torch.randn(4, 8), torch.randn(4, 80), torch.tensor([0, 2], dtype=torch.int32)
    t5 = trace(library.relative_bias(table, 8, 5), "score_mod").canonical
    assert sorted(_saturating_gathers(parse(t5)).items()) == [("v3", "v1"), ("v4", "v1")]
    lines = lower_mod(t5, "sm").lines
    assert "v1_below = tl.max(v0) <= -5" in lines and "v1_above = tl.min(v0) >= 5" in lines
    assert lines.count("if v1_below | v1_above:") == 2

    def one_side(score, b, h, q_idx, kv_idx):  # a bound on one side: blocks far below the diagonal
        return score + wide[h, torch.clamp(q_idx - kv_idx, max=3) + 70]

    lowered = lower_mod(trace(one_side, "score_mod").canonical, "sm").lines
    assert any(line.startswith("if ") and "_above" in line and "_below" not in line for line in lowered)

    def column(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(kv_idx, 0, 7)]

    def of_the_score(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp((score > 0).int() + kv_idx - q_idx, -3, 3) + 3]

    def crossed(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(kv_idx - q_idx, 3, -3) + 3]

    def bound_by_a_tensor(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(kv_idx - q_idx, ends[b], ends[b] + 5)]

    def through_a_float(score, b, h, q_idx, kv_idx):  # compiled, a block's division is approximate: gathered
        return score + table[h, (torch.clamp(kv_idx - q_idx, 5, 40).float() / 3.0 > 1.6666666).long()]

    for fn in (column, of_the_score, crossed, bound_by_a_tensor, through_a_float):
        text = trace(fn, "score_mod").canonical
        assert _saturating_gathers(parse(text)) == {}, fn.__name__
        assert not any(line.startswith("if ") for line in lower_mod(text, "sm").lines), fn.__name__


@pytest.mark.parametrize("fn", ["one_side", "crossed"])
def test_a_clamped_gather_matches_the_reference_on_blocks_past_its_bound(fn, device):
    """One bound only, and bounds that cross (torch's clamp then gives the upper one everywhere), on blocks far
    from the diagonal."""
    table = torch.randn(2, 80, generator=torch.Generator().manual_seed(6)).to(device)

    def one_side(score, b, h, q_idx, kv_idx):  # q_idx - kv_idx from -69 up: the index from 1 to 73
        return score + table[h, torch.clamp(q_idx - kv_idx, max=3) + 70]

    def crossed(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(kv_idx - q_idx, 3, -3) + 4]

    q, k, v = _inputs(1, 2, 1, 90, 70, torch.float32, device)
    _check(q, k, v, score_mod={"one_side": one_side, "crossed": crossed}[fn])


def _spec(score_mod=None, mask_mod=None):
    return AttentionSpec(head_dim=64, dtype="fp32", score_mod=score_mod and trace(score_mod, "score_mod").canonical,
                         mask_mod=mask_mod and trace(mask_mod, "mask_mod").canonical)


def test_equivalent_functions_share_a_spec_and_a_changed_constant_does_not():
    slopes, other = torch.rand(8), torch.rand(8)

    def alibi_def(score, b, h, q_idx, kv_idx):
        unused = q_idx * 3  # noqa: F841  (dead code does not count)
        return score + slopes[h] * (kv_idx - q_idx)

    spec = _spec(alibi_def)
    assert _spec(lambda s, bb, hh, qi, ki: s + other[hh] * (ki - qi)).hash == spec.hash
    assert _spec(library.alibi(slopes)).hash == spec.hash
    assert _spec(library.alibi(slopes.double().float().half())).hash != spec.hash  # another dtype
    assert _spec(library.softcap(20.0)).hash != _spec(library.softcap(30.0)).hash
    assert _spec(mask_mod=library.sliding_window(4)).hash != _spec(mask_mod=library.sliding_window(5)).hash
    assert _spec().hash == AttentionSpec(head_dim=64, dtype="fp32").hash  # no mods: the hash of before


def test_mod_specs_round_trip_through_json_and_render_the_mod_inline():
    spec = _spec(library.alibi(torch.rand(2)), library.document_mask(torch.zeros(4, dtype=torch.int64)))
    again = spec_from_json(spec.to_json())
    assert again == spec and again.hash == spec.hash and hash(again) == hash(spec)
    source = source_for(spec)
    assert "def _score_mod(" in source and "def _mask_mod(" in source and "mm_t0_s0" in source
    # The Gluon kernels take no mods: the spec lowers without them.
    assert wgmma_unsupported(spec) is not None and lower(spec)["wgmma"] is False


def test_traces_are_cached_per_function_until_a_captured_tensor_changes_shape():
    table = torch.rand(2, 4)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx % 4]

    first = traced(bias, "score_mod")
    assert traced(bias, "score_mod") is first
    table = torch.rand(2, 4, dtype=torch.float16)  # noqa: F841  (read by bias through its closure)
    second = traced(bias, "score_mod")
    assert second is not first and "float16" in second.canonical


def test_a_captured_tensor_whose_values_the_trace_read_is_traced_again_when_written(device):
    """A tensor the kernel is handed may also be read while the mod is traced (an element taken as a number, a
    tensor computed from it, which the kernel is handed instead): writing into it in place traces again, so that
    the number in the text and the computed tensor follow its new values."""
    docs = torch.tensor([0] * 10 + [1] * 15 + [2] * 8, device=device)
    slopes = torch.rand(2, device=device)

    def shifted_docs(b, h, q_idx, kv_idx):  # docs + 1 is computed by the trace, outside the kernel
        return (docs + 1)[q_idx] == docs[kv_idx] + 1

    def scaled_alibi(score, b, h, q_idx, kv_idx):  # the trace writes slopes[0]'s value into the text
        return score * slopes[0].item() + slopes[h] * (kv_idx - q_idx)

    def listed_alibi(score, b, h, q_idx, kv_idx):  # read by tolist(), which runs no torch operation on a CPU tensor
        return score * slopes.tolist()[0] + slopes[h] * (kv_idx - q_idx)

    def numpy_alibi(score, b, h, q_idx, kv_idx):  # likewise numpy()
        return score * float(slopes.cpu().numpy()[0]) + slopes[h] * (kv_idx - q_idx)

    q, k, v = _inputs(1, 2, 1, 33, 33, torch.float32, device)
    _check(q, k, v, score_mod=scaled_alibi, mask_mod=shifted_docs)
    docs[4:20] = 3
    _check(q, k, v, score_mod=scaled_alibi, mask_mod=shifted_docs)
    slopes[0] = 4.0
    _check(q, k, v, score_mod=scaled_alibi, mask_mod=shifted_docs)
    for score_mod in (listed_alibi, numpy_alibi):
        _check(q, k, v, score_mod=score_mod)
        slopes.mul_(2)
        _check(q, k, v, score_mod=score_mod)


@pytest.mark.parametrize("fn, kind, error, needle", [
    (lambda s, b, h, q, k: torch.sin(s), "score_mod", TypeError, "sin"),
    (lambda s, b, h, q, k: s ** 2, "score_mod", TypeError, "pow"),
    (lambda b, h, q, k: q >= k if q > 3 else q < k, "mask_mod", TypeError, "cannot be traced"),
    (lambda b, h, q, k: (q - k).to(torch.float32), "mask_mod", TypeError, "expected torch.bool"),
    (lambda s, b, h, q, k: s > 0, "score_mod", TypeError, "expected a floating score"),
    (lambda s, b, h, q, k: s.to(torch.float64), "score_mod", TypeError, "float64"),
    (lambda s, b, h, q, k: s + _TABLE[h], "score_mod", ValueError, "'_TABLE'.*one integer expression per dim"),
    (lambda s, b, h, q, k: s + _TABLE[h, q * 0.5], "score_mod", ValueError, "not an integer"),
    (lambda s, b, h, q, k: s * _TABLE, "score_mod", ValueError, "without indexing"),
    (lambda s, b, h, q, k: s * _SCALAR, "score_mod", ValueError, r"'_SCALAR' has no dimension.*read z\[0\]"),
    (lambda s, b, h, q, k: s * _SCALAR[()], "score_mod", ValueError, r"has no dimension.*read z\[0\]"),
    (lambda s, b: s, "score_mod", TypeError, "expected 5 arguments"),
    (lambda s, b, h, q, k: _TABLE[0, 0] * 2 * s, "score_mod", ValueError, "0-dim tensor made while the mod was traced"),
    (lambda s, b, h, q, k: s + _SPARSE[h, k], "score_mod", ValueError,
     "'_SPARSE' has layout torch.sparse_coo; captured tensors must be strided"),
    (lambda s, b, h, q, k: s + _BF16[h] * 0.1, "score_mod", ValueError,
     "mul of a bfloat16 value and 0.1: torch computes it in bfloat16, which does not hold 0.1 exactly"),
    (lambda b, h, q, k: _U8[k % 2] < 300, "mask_mod", ValueError,
     r"lt of a uint8 value and 300: torch computes it in uint8, which does not hold 300 \(torch wraps it around\)"),
], ids=["unsupported-function", "pow", "control-flow", "mask-returns-float", "score-returns-bool", "float64-cast",
        "partial-index", "float-index", "bare-tensor", "zero-dim-tensor", "zero-dim-tensor-indexed", "arity",
        "zero-dim-tensor-computed", "sparse-tensor", "bf16-and-an-inexact-number", "uint8-and-a-number-past-it"])
def test_unsupported_mods_are_refused_at_trace_time_by_name(fn, kind, error, needle):
    with pytest.raises(error, match=needle):
        trace(fn, kind)


_TABLE = torch.rand(2, 5)
_SCALAR = torch.tensor(0.5)
_SPARSE = torch.rand(2, 5).to_sparse()
_BF16 = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
_U8 = torch.tensor([1, 2], dtype=torch.uint8)


def test_bad_calls_are_refused_before_any_kernel_runs(device):
    q, k, v = _inputs(1, 4, 2, 5, 7, torch.float32, device)
    with pytest.raises(ValueError, match=r"'slopes' \(shape \(2,\)\), dim 0: h ranges over \[0, 3\]"):
        tilegen.attention(q, k, v, score_mod=library.alibi(torch.rand(2, device=device)))
    ids = torch.zeros(6, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="'doc_ids'.*dim 0: kv_idx ranges over"):
        tilegen.attention(q, k, v, mask_mod=library.document_mask(ids))
    meta_slopes = torch.rand(4, device="meta")
    with pytest.raises(ValueError, match="'slopes' is on meta"):
        tilegen.attention(q, k, v, score_mod=library.alibi(meta_slopes))
    with pytest.raises(ValueError, match="softcap"):
        tilegen.attention(q, k, v, softcap=5.0, score_mod=library.softcap(3.0))
    with pytest.raises(TypeError, match="out: an input requires grad"):
        tilegen.attention(q.requires_grad_(), k, v, mask_mod=library.causal(), out=torch.empty_like(q))


def test_every_supported_operation_matches_torch(device):
    """The documented subset in one pair of mods: casts, unary math, min/max/clamp, floor // and % with a
    negative divisor, scalar and block conditions mixed, a bool and an fp16 captured tensor."""
    keep = torch.tensor([True, False, True], device=device)
    table = torch.randn(3, 4, device=device).half()

    def score_mod(score, b, h, q_idx, kv_idx):
        x = torch.sqrt(torch.abs(score) + 1.0) - torch.exp(-torch.abs(score)) + torch.log(kv_idx.to(torch.float32) + 2)
        x = torch.minimum(x, torch.maximum(score, -score / 2)) + torch.clamp(score, -0.5, 0.25)
        x = torch.tanh(x).to(torch.bfloat16).to(torch.float32) * 3 + table[h % 3, (q_idx - kv_idx) // -5 % 4]
        return torch.where((h == 1) & (q_idx > kv_idx), -x, x + (q_idx % -3))

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[kv_idx % 3] | ~(h == 0) | (q_idx - kv_idx == 0)

    q, k, v = _inputs(1, 2, 1, 17, 33, torch.float32, device, seed=5)
    _check(q, k, v, score_mod=score_mod, mask_mod=mask_mod)


def test_clamp_keeps_nan_as_torch_does(device):
    """torch.clamp of NaN is NaN, whichever bounds it has; a mod that tests for NaN after it sees it."""

    def score_mod(score, b, h, q_idx, kv_idx):
        x = torch.clamp(torch.sqrt((kv_idx - q_idx).to(torch.float32)), -1.0, 2.0)
        y = torch.clamp(torch.log((q_idx - 4).to(torch.float32)), max=1.0)
        z = torch.clamp(torch.log((kv_idx - 9).to(torch.float32)), min=0.5)
        return score + torch.where(x != x, -2.0, x) + torch.where(y != y, -1.0, y) + torch.where(z != z, 0.75, z)

    q, k, v = _inputs(1, 2, 1, 17, 33, torch.float32, device, seed=5)
    _check(q, k, v, score_mod=score_mod)


def _promotion_cases(device):
    gen = torch.Generator().manual_seed(11)
    u8 = torch.randint(150, 256, (33,), generator=gen, dtype=torch.uint8).to(device)
    i8 = torch.randint(0, 128, (17,), generator=gen, dtype=torch.int8).to(device)
    # Powers of two, and integers 8 m + r (r < 4) in [1024, 2048): bfloat16 holds 8 m, and rounding to it is the
    # same to nearest or toward zero (Triton's interpreter truncates), so only torch's types decide the result.
    bf16 = torch.tensor([2.0**-8, 2.0**-7], dtype=torch.bfloat16, device=device)
    return {
        "bool-add": (None, lambda b, h, q_idx, kv_idx: (kv_idx % 3 == 0) + (q_idx < kv_idx)),
        "uint8-add-int8": (lambda score, b, h, q_idx, kv_idx: score + (u8[kv_idx] + i8[q_idx]) * 0.01, None),
        "uint8-floordiv-int32": (lambda score, b, h, q_idx, kv_idx: score + (u8[kv_idx] // (q_idx + 1)) * 0.01, None),
        "bf16-times-int32": (lambda score, b, h, q_idx, kv_idx: score + bf16[h] * (kv_idx * 8 + kv_idx % 4 + 1024),
                             None),
    }


@pytest.mark.parametrize("name", list(_promotion_cases("cpu")))
def test_mods_compute_in_the_types_the_trace_records(name, device):
    """Each value is computed in the dtype torch gives it (the canonical text's), not in Triton's promotion of the
    operands: bool + bool is a logical or (Triton's int1 + an exclusive or), uint8 + int8 is int16 (Triton keeps
    uint8, which wraps), uint8 // int32 floors in int32 (Triton refuses the mixed signedness), bfloat16 * int32
    rounds the integer and the product to bfloat16 (Triton computes it in float32). The mask's block table, which
    torch evaluates, agrees with the kernel."""
    score_mod, mask_mod = _promotion_cases(device)[name]
    q, k, v = _inputs(1, 2, 1, 17, 33, torch.float32, device, seed=12)
    _check(q, k, v, score_mod=score_mod, mask_mod=mask_mod)


def test_an_element_at_constant_indices_is_read_from_its_captured_tensor(device):
    """temperature[0] and table.T[2, 1] are evaluated by Python before the tracer sees them (0-dim views): the mod
    reads the captured tensor there, at every call, as it reads it at any other index."""
    temperature = torch.tensor([0.5], device=device)
    table = torch.randn(2, 3, device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * temperature[0] + table.T[2, 1] * (kv_idx - q_idx)

    q, k, v = _inputs(1, 2, 1, 17, 33, torch.float32, device, seed=13)
    _check(q, k, v, score_mod=score_mod)
    text = traced(score_mod, "score_mod").canonical
    assert "getitem(t0,0)" in text and "getitem(t1,1,2)" in text
    temperature[0] = 2.0
    _check(q, k, v, score_mod=score_mod)


def test_constant_mods(device):
    q, k, v = _inputs(1, 2, 2, 17, 17, torch.float32, device, seed=6)
    _check(q, k, v, score_mod=lambda s, b, h, qi, ki: (qi - ki).to(torch.float32) * 0.25,
           mask_mod=lambda b, h, qi, ki: h < 5)


def test_cast_methods_are_the_to_they_spell():
    slopes = torch.rand(2)
    with_to = trace(lambda s, b, h, q, k: s + slopes[h] * (k - q).to(torch.float32), "score_mod")
    with_float = trace(lambda s, b, h, q, k: s + slopes[h] * (k - q).float(), "score_mod")
    assert with_to.canonical == with_float.canonical


def test_emit_shows_the_mod_inlined(capsys):
    from tilegen.cli import main

    spec = _spec(library.alibi(torch.rand(2)), library.sliding_window(16))
    try:
        main(["emit", "--spec", spec.to_json()])
    except SystemExit as exit:
        assert exit.code in (0, None)
    out = capsys.readouterr().out
    assert f"Spec {spec.hash}" in out and "def _score_mod(score, b, h, q_idx, kv_idx, sm_t0, sm_t0_s0, sm_t0_n0)" in out
    assert "v1 = v0 <= 16" in out


def test_matches_torch_flex_attention(device):
    """Against torch's own FlexAttention (its eager path, in float64): the same mods give the same output and
    LSE, so the conventions (scaled logit in, softmax after, top-left indices, GQA's query head) agree."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = _inputs(2, 4, 2, 17, 33, torch.float32, device, seed=7)
    score_mod = library.alibi(torch.rand(4, device=device))
    mask_mod = library.prefix_lm(torch.tensor([5, 0], dtype=torch.int32, device=device))
    out, lse = tilegen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    block_mask = flex.create_block_mask(mask_mod, 2, 4, 17, 33, device=device)
    with _quiet():
        ref, ref_lse = flex.flex_attention(q.double(), k.double(), v.double(), score_mod=score_mod,
                                           block_mask=block_mask, enable_gqa=True, return_lse=True)
    assert (out.double() - ref).abs().max() < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-5


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        yield


@pytest.mark.parametrize("text", [
    "score_mod;v0:float32=add(score,__import__('os').getpid());return v0",
    "score_mod;v0:float32=add(score,1.0);return v0)\nimport os",
    "score_mod;t0=float32[1];v0:float32=add(score,t0);return v0",
    "score_mod;t0=float32[2];v0:float32=getitem(t0,h);return v0",
    "score_mod;v0:float32=to(score,os);return v0",
    "score_mod;v0:float32=add(score,q_idx);return exec",
    "mask_mod;v0:float32=add(score,1.0);return v0",
], ids=["call", "newline", "bare-tensor", "partial-index", "bad-dtype", "bad-result", "score-in-mask"])
def test_a_spec_read_from_json_cannot_put_code_into_the_module(text):
    """Specs come back from databases and exports: their mod texts are parsed strictly before any rendering."""
    field = "score_mod" if text.startswith("score") else "mask_mod"
    with pytest.raises(tilegen.SpecError, match=field):
        AttentionSpec(head_dim=64, **{field: text})


def test_on_an_h200_a_score_mod_spec_takes_the_gluon_kernels_and_a_mask_mod_spec_does_not(monkeypatch):
    """Where the plain spec's default and search space take the wgmma kernels, a score mod's do too at head dim 128
    (the ping-pong kernel, measured there); a mask mod's search space offers none (its block table is the Triton
    kernel's)."""
    import triton

    from tilegen.device import DeviceInfo
    from tilegen.families.attention_fwd import FAMILY

    monkeypatch.setattr(triton, "__version__", "3.6.0")  # the version the Gluon kernels are written for
    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_109_880_320, 232_448)
    plain = AttentionSpec(head_dim=128, mask="causal")
    modded = plain.replace(score_mod=trace(library.alibi(torch.rand(8)), "score_mod").canonical)
    masked = plain.replace(mask_mod=trace(library.document_mask(torch.zeros(8, dtype=torch.int64)),
                                          "mask_mod").canonical)
    assert any(c.wgmma for _, c in FAMILY.default_rule(plain, h200)) and FAMILY.search_space(plain, h200)["wgmma"] != [0]
    assert FAMILY.default_rule(modded, h200)[-1][1].wgmma == 3
    assert FAMILY.search_space(modded, h200)["wgmma"] == [0, 1, 2, 3]
    assert FAMILY.search_space(masked, h200)["wgmma"] == [0]


def test_a_gather_by_both_positions_takes_a_tile_that_fits_the_h200():
    """T5's relative bias reads ``table[h, bucket(kv_idx - q_idx)]``, a gather over the whole score tile: under
    Triton 3.6 its BM128-BN128-s3 kernel needed 288 KiB of shared memory (the H200 has 227), so its default is a
    smaller tile; ALiBi (``slopes[h]``) and a document mask (``doc[q_idx]``, ``doc[kv_idx]``) keep the usual rule."""
    from tilegen.device import DeviceInfo
    from tilegen.families.attention_fwd import FAMILY
    from tilegen.mods.lower import gathers_per_score

    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 150_109_880_320, 232_448)
    bias = trace(library.relative_bias(torch.randn(8, 32)), "score_mod").canonical
    alibi = trace(library.alibi(torch.rand(8)), "score_mod").canonical
    document = trace(library.document_mask(torch.zeros(64, dtype=torch.int32)), "mask_mod").canonical
    assert gathers_per_score(bias) and not gathers_per_score(alibi) and not gathers_per_score(document)
    rule = FAMILY.default_rule(AttentionSpec(head_dim=128, score_mod=bias), h200)
    assert (rule[-1][1].block_m, rule[-1][1].block_n, rule[-1][1].num_stages, rule[-1][1].tma) == (64, 32, 3, 1)
    a100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85_000_000_000, 166_912)
    assert FAMILY.default_rule(AttentionSpec(head_dim=128, score_mod=bias), a100)[-1][1].tma == 0
    assert [(c.block_m, c.block_n, c.num_stages) for _, c in FAMILY.default_rule(
        AttentionSpec(head_dim=128, score_mod=alibi), h200)][-1] != (64, 32, 3)


def _every_operation():
    keep, table, slopes, doc = torch.tensor([True, False, True]), torch.randn(3, 4).half(), torch.rand(8), torch.zeros(
        64, dtype=torch.int64)

    def score_mod(score, b, h, q_idx, kv_idx):
        x = torch.sqrt(torch.abs(score) + 1.0) - torch.exp(-score) + torch.log(kv_idx.to(torch.float32) + 2)
        x = torch.minimum(x, torch.maximum(score, -score / 2)) + torch.clamp(score, -0.5, 0.25)
        x = torch.tanh(x).to(torch.bfloat16).float() * 3 + table[h % 3, (q_idx - kv_idx) // -5 % 4]
        return torch.where((h == 1) & (q_idx > kv_idx), -x, x + (q_idx % -3)) + slopes[h] * (kv_idx - q_idx)

    def mask_mod(b, h, q_idx, kv_idx):
        return (keep[kv_idx % 3] | ~(h == 0)) & (doc[q_idx] == doc[kv_idx])

    pointers = {"sm_t0": "*fp16", "sm_t1": "*fp32", "mm_t0": "*i1", "mm_t1": "*i64"}
    return trace(score_mod, "score_mod").canonical, trace(mask_mod, "mask_mod").canonical, pointers


@pytest.mark.parametrize("family", ["dense"])  # the ragged kernel calls the same _attend_blocks; ~7 s more
def test_the_mod_kernels_compile_for_an_h200(family, tmp_path):
    """What the interpreter runs, the sm90 compiler must accept: every supported operation, bool, fp16, fp32 and
    int64 captured tensors, in the dense kernel (causal, GQA, LSE); ``family="varlen"`` compiles the ragged one."""
    import json

    pytest.importorskip("triton.backends.nvidia")
    from tilegen.families.attention_varlen import VarlenAttentionSpec

    score_mod, mask_mod, pointers = _every_operation()
    if family == "dense":
        spec = AttentionSpec(head_dim=64, q_per_kv=2, mask="causal", dtype="bf16", return_lse=True,
                             score_mod=score_mod, mask_mod=mask_mod)
        constexprs = {"BLOCK_M": 64, "BLOCK_N": 64, "TMA": False}
    else:
        spec = VarlenAttentionSpec(head_dim=64, mask="window", dtype="bf16", score_mod=score_mod, mask_mod=mask_mod)
        constexprs = {"BLOCK_M": 64, "BLOCK_N": 32}
        pointers = {**pointers, "CuQ": "*i32", "CuK": "*i32"}
    pointers = {**pointers, "RUN_COUNT": "*i32", "RUN_START": "*i32", "RUN_END": "*i32", "RUN_FULL": "*i8"}  # block table
    pointers = {**pointers, **dict.fromkeys(("Q", "K", "V", "Out"), "*bf16"), "Lse": "*fp32", "qk_scale": "fp32",
                "softcap_scale": "fp32"}
    request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "configs": [{**constexprs, "num_warps": 4}]}
    compile_for_sm90(request, tmp_path, kernels=1)


def test_t5_kernels_compile_for_an_h200(tmp_path):
    """Blocks past T5's max_distance take a branch of their own (one bias for the block, chosen by a block reduction;
    in the backward a learned table's gradient summed per block): the sm90 compiler must accept both kernels."""
    import json

    pytest.importorskip("triton.backends.nvidia")
    from tilegen.families.attention_bwd import AttentionBwdSpec

    bias = trace(library.relative_bias(torch.randn(4, 32)), "score_mod").canonical
    tensors = {"sm_t0": "*i32", "sm_t1": "*fp32", "qk_scale": "fp32", "softcap_scale": "fp32", "Lse": "*fp32"}
    forward = AttentionSpec(head_dim=64, q_per_kv=2, dtype="bf16", score_mod=bias)
    compile_for_sm90({"spec": json.loads(forward.to_json()),
                      "pointers": {**tensors, **dict.fromkeys(("Q", "K", "V", "Out"), "*bf16")},
                      "configs": [{"BLOCK_M": 64, "BLOCK_N": 32, "TMA": False, "num_warps": 4}]}, tmp_path, kernels=1)
    backward = AttentionBwdSpec(head_dim=64, q_per_kv=2, mask="causal", dtype="bf16", score_mod=bias)
    pointers = {**tensors, **dict.fromkeys(("Q", "K", "V", "dOut", "dK", "dV"), "*bf16"), "sm_t1_g": "*fp32",
                **dict.fromkeys(("DqAcc", "Delta", "Lse2"), "*fp32"), "CuQ": "*i32", "CuK": "*i32", "sm_scale": "fp32"}
    compile_for_sm90({"spec": json.loads(backward.to_json()), "pointers": pointers, "kernel": "_dkdv",
                      "configs": [{"BLOCK_M": 32, "BLOCK_N": 64, "ATOMIC_DQ": False, "TMA": False, "SM_T1_G": True,
                                   "num_warps": 4}]}, tmp_path, kernels=1)


@pytest.mark.parametrize("name,pointers", [
    ("bool-add", {}), ("uint8-add-int8", {"sm_t0": "*u8", "sm_t1": "*i8"}), ("uint8-floordiv-int32", {"sm_t0": "*u8"}),
    ("bf16-times-int32", {"sm_t0": "*bf16"}),
])
def test_the_type_casts_compile_for_an_h200(name, pointers, tmp_path):
    """The casts the lowering adds where torch's types and Triton's differ, through the sm90 compiler too (the
    interpreter accepts casts the compiler may not)."""
    import json

    pytest.importorskip("triton.backends.nvidia")
    score_mod, mask_mod = _promotion_cases("cpu")[name]
    texts = {key: trace(fn, key).canonical for key, fn in (("score_mod", score_mod), ("mask_mod", mask_mod))
             if fn is not None}
    spec = AttentionSpec(head_dim=64, mask="causal", dtype="bf16", **texts)
    pointers = {**pointers, **dict.fromkeys(("Q", "K", "V", "Out"), "*bf16"), "Lse": "*fp32", "qk_scale": "fp32",
                "softcap_scale": "fp32"}
    if mask_mod is not None:
        pointers = {**pointers, "RUN_COUNT": "*i32", "RUN_START": "*i32", "RUN_END": "*i32", "RUN_FULL": "*i8"}
    request = {"spec": json.loads(spec.to_json()), "pointers": pointers,
               "configs": [{"BLOCK_M": 64, "BLOCK_N": 64, "TMA": False, "num_warps": 4}]}
    compile_for_sm90(request, tmp_path, kernels=1)


def test_mod_specs_are_tuned_only_with_their_functions_named():
    from tilegen.families.attention_decode import DecodeProblem, DecodeSpec
    from tilegen.families.attention_fwd import Problem
    from tilegen.families.attention_varlen import VarlenAttentionSpec
    from tilegen.families.attention_varlen.problem import VarlenProblem

    mask_mod = trace(library.causal(), "mask_mod").canonical
    # A trial needs the function: tilegen tune --mask-mod names it (tests/test_mods_tune.py).
    with pytest.raises(NotImplementedError, match="tuned through tilegen tune --mask-mod pkg.module:function"):
        Problem.for_bucket(AttentionSpec(head_dim=64, mask_mod=mask_mod), 16, on_gpu=False)
    with pytest.raises(NotImplementedError, match="tuned through tilegen tune --mask-mod pkg.module:function"):
        VarlenProblem.for_bucket(VarlenAttentionSpec(head_dim=64, mask_mod=mask_mod), 16, on_gpu=False)
    with pytest.raises(NotImplementedError, match="tuned through tilegen tune --mask-mod pkg.module:function"):
        DecodeProblem.for_bucket(DecodeSpec(head_dim=64, page_size=16, mask_mod=mask_mod), 16, on_gpu=False)


# Block sparsity (tilegen.mods.blocks): the key blocks a mask mod empties are skipped, its whole blocks run
# without it. The shapes are odd so that the last query and key blocks are partial.
def _last_table():
    from tilegen.mods.blocks import _tables

    return next(reversed(_tables.values()))[1]


def _scale(device) -> int:
    """Sizes times this: a GPU's tiles (up to 64 x 128) must leave blocks to skip, the interpreter's are 32."""
    return 1 if device == "cpu" else 4


def _sparse_cases(device):
    x = _scale(device)
    docs = torch.tensor([0] * 20 * x + [1] * 37 * x + [2] * 18 * x, device=device)  # 75 keys and queries (x4)
    return [
        ("document", library.document_mask(docs), 75 * x, 75 * x, {}),
        # A band alone is a built-in.
        ("window-and-global", library.sliding_window(9 * x, global_tokens=3 * x), 75 * x, 75 * x, {}),
        # Reads b: a table per batch.
        ("prefix-lm", library.prefix_lm(torch.tensor([21 * x, 50 * x], device=device)), 75 * x, 75 * x, {}),
        ("causal-as-mod", library.causal(), 45 * x, 75 * x, {}),
        ("document-and-window", library.document_mask(docs), 75 * x, 75 * x, {"window": (30 * x, 0)}),
    ]


@pytest.mark.parametrize("name", [c[0] for c in _sparse_cases("cpu")])
def test_block_sparse_masks_match_the_reference_and_skip_blocks(name, device):
    _, mask_mod, n_q, n_k, kwargs = next(c for c in _sparse_cases(device) if c[0] == name)
    batch = 2
    q, k, v = _inputs(batch, 2, 1, n_q, n_k, torch.float32, device)
    _check(q, k, v, mask_mod=mask_mod, **kwargs)
    table = _last_table()
    q_blocks, k_blocks = -(-n_q // table.block_m), table.indices.shape[1]
    assert table.stride_h == 0, "a mod reading neither b nor h has one row per query block"
    assert table.count.shape[0] == (batch if table.stride_b else 1) * q_blocks
    assert table.count.sum() < table.count.shape[0] * k_blocks, "some key block must be skipped"
    # The listed blocks: in key order, each non-empty; the full ones wholly kept by the mod as torch runs it.
    qi, ki = torch.arange(n_q, device=device)[:, None], torch.arange(n_k, device=device)[None, :]
    for row, count in enumerate(table.count.tolist()):
        b, qb = divmod(row, q_blocks)
        keep = mask_mod(torch.tensor(b, device=device), torch.zeros((), dtype=torch.long, device=device), qi, ki)
        rows = keep[qb * table.block_m:(qb + 1) * table.block_m]
        blocks = [rows[:, kb * table.block_n:(kb + 1) * table.block_n] for kb in range(k_blocks)]
        listed = table.indices[row, :count].tolist()
        assert listed == [kb for kb in range(k_blocks) if blocks[kb].any()]
        assert table.full[row, :count].tolist() == [int(blocks[kb].all()) for kb in listed]
        # The runs the kernel walks: the same blocks, each run of one kind.
        runs = int(table.run_count[row])
        starts, ends = table.run_start[row, :runs].tolist(), table.run_end[row, :runs].tolist()
        assert [(kb, f) for s, e, f in zip(starts, ends, table.run_full[row, :runs].tolist()) for kb in range(s, e)] \
            == list(zip(listed, table.full[row, :count].tolist()))


def test_block_tables_per_head_emptied_rows_and_recomputed_when_a_tensor_changes(device):
    """A mod reading h gets a table per head; query blocks it empties give 0 and -inf; writing into a captured
    tensor (its version moves) recomputes the table, calling again with nothing changed reuses it."""
    x = _scale(device)
    starts = torch.tensor([40 * x, 0], device=device)

    def late_rows(b, h, q_idx, kv_idx):
        return (q_idx >= starts[h]) & (kv_idx <= q_idx)

    q, k, v = _inputs(1, 2, 2, 75 * x, 75 * x, torch.float32, device)
    _, lse = _check(q, k, v, mask_mod=late_rows)
    table = _last_table()
    assert table.stride_b == 0 and table.stride_h == table.count.shape[0] // 2
    assert table.count[0] == 0 and torch.isneginf(lse[0, 0, :40 * x]).all()
    tilegen.attention(q, k, v, mask_mod=late_rows)
    assert _last_table() is table
    table.run_count.zero_()  # the kernel walks the table: with no block listed every row is empty
    assert (tilegen.attention(q, k, v, mask_mod=late_rows) == 0).all()
    starts[0] = 70 * x
    _, lse = _check(q, k, v, mask_mod=late_rows)
    assert _last_table() is not table and torch.isneginf(lse[0, 0, :70 * x]).all()


def test_block_table_evaluates_what_the_kernel_runs(device):
    """The host's evaluation of the canonical text: floor // and %, out-of-range reads as 0, casts."""
    from tilegen.mods.blocks import evaluate_mask

    ids = torch.tensor([3, 1, 4, 1, 5], device=device)

    def mod(b, h, q_idx, kv_idx):
        wrapped = ids[(q_idx - kv_idx) // 2] > 1  # negative and too-large indices read 0
        return wrapped | (((q_idx - kv_idx) % 3 == 2) & (kv_idx.to(torch.float32) * 0.5 < 4.0))

    text = traced(mod, "mask_mod")
    qi, ki = torch.arange(20, device=device)[:, None], torch.arange(20, device=device)[None, :]
    z = torch.zeros((), dtype=torch.int32, device=device)
    got = evaluate_mask(text.canonical, text.tensors, z, z, qi.int(), ki.int())
    d = qi - ki
    index = torch.div(d, 2, rounding_mode="floor")
    inside = (index >= 0) & (index < 5)
    want = torch.where(inside, ids[index.clamp(0, 4)], 0) > 1
    want = want | ((torch.remainder(d, 3) == 2) & (ki * 0.5 < 4.0))
    assert torch.equal(got, want)


def test_block_tables_of_inference_tensors_are_built_at_every_call(device):
    """An inference tensor has no version counter: its table is never cached, so new values are always seen."""
    from tilegen.mods.blocks import _tables

    with torch.inference_mode():
        docs = torch.tensor([0] * 30 + [1] * 15, device=device)
        q, k, v = _inputs(1, 1, 1, 45, 45, torch.float32, device)
        kept = len(_tables)
        _check(q, k, v, mask_mod=library.document_mask(docs))
        docs[20:] = 2
        _check(q, k, v, mask_mod=library.document_mask(docs))
        assert len(_tables) == kept


@pytest.mark.parametrize("mask_mod, causal", [(library.sliding_window(7), False), (library.causal(), True)],
                         ids=["window", "causal-and-causal-mod"])
def test_varlen_block_table_over_the_longest_sequences_holds_for_every_one(mask_mod, causal, device):
    """One table over max_seqlen positions (the mod reads no b), for sequences shorter than it and of unequal
    query and key lengths: blocks skipped, the result the reference's."""
    lengths, k_lens = [70, 3, 41], [75, 9, 41]
    cu_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lengths), 2, D, generator=gen).to(device)
    k, v = (torch.randn(sum(k_lens), 1, D, generator=gen).to(device) for _ in range(2))
    out = torch.full_like(q, math.nan)
    _, lse = tilegen.varlen_attention(q, k, v, cu_q, cu_k, max(lengths), max(k_lens), out=out, return_lse=True,
                                      causal=causal, mask_mod=mask_mod)
    table = _last_table()
    assert table.stride_b == table.stride_h == 0
    assert table.count.sum() < table.count.numel() * table.indices.shape[1], "some key block must be skipped"
    cu = cu_k.tolist()
    ref, ref_lse = varlen_reference(q, [k[a:b] for a, b in zip(cu, cu[1:])], [v[a:b] for a, b in zip(cu, cu[1:])],
                                    cu_q.cpu(), causal=causal, mask_mod=mask_mod)
    assert not torch.isnan(out).any()
    assert relative_error(out, ref)[0] < TOL[torch.float32]
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~seen)
    assert (lse.double()[seen] - ref_lse[seen]).abs().max() < 1e-4


@pytest.mark.parametrize("n_q, n_k", [(5, 0), (0, 5)])
def test_a_mask_mod_over_no_keys_or_no_queries(n_q, n_k, device):
    """No key: zeros and an LSE of -inf, as without a mod (the block table has no key block); no query: nothing."""
    q, k, v = _inputs(1, 2, 2, n_q, n_k, torch.float32, device)
    out, lse = tilegen.attention(q, k, v, mask_mod=library.sliding_window(3), return_lse=True)
    assert out.shape == (1, 2, n_q, D) and (out == 0).all() and torch.isneginf(lse).all()


def test_explain_names_the_config_a_call_with_mods_runs(device, tmp_path, monkeypatch):
    """The mod spec's row where it has one, the built-in's for a mod that is a built-in option, and the backward's."""
    from tilegen.families import get
    from tilegen.families.attention_bwd import Config as BackwardConfig
    from tilegen.ops.attention import prepare_call
    from tilegen.ops.memo import with_mod_fields

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=gen).to(device) for _ in range(3))
    alibi = library.alibi(torch.rand(2, device=device))
    spec = with_mod_fields(prepare_call(q, k, v, False, None, None, None, False)[0],
                           traced(alibi, "score_mod").canonical, None)
    default, tuned = tuned_row_in_a_fresh_db(tmp_path, monkeypatch, get("attention_fwd"), spec, 40)
    choice = tilegen.explain(q, k, v, score_mod=alibi)
    assert choice.config == tuned and choice.source == str(tmp_path / "rows.sqlite")
    assert tilegen.explain(q, k, v).config == default
    assert tilegen.explain(q, k, v, mask_mod=library.causal()) == tilegen.explain(q, k, v, causal=True)
    assert isinstance(tilegen.explain(q, k, v, score_mod=alibi, backward=True).config, BackwardConfig)


def test_compiled_mods_on_an_older_torch_are_refused_by_name(device, monkeypatch):
    """Where Dynamo cannot guard a graph on the mod function (torch before 2.13), a compiled call with mods is refused
    naming the torch it needs, never a graph that serves another closure's constants. On torch 2.11 the check itself
    failed inside Dynamo (it traced packaging's Version), so users met an internal error instead. Run under every
    torch: a newer one is told it needs 99.0."""
    from tilegen.mods import compiled as mods_compiled

    if mods_compiled.compiles_mods():
        monkeypatch.setattr(mods_compiled, "MIN_TORCH", "99.0")
    needed = rf"score_mod/mask_mod under torch\.compile need torch {re.escape(mods_compiled.MIN_TORCH)} or later"
    q, k, v = _inputs(1, 2, 1, 12, 12, torch.float32, device)
    score_mod = library.alibi(torch.ones(2, device=device))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    rows = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    calls = {"tilegen.attention": (lambda q, k, v: tilegen.attention(q, k, v, score_mod=score_mod), (q, k, v)),
             "tilegen.varlen_attention": (lambda q, k, v: tilegen.varlen_attention(q, k, v, cu, cu, 7, 7,
                                                                                   score_mod=score_mod), rows)}
    for op, (call, inputs) in calls.items():
        torch._dynamo.reset()
        with pytest.raises(Exception) as caught:
            torch.compile(call, fullgraph=True, backend="eager")(*inputs)
        assert re.search(rf"{re.escape(op)}: {needed}", str(caught.value) + str(caught.value.__cause__)), op
