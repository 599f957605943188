"""``tilegen.merge_states`` against its float64 reference, ``-inf`` rows included.

Outputs start as NaN (an unwritten element fails); LSE rows mix both finite, equal, far apart,
one side ``-inf`` and both ``-inf``; row counts are no multiple of any block.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import compile_for_sm90, kernel_globals_are_constexpr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import tilegen
from tilegen import dispatch
from tilegen.cli import app
from tilegen.codegen import module_for, source_for
from tilegen.db import TuningDB, tuned_rows
from tilegen.device import device_info
from tilegen.families import family_of, get, relative_error
from tilegen.families.merge_states import MergeStatesSpec
from tilegen.families.merge_states.problem import check_merge, random_lse
from tilegen.families.merge_states.reference import merge_reference
from tilegen.ir import SpecError
from tilegen.families import spec_from_json
from tilegen.key import TuningKey
from tilegen.ops.merge import explain_merge
from tilegen.tuning import Tuner

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DEVICE = device_info()


NEG_INF = -math.inf


def make_parts(shape, dtype, device, seed=0):
    """``(o_a, lse_a, o_b, lse_b)`` for ``o`` of ``shape``; LSE rows mix every case (``random_lse``)."""
    gen = torch.Generator().manual_seed(seed)
    o_a = torch.randn(shape, generator=gen).to(device, dtype)
    o_b = torch.randn(shape, generator=gen).to(device, dtype)
    lse_a, lse_b = random_lse(shape[:-1], gen)
    return o_a, lse_a.to(device), o_b, lse_b.to(device)


def assert_merged(o, lse, o_a, lse_a, o_b, lse_b):
    """Within the dtype's tolerance of the reference; -inf exactly where the reference has it; the rows
    where one side is -inf equal the other side bit for bit; rows where both are -inf are exactly 0."""
    ref, ref_lse = merge_reference(o_a, lse_a, o_b, lse_b)
    assert o.shape == o_a.shape and o.dtype == o_a.dtype and lse.shape == lse_a.shape and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    error, _ = relative_error(o, ref)
    assert error < TOL[o.dtype], f"relative error {error:.2e}"
    seen = torch.isfinite(ref_lse)
    if seen.any():
        assert (lse.double()[seen] - ref_lse[seen]).abs().max() < 1e-5
    only_a, only_b = torch.isneginf(lse_b) & ~torch.isneginf(lse_a), torch.isneginf(lse_a) & ~torch.isneginf(lse_b)
    assert torch.equal(o[only_a], o_a[only_a]) and torch.equal(lse[only_a], lse_a[only_a])
    assert torch.equal(o[only_b], o_b[only_b]) and torch.equal(lse[only_b], lse_b[only_b])
    neither = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    assert (o[neither] == 0).all()


SHAPES = [
    pytest.param((7, 5, 40), id="7x5xd40"),
    pytest.param((3, 2, 3, 64), id="3x2x3xd64-two-leading-dims"),
    pytest.param((6, 24), id="heads-only-d24"),
    pytest.param((1, 1, 1), id="one-row-d1"),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_matches_the_reference(shape, dtype, device):
    parts = make_parts(shape, DTYPES[dtype], device)
    o, lse = tilegen.merge_states(*parts)
    assert_merged(o, lse, *parts)


def test_the_cases_row_by_row(device):
    """Equal LSEs, far apart, one side -inf each way, both -inf: o and lse of each row by hand."""
    o_a = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0]], device=device)[:, None]
    o_b = torch.tensor([[3.0, 6.0], [3.0, 6.0], [3.0, 6.0], [3.0, 6.0], [3.0, 6.0]], device=device)[:, None]
    lse_a = torch.tensor([0.5, 100.0, 0.25, NEG_INF, NEG_INF], device=device)[:, None]
    lse_b = torch.tensor([0.5, 0.0, NEG_INF, 1.5, NEG_INF], device=device)[:, None]
    o, lse = tilegen.merge_states(o_a, lse_a, o_b, lse_b)
    expected = torch.tensor([[2.0, 4.0], [1.0, 2.0], [1.0, 2.0], [3.0, 6.0], [0.0, 0.0]], device=device)
    torch.testing.assert_close(o[:, 0], expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(lse[:, 0], torch.tensor([0.5 + math.log(2), 100.0, 0.25, 1.5, NEG_INF],
                                                       device=device), rtol=1e-6, atol=0)


def test_a_nan_or_inf_lse_gives_a_nan_row_and_leaves_the_others(device):
    """A NaN or +inf LSE on either side is no weight to merge by: its row is NaN, o and lse, as the reference's."""
    o_a, lse_a, o_b, lse_b = make_parts((6, 2, 8), torch.float32, device, seed=2)
    lse_a, lse_b = lse_a.clone(), lse_b.clone()
    lse_a[0, 0], lse_b[1, 1], lse_a[2, 0], lse_a[3, 1], lse_b[3, 1] = math.nan, math.nan, math.inf, math.inf, math.inf
    lse_a[4, 0], lse_b[4, 0] = math.nan, NEG_INF
    bad = torch.zeros(6, 2, dtype=torch.bool)
    bad[0, 0] = bad[1, 1] = bad[2, 0] = bad[3, 1] = bad[4, 0] = True
    o, lse = tilegen.merge_states(o_a, lse_a, o_b, lse_b)
    ref, ref_lse = merge_reference(o_a, lse_a, o_b, lse_b)
    assert torch.isnan(ref[bad]).all() and torch.isnan(ref_lse[bad]).all()
    assert torch.isnan(o[bad]).all() and torch.isnan(lse[bad]).all()
    good = ~bad.to(device)
    assert not torch.isnan(o[good]).any() and not torch.isnan(lse[good]).any()
    assert relative_error(o[good], ref[good])[0] < TOL[torch.float32]



def test_a_nan_in_a_side_that_saw_keys_reaches_its_row_however_little_it_weighs(device):
    """A finite LSE far below the other side's (200 and 1000 apart: exp underflows in fp32, and in float64
    for the second) still weighs its side: a NaN in its o makes the row NaN, where only an LSE of -inf weighs 0."""
    o_a, lse_a, o_b, lse_b = make_parts((4, 2, 8), torch.float32, device, seed=5)
    lse_a = torch.tensor([[0.0, -200.0], [-1000.0, NEG_INF], [-200.0, 0.0], [0.0, 0.0]], device=device)
    lse_b = torch.zeros(4, 2, device=device)
    o_a, o_b = o_a.clone(), o_b.clone()
    o_a[:3, :, 1] = math.nan
    o_b[3, 1, 2] = math.nan
    bad = torch.tensor([[True, True], [True, False], [True, True], [False, True]], device=device)
    ref, _ = merge_reference(o_a, lse_a, o_b, lse_b)
    o, lse = tilegen.merge_states(o_a, lse_a, o_b, lse_b)
    assert torch.equal(torch.isnan(ref).any(-1), bad)
    assert torch.equal(torch.isnan(o).any(-1), bad)
    assert relative_error(o[~bad], ref[~bad])[0] < TOL[torch.float32] and not torch.isnan(lse).any()


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # inf * 0, discarded
def test_a_side_that_saw_no_key_weighs_nothing_whatever_its_o_holds(device):
    parts = make_parts((9, 3, 16), torch.bfloat16, device, seed=4)
    o_a, lse_a, o_b, lse_b = parts
    o_a = torch.where(torch.isneginf(lse_a)[..., None], math.nan, o_a)  # garbage where a saw nothing
    o_b = torch.where(torch.isneginf(lse_b)[..., None], math.inf, o_b)
    assert torch.isneginf(lse_a).any() and torch.isneginf(lse_b).any()
    o, lse = tilegen.merge_states(o_a, lse_a, o_b, lse_b)
    assert_merged(o, lse, o_a, lse_a, o_b, lse_b)


def test_into_poisoned_outputs_any_strides_and_in_place(device):
    parts = make_parts((11, 4, 32), torch.float16, device, seed=2)
    # out and out_lse laid out [heads, tokens, ...] and transposed: they do not collapse to rows.
    out = torch.full((4, 11, 32), math.nan, dtype=torch.float16, device=device).transpose(0, 1)
    out_lse = torch.full((4, 11), math.nan, device=device).t()
    o, lse = tilegen.merge_states(*parts, out=out, out_lse=out_lse)
    assert o is out and lse is out_lse
    assert_merged(out, out_lse, *parts)

    # Strided inputs: a head-dim slice of a wider tensor, and LSEs kept [heads, tokens].
    o_a, lse_a, o_b, lse_b = parts
    wide = torch.randn(11, 4, 48, device=device).to(torch.float16)
    wide[..., 8:40] = o_a
    o, lse = tilegen.merge_states(wide[..., 8:40], lse_a.t().contiguous().t(), o_b, lse_b)
    assert_merged(o, lse, *parts)

    # In place: the result overwrites the first part (each row is read before it is written).
    expected = merge_reference(*parts)
    o_a, lse_a = o_a.clone(), lse_a.clone()
    tilegen.merge_states(o_a, lse_a, o_b, lse_b, out=o_a, out_lse=lse_a)
    assert relative_error(o_a, expected[0])[0] < 1e-2
    assert torch.equal(torch.isneginf(lse_a), torch.isneginf(expected[1]))


def test_no_rows_gives_empty_results(device):
    parts = make_parts((0, 4, 32), torch.float32, device)
    o, lse = tilegen.merge_states(*parts)
    assert o.shape == (0, 4, 32) and lse.shape == (0, 4)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lead=st.lists(st.integers(1, 6), min_size=0, max_size=2),
    heads=st.integers(1, 6),
    dim=st.integers(1, 80),
    dtype=st.sampled_from(["fp32", "bf16", "fp16"]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes(lead, heads, dim, dtype, seed, device):
    parts = make_parts((*lead, heads, dim), DTYPES[dtype], device, seed=seed)
    o, lse = tilegen.merge_states(*parts)
    assert_merged(o, lse, *parts)


# ---------------------------------------------------------------------------------- bad input

def _raises(exc, prefix):
    import re

    return pytest.raises(exc, match="^" + re.escape(prefix))


BAD = [
    ("o_a-list", lambda a, la, b, lb: ([1.0], la, b, lb), {}, TypeError, "o_a: expected a torch.Tensor"),
    ("lse_b-list", lambda a, la, b, lb: (a, la, b, lb.tolist()), {}, TypeError, "lse_b: expected a torch.Tensor"),
    ("o_a-rank1", lambda a, la, b, lb: (a[0, 0], la, b, lb), {}, ValueError, "o_a: expected [..., heads, head_dim]"),
    ("o_a-int", lambda a, la, b, lb: (a.int(), la, b.int(), lb), {}, TypeError, "o_a: expected dtype float16"),
    ("o_b-shape", lambda a, la, b, lb: (a, la, b[:, :2], lb), {}, ValueError, "o_b: shape (5, 2, 24) differs"),
    ("o_b-dtype", lambda a, la, b, lb: (a, la, b.half(), lb), {}, TypeError, "o_b: dtype torch.float16 differs"),
    ("lse_a-shape", lambda a, la, b, lb: (a, la[:, :2], b, lb), {}, ValueError, "lse_a: expected shape (5, 3)"),
    ("lse_b-dtype", lambda a, la, b, lb: (a, la, b, lb.double()), {}, TypeError, "lse_b: expected dtype float32"),
    ("lse_b-device", lambda a, la, b, lb: (a, la, b, lb.to("meta")), {}, ValueError, "lse_b: on meta while o_a"),
    ("out-shape", lambda *p: p, {"out": torch.empty(5, 3, 8)}, ValueError, "out: expected shape (5, 3, 24)"),
    ("out-dtype", lambda *p: p, {"out": torch.empty(5, 3, 24, dtype=torch.bfloat16)}, TypeError,
     "out: expected dtype torch.float32"),
    ("out_lse-dtype", lambda *p: p, {"out_lse": torch.empty(5, 3, dtype=torch.float16)}, TypeError,
     "out_lse: expected dtype torch.float32"),
    ("out_lse-shape", lambda *p: p, {"out_lse": torch.empty(5)}, ValueError, "out_lse: expected shape (5, 3)"),
    ("out-meta", lambda *p: p, {"out": torch.empty(5, 3, 24, device="meta")}, ValueError, "out: on meta"),
]


@pytest.mark.parametrize("make, kwargs, exc, prefix", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_input_names_the_argument(make, kwargs, exc, prefix, device):
    parts = make_parts((5, 3, 24), torch.float32, device)
    kwargs = {name: t.to(device) if t.device.type != "meta" else t for name, t in kwargs.items()}
    with _raises(exc, prefix):
        tilegen.merge_states(*make(*parts), **kwargs)


def test_an_out_overlapping_an_input_or_itself_is_refused(device):
    o_a, lse_a, o_b, lse_b = make_parts((5, 3, 24), torch.float32, device)
    want, want_lse = tilegen.merge_states(o_a, lse_a, o_b, lse_b)
    rows = torch.cat([o_a, o_a[:1]]).clone()
    with _raises(ValueError, "out: overlaps o_a in memory; pass o_a or o_b itself, or a tensor of its own"):
        tilegen.merge_states(rows[:5], lse_a, o_b, lse_b, out=rows[1:])
    lses = torch.cat([lse_b, lse_b[:1]]).clone()
    with _raises(ValueError, "out_lse: overlaps lse_b in memory; pass lse_a or lse_b itself"):
        tilegen.merge_states(o_a, lse_a, o_b, lses[:5], out_lse=lses[1:])
    both = torch.empty(5 * 3 * 24 + 5 * 3, device=device)
    with _raises(ValueError, "out: overlaps out_lse in memory"):
        tilegen.merge_states(o_a, lse_a, o_b, lse_b, out=both[:360].view(5, 3, 24), out_lse=both[350:365].view(5, 3))
    with _raises(ValueError, "out: overlaps itself"):
        tilegen.merge_states(o_a, lse_a, o_b, lse_b, out=torch.zeros(5, 1, 24, device=device).expand(5, 3, 24))
    # Into o_b and lse_a themselves: each program reads its rows before it writes them.
    a, la, b, lb = (t.clone() for t in (o_a, lse_a, o_b, lse_b))
    out, out_lse = tilegen.merge_states(a, la, b, lb, out=b, out_lse=la)
    assert out is b and out_lse is la and torch.equal(b, want) and torch.equal(la, want_lse)


def test_a_head_dim_past_the_kernel_s_bound_is_refused(device):
    parts = make_parts((2, 1, 513), torch.float32, device)
    with _raises(ValueError, "o_a: head_dim 513 is not supported; expected 1..512"):
        tilegen.merge_states(*parts)


# ---------------------------------------------------------------- spec, problem, dispatch, tune

SPEC = MergeStatesSpec(head_dim=40, dtype="fp32")


def test_spec_json_round_trips_and_bad_fields_name_themselves():
    assert spec_from_json(SPEC.to_json()) == SPEC and family_of(SPEC) is get("merge_states")
    assert SPEC.name == "merge_states_fp32_d40"
    with pytest.raises(SpecError, match="^head_dim"):
        MergeStatesSpec(head_dim=0)
    source = source_for(SPEC)
    assert "HEAD_DIM = tl.constexpr(40)" in source and "{{" not in source
    compile(source, "<generated>", "exec")
    kernel_globals_are_constexpr(source)


def test_the_problem_poisons_its_outputs_and_its_check_fails_until_written():
    family = get("merge_states")
    problem = family.problem(SPEC, 64, on_gpu=not DEVICE.is_interpreter)
    inputs = problem.inputs(seed=3)
    outputs = problem.outputs(inputs)
    assert torch.isnan(outputs[0]).all() and torch.isnan(outputs[1]).all()
    assert problem.check(inputs, outputs) == (math.inf, math.inf)
    problem.launch(module_for(SPEC), family.default_config(SPEC, DEVICE, 64), inputs, outputs)
    error, _ = problem.check(inputs, outputs)
    assert error < problem.tolerance
    outputs[1][0, 0] = NEG_INF if torch.isfinite(outputs[1][0, 0]) else 0.0  # an LSE that says the wrong case
    assert check_merge(*inputs, *outputs) == (math.inf, math.inf)


def test_dispatch_buckets_by_rows_and_uses_the_default_untuned(device):
    parts = make_parts((9, 5, 40), torch.float32, device)
    choice = explain_merge(*parts)
    assert (choice.source, choice.bucket) == ("default", 64)
    assert choice.config == get("merge_states").default_config(SPEC, DEVICE, 64)


@pytest.fixture
def tuned_db(tmp_path, monkeypatch):
    path = tmp_path / "tuning.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(path))
    with TuningDB(path) as db, Tuner(db, DEVICE, trials=3) as tuner:
        result = tuner.tune(SPEC, 64)
    assert result.best is not None and result.statuses["ok"] == 3
    return path, result


def test_a_tune_reaches_dispatch_the_op_and_db_list(tuned_db, device):
    path, result = tuned_db
    rows = tuned_rows(**TuningKey.current(SPEC, DEVICE).variant_fields())
    assert rows == {64: (result.best.config, str(path))}
    dispatch.reset()
    parts = make_parts((9, 5, 40), torch.float32, device)
    choice = explain_merge(*parts)
    assert (choice.config, choice.source, choice.tuned_bucket) == (result.best.config, str(path), 64)
    assert_merged(*tilegen.merge_states(*parts), *parts)
    listed = CliRunner().invoke(app, ["db", "--db", str(path), "list"])
    assert listed.exit_code == 0, listed.output
    assert SPEC.name in listed.stdout and str(result.best.config) in listed.stdout


def test_the_benchmark_s_smoke_run_checks_and_times_the_merge(tmp_path):
    from tilegen.bench import serving_kernels

    out = tmp_path / "bench.json"
    assert serving_kernels.main(["--smoke", "--parts", "merge", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["provider"] for r in rows} >= {"tilegen", "torch-eager"}
    assert all(r["correct"] and r["gbps"] > 0 and r["rel_err"] < 1e-2 for r in rows)


def test_merging_attention_over_two_key_ranges_is_attention_over_both(device):
    """Cascade attention: tilegen.attention's (out, lse) over keys [0, s) and [s, n), merged."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, n, 32, generator=gen).to(device) for n in (9, 40, 40))
    o_a, lse_a = tilegen.attention(q, k[:, :, :13], v[:, :, :13], return_lse=True)
    o_b, lse_b = tilegen.attention(q, k[:, :, 13:], v[:, :, 13:], return_lse=True)
    whole, whole_lse = tilegen.attention(q, k, v, return_lse=True)
    o, lse = tilegen.merge_states(o_a, lse_a, o_b, lse_b)  # [batch, heads, n_q] rows: any leading shape
    torch.testing.assert_close(o, whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)


def test_the_custom_op_passes_opcheck(device):
    torch.library.opcheck(torch.ops.tilegen.merge_states.default, make_parts((3, 5, 24), torch.float32, device))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_fullgraph(device, backend):
    parts = make_parts((7, 5, 40), torch.bfloat16, device, seed=9)
    out_lse = torch.full((7, 5), math.nan, device=device)

    def f(o_a, lse_a, o_b, lse_b):
        o, lse = tilegen.merge_states(o_a, lse_a, o_b, lse_b, out_lse=out_lse)
        return o * 2, lse

    torch._dynamo.reset()
    o2, lse = torch.compile(f, fullgraph=True, backend=backend)(*parts)
    assert lse is out_lse or torch.equal(lse, out_lse)
    assert_merged(o2 / 2, out_lse, *parts)


def test_the_kernel_compiles_for_an_h200(tmp_path):
    """What the interpreter runs, the sm90 compiler must accept (block shapes, types, constexprs)."""
    pytest.importorskip("triton.backends.nvidia")
    configs = [{"BLOCK_R": 1, "num_warps": 1}, {"BLOCK_R": 64, "num_warps": 8}]
    for spec in (MergeStatesSpec(head_dim=128), MergeStatesSpec(head_dim=40, dtype="fp32")):
        pointers = {**dict.fromkeys(("OA", "OB", "Out"), f"*{spec.dtype}"),
                    **dict.fromkeys(("LseA", "LseB", "OutLse"), "*fp32")}
        request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "configs": configs}
        compile_for_sm90(request, tmp_path, kernels=len(configs))
