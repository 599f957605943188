"""``tilegen.apply_rope`` against its float64 reference.

Outputs start as NaN (an unwritten element fails); token counts, heads and head dims are no
multiple of any block (a half of 20 is padded to 32); positions reach 128k, so the tables hold
angles of every size.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import compile_for_sm90, kernel_globals_are_constexpr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegen
from tilegen import dispatch
from tilegen.codegen import module_for, source_for
from tilegen.db import TuningDB, tuned_rows
from tilegen.device import device_info
from tilegen.families import family_of, get, relative_error
from tilegen.families.rope import RopeSpec
from tilegen.families.rope.reference import rope_reference, rope_tables
from tilegen.ir import SpecError
from tilegen.families import spec_from_json
from tilegen.key import TuningKey
from tilegen.ops.rope import explain_rope
from tilegen.tuning import Tuner

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DEVICE = device_info()


def make(shape, dtype, device, seed=0, table_dtype=torch.float32):
    """``(x, cos, sin)`` for ``x`` of ``shape`` [..., heads, head_dim], random positions below 128k."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    positions = torch.randint(0, 1 << 17, shape[:-2], generator=gen)
    cos, sin = rope_tables(positions, shape[-1], theta=500000.0)
    return x, cos.to(device, table_dtype), sin.to(device, table_dtype)


def assert_rotated(out, x, cos, sin):
    ref = rope_reference(x, cos, sin)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert not torch.isnan(out).any()
    error, _ = relative_error(out, ref)
    assert error < TOL[x.dtype], f"relative error {error:.2e}"


SHAPES = [
    pytest.param((17, 3, 16), id="17x3xd16"),
    pytest.param((257, 1, 40), id="257x1xd40-padded-half"),
    pytest.param((2, 5, 4, 128), id="2x5x4xd128-two-leading-dims"),
    pytest.param((1, 1, 2), id="one-row-d2"),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_matches_the_reference(shape, dtype, device):
    x, cos, sin = make(shape, DTYPES[dtype], device)
    assert_rotated(tilegen.apply_rope(x, cos, sin), x, cos, sin)


def test_the_rotation_is_the_one_a_position_gives():
    """Position 0 leaves x as it is; a rotation by an angle and back by its negative is the identity
    (cos even, sin odd); the pairs are (i, i + head_dim / 2)."""
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    cos, sin = rope_tables(torch.zeros(4), 8)
    assert torch.equal(rope_reference(x, cos, sin), x)
    cos, sin = rope_tables(torch.tensor([3.0, 70.0, 1000.0, 99999.0]), 8)
    assert torch.allclose(rope_reference(rope_reference(x, cos, sin), cos, -sin), x, atol=1e-12)
    e = torch.zeros(1, 1, 8, dtype=torch.float64)
    e[..., 0] = 1.0
    c, s = torch.full((1, 8), 0.6, dtype=torch.float64), torch.full((1, 8), 0.8, dtype=torch.float64)
    assert rope_reference(e, c, s).flatten().tolist() == [0.6, 0, 0, 0, 0.8, 0, 0, 0]


def test_into_poisoned_outputs_any_strides_and_in_place(device):
    x, cos, sin = make((9, 5, 40), torch.bfloat16, device, seed=1)
    expected = tilegen.apply_rope(x, cos, sin)
    out = torch.full_like(x, math.nan)
    assert tilegen.apply_rope(x, cos, sin, out=out) is out and torch.equal(out, expected)
    # heads-major storage: strides that do not collapse to [tokens, heads, dim] go through a buffer
    out_t = torch.full((5, 9, 40), math.nan, dtype=x.dtype, device=device).transpose(0, 1)
    tilegen.apply_rope(x, cos, sin, out=out_t)
    assert torch.equal(out_t, expected)
    # strided input and tables
    wide = torch.randn(9, 5, 80, device=device).to(x.dtype)[..., ::2]
    wide_cos = torch.randn(9, 80, device=device)[:, ::2]
    assert_rotated(tilegen.apply_rope(wide, wide_cos, sin), wide, wide_cos, sin)
    # in place, and with bf16 tables
    y = x.clone()
    assert tilegen.apply_rope(y, cos, sin, out=y) is y and torch.equal(y, expected)
    _, cos16, sin16 = make((9, 5, 40), torch.bfloat16, device, seed=1, table_dtype=torch.bfloat16)
    assert_rotated(tilegen.apply_rope(x, cos16, sin16), x, cos16, sin16)


def test_no_rows_gives_an_empty_result(device):
    x, cos, sin = make((0, 3, 16), torch.float32, device)
    assert tilegen.apply_rope(x, cos, sin).shape == (0, 3, 16)
    x, cos, sin = make((4, 0, 16), torch.float32, device)
    assert tilegen.apply_rope(x, cos, sin).shape == (4, 0, 16)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lead=st.lists(st.integers(1, 9), min_size=1, max_size=2),
    heads=st.integers(1, 6),
    half=st.integers(1, 40),
    dtype=st.sampled_from(["fp32", "bf16"]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes(lead, heads, half, dtype, seed, device):
    x, cos, sin = make((*lead, heads, 2 * half), DTYPES[dtype], device, seed=seed)
    assert_rotated(tilegen.apply_rope(x, cos, sin), x, cos, sin)


# ---------------------------------------------------------------------------------- bad input

def _raises(exc, prefix):
    import re

    return pytest.raises(exc, match="^" + re.escape(prefix))


BAD = [
    ("x-list", lambda x, c, s: ([1.0], c, s), {}, TypeError, "x: expected a torch.Tensor"),
    ("sin-list", lambda x, c, s: (x, c, s.tolist()), {}, TypeError, "sin: expected a torch.Tensor"),
    ("x-rank1", lambda x, c, s: (x[0, 0], c, s), {}, ValueError, "x: expected [..., heads, head_dim]"),
    ("x-int", lambda x, c, s: (x.int(), c, s), {}, TypeError, "x: expected dtype float16"),
    ("x-odd-dim", lambda x, c, s: (x[..., :23], c[..., :23], s[..., :23]), {}, ValueError,
     "x: head_dim 23 is not supported; expected an even number in 2..512"),
    ("cos-shape", lambda x, c, s: (x, c[:4], s), {}, ValueError, "cos: expected shape (5, 24) (x's without heads)"),
    ("sin-per-head", lambda x, c, s: (x, c, s[:, None].expand(5, 3, 24)), {}, ValueError, "sin: expected shape (5, 24)"),
    ("cos-dtype", lambda x, c, s: (x, c.double(), s), {}, TypeError, "cos: expected dtype float32, bfloat16 or float16"),
    ("sin-device", lambda x, c, s: (x, c, s.to("meta")), {}, ValueError, "sin: on meta while x"),
    ("out-shape", lambda *p: p, {"out": torch.empty(5, 3, 8)}, ValueError, "out: expected shape (5, 3, 24)"),
    ("out-dtype", lambda *p: p, {"out": torch.empty(5, 3, 24, dtype=torch.bfloat16)}, TypeError,
     "out: expected dtype torch.float32"),
    ("out-meta", lambda *p: p, {"out": torch.empty(5, 3, 24, device="meta")}, ValueError, "out: on meta"),
    ("out-list", lambda *p: p, {"out": [0.0]}, TypeError, "out: expected a torch.Tensor or None"),
]


@pytest.mark.parametrize("build, kwargs, exc, prefix", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_input_names_the_argument(build, kwargs, exc, prefix, device):
    parts = make((5, 3, 24), torch.float32, device)
    kwargs = {k: t.to(device) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t
              for k, t in kwargs.items()}
    with _raises(exc, prefix):
        tilegen.apply_rope(*build(*parts), **kwargs)


def test_an_out_overlapping_an_input_or_itself_is_refused(device):
    """In place is x itself; any other out that shares memory with an input would be written by
    one program while another still reads it."""
    x, cos, sin = make((5, 3, 24), torch.float32, device)
    want = tilegen.apply_rope(x, cos, sin)
    rows = torch.cat([x, x[:1]]).clone()  # x's rows and one more, in one buffer
    with _raises(ValueError, "out: overlaps x in memory; pass x itself, or a tensor of its own"):
        tilegen.apply_rope(rows[:5], cos, sin, out=rows[1:])
    shared = torch.cat([cos.flatten(), torch.zeros(360 - 60, device=device)])
    with _raises(ValueError, "out: overlaps cos in memory"):
        tilegen.apply_rope(x, shared[:120].view(5, 24), sin, out=shared[60:].view(5, 3, 24))
    with _raises(ValueError, "out: overlaps itself (stride 0 in dimension 0"):
        tilegen.apply_rope(x, cos, sin, out=torch.zeros(3, 24, device=device).expand(5, 3, 24))
    y = rows[:5]
    assert tilegen.apply_rope(y, cos, sin, out=y) is y
    assert torch.equal(y, want) and torch.equal(rows[5], x[0])  # the row past the view is untouched


def test_a_head_dim_past_the_kernel_s_bound_is_refused(device):
    x, cos, sin = make((2, 1, 514), torch.float32, device)
    with _raises(ValueError, "x: head_dim 514 is not supported; expected an even number in 2..512"):
        tilegen.apply_rope(x, cos, sin)


# ---------------------------------------------------------------- spec, problem, dispatch, tune

SPEC = RopeSpec(head_dim=40, dtype="fp32")


def test_spec_json_round_trips_and_bad_fields_name_themselves():
    assert spec_from_json(SPEC.to_json()) == SPEC and family_of(SPEC) is get("rope")
    assert SPEC.name == "rope_fp32_d40"
    for bad in (0, 7, 514):
        with pytest.raises(SpecError, match="^head_dim"):
            RopeSpec(head_dim=bad)
    source = source_for(SPEC)
    assert "HEAD_DIM = tl.constexpr(40)" in source and "HALF_PAD: tl.constexpr = 32" in source
    assert "{{" not in source
    compile(source, "<generated>", "exec")
    kernel_globals_are_constexpr(source)


def test_the_problem_poisons_its_outputs_and_its_check_fails_until_written():
    family = get("rope")
    problem = family.problem(SPEC, 64, on_gpu=not DEVICE.is_interpreter)
    inputs = problem.inputs(seed=3)
    (out,) = problem.outputs(inputs)
    assert torch.isnan(out).all()
    assert problem.check(inputs, (out,)) == (math.inf, math.inf)
    problem.launch(module_for(SPEC), family.default_config(SPEC, DEVICE, 64), inputs, (out,))
    error, _ = problem.check(inputs, (out,))
    assert error < problem.tolerance
    out[0, 0, 0] += 1.0  # one wrong element fails the check
    assert problem.check(inputs, (out,))[0] > problem.tolerance


def test_dispatch_buckets_by_rows_and_uses_the_default_untuned(device):
    parts = make((9, 5, 40), torch.float32, device)
    choice = explain_rope(*parts)
    assert (choice.source, choice.bucket) == ("default", 64)
    assert choice.config == get("rope").default_config(SPEC, DEVICE, 64)


def test_a_tune_reaches_dispatch_and_the_op(tmp_path, monkeypatch, device):
    path = tmp_path / "tuning.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(path))
    with TuningDB(path) as db, Tuner(db, DEVICE, trials=3) as tuner:
        result = tuner.tune(SPEC, 64)
    assert result.best is not None and result.statuses["ok"] == 3
    assert tuned_rows(**TuningKey.current(SPEC, DEVICE).variant_fields()) == {64: (result.best.config, str(path))}
    dispatch.reset()
    parts = make((9, 5, 40), torch.float32, device)
    choice = explain_rope(*parts)
    assert (choice.config, choice.source, choice.tuned_bucket) == (result.best.config, str(path), 64)
    assert_rotated(tilegen.apply_rope(*parts), *parts)


def test_the_custom_op_passes_opcheck(device):
    torch.library.opcheck(torch.ops.tilegen.apply_rope.default, make((3, 5, 24), torch.float32, device))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_fullgraph_in_place(device, backend):
    x, cos, sin = make((7, 5, 40), torch.bfloat16, device, seed=9)
    expected = tilegen.apply_rope(x, cos, sin)

    def f(q, cos, sin):
        tilegen.apply_rope(q, cos, sin, out=q)
        return q * 2

    torch._dynamo.reset()
    y = x.clone()
    doubled = torch.compile(f, fullgraph=True, backend=backend)(y, cos, sin)
    assert torch.equal(y, expected) and torch.equal(doubled, expected * 2)


def test_the_kernel_compiles_for_an_h200(tmp_path):
    """What the interpreter runs, the sm90 compiler must accept (block shapes, types, constexprs)."""
    pytest.importorskip("triton.backends.nvidia")
    configs = [{"BLOCK_R": 4, "num_warps": 1}, {"BLOCK_R": 128, "num_warps": 8}]
    for spec, table in ((RopeSpec(head_dim=128), "fp32"), (RopeSpec(head_dim=40, dtype="fp32"), "bf16")):
        pointers = {**dict.fromkeys(("X", "Out"), f"*{spec.dtype}"), **dict.fromkeys(("Cos", "Sin"), f"*{table}")}
        request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "configs": configs}
        compile_for_sm90(request, tmp_path, kernels=len(configs))
