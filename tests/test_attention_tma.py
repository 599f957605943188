"""The attention kernel's TMA path (config ``tma=1``): Q, K and V read through tensor descriptors.

Under the interpreter the descriptor loads run too, so these checks hold on the CPU: every
element written, the float64 reference matched at sizes that are no multiple of a block
(the descriptor fills zeros past the sequence and the head dim), and the pointer path taken
where a tensor's layout allows no descriptor.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    LAYOUTS,
    Case,
    attention_calls,
    check_against_reference,
    param,
    poisoned_like_out,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tilegen.codegen.cache import module_for
from tilegen.device import CPU_INTERPRETER, DeviceInfo
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import Config
from tilegen.families.attention_fwd.config import feasible, search_space
from tilegen.ops.attention import prepare_call, run_with_config

CASES = [
    param(Case(70, 90, dtype="fp16", heads_q=4, heads_kv=2, window=(5, 9))),
    param(Case(90, 70, dtype="bf16", head_dim=40, window=(40, 0))),
    param(Case(17, 257, dtype="fp32", head_dim_v=32, causal=True)),
    param(Case(1, 1, dtype="bf16", causal=True)),
    param(Case(33, dtype="fp16", softcap=4.0, head_dim=96)),
]


@pytest.fixture
def descriptors(monkeypatch):
    """Counts the tensor descriptors the launcher makes (three per launch on the TMA path), with the
    launcher's size floor for descriptors lifted: these shapes are far below it."""

    def spy(spec):
        module = module_for(spec)
        monkeypatch.setattr(module, "TMA_MIN_WORK", 0)
        made = []
        real = module.TensorDescriptor

        def counting(*args, **kwargs):
            made.append(args[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "TensorDescriptor", counting)
        return made

    return spy


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 64)], ids=["bm16-bn16", "bm32-bn64"])
@pytest.mark.parametrize("case", CASES)
def test_tma_writes_every_element(case, block_m, block_n, device, descriptors):
    _check_tma_call(case, block_m, block_n, device, descriptors)


def _check_tma_call(case, block_m, block_n, device, descriptors) -> None:
    """``case`` through the descriptors (contiguous tensors allow them), into a NaN-filled output."""
    q, k, v = case.inputs(device)
    spec, left, right, scale, softcap = prepare_call(q, k, v, case.causal, case.window, case.softcap, case.scale, True)
    made = descriptors(spec)
    poisoned = poisoned_like_out(q, v)
    out, lse = run_with_config(spec, Config(block_m, block_n, 4, 1, tma=1), q, k, v, scale, softcap, left, right,
                               out=poisoned)
    assert len(made) == 3 * (case.layout == "contiguous"), "the launcher took the pointer path for contiguous tensors"
    assert not torch.isnan(poisoned).any(), f"{torch.isnan(poisoned).sum().item()} output elements never written"
    check_against_reference(out, lse, q, k, v, **case.mask_kwargs())


def test_tma_only_for_calls_that_hide_its_host_cost(device, descriptors):
    """Below TMA_MIN_WORK multiply-adds the launcher keeps pointers: descriptors cost host time."""
    case = Case(40, 40, dtype="bf16", head_dim=64)
    q, k, v = case.inputs(device)
    spec, left, right, scale, softcap = prepare_call(q, k, v, False, None, None, None, True)
    made = descriptors(spec)
    module = module_for(spec)
    work = q.shape[0] * q.shape[1] * 40 * 40 * 64
    for floor, expected in ((work + 1, 0), (work, 3)):
        module.TMA_MIN_WORK = floor
        made.clear()
        out, lse = run_with_config(spec, Config(32, 32, 4, 1, tma=1), q, k, v, scale, softcap, left, right)
        assert len(made) == expected, (floor, work, len(made))
        check_against_reference(out, lse, q, k, v)


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=attention_calls(), block_m=st.sampled_from([16, 32, 64]), block_n=st.sampled_from([16, 32, 64]))
def test_tma_property_matches_reference(case, block_m, block_n, device, descriptors):
    """Random sizes, heads, masks and blocks through the descriptors."""
    _check_tma_call(case, block_m, block_n, device, descriptors)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tma_layouts(layout, device, descriptors):
    """Every layout the op takes; those without a unit-stride head dim or 16-byte strides fall back."""
    case = Case(37, 45, dtype="bf16", heads_q=2, heads_kv=1, causal=True, layout=layout)
    q, k, v = case.inputs(device)
    spec, left, right, scale, softcap = prepare_call(q, k, v, True, None, None, None, True)
    made = descriptors(spec)
    out, lse = run_with_config(spec, Config(32, 16, 4, 1, tma=1), q, k, v, scale, softcap, left, right)
    allows = all(t.stride(3) == 1 and not any(s * t.element_size() % 16 for s in t.stride()[:3]) for t in (q, k, v))
    assert len(made) == (3 if allows else 0)
    check_against_reference(out, lse, q, k, v, causal=True)


def test_tma_misaligned_base_falls_back(device, descriptors):
    """A view starting 2 bytes into its storage cannot have a descriptor: pointers, same answer."""
    case = Case(20, 20, dtype="fp16", head_dim=32)
    q, k, v = case.inputs(device)
    b, h, n, d = k.shape
    wide = torch.randn(b * h * n * d + 1, dtype=k.dtype, device=device)
    k = wide[1:].view(b, h, n, d)  # its base lies 2 bytes past the storage's
    spec, left, right, scale, softcap = prepare_call(q, k, v, False, None, None, None, True)
    made = descriptors(spec)
    out, lse = run_with_config(spec, Config(16, 16, 4, 1, tma=1), q, k, v, scale, softcap, left, right)
    assert made == []
    check_against_reference(out, lse, q, k, v)


def test_tma_is_a_hopper_knob():
    spec = ATTENTION_FWD.presets["mha-d128-causal"]
    ampere = DeviceInfo("NVIDIA A100", (8, 0), 108, 80 << 30, 166912)
    hopper = DeviceInfo("NVIDIA H200", (9, 0), 132, 141 << 30, 232448)
    assert search_space(spec, ampere)["tma"] == [0]
    assert search_space(spec, hopper)["tma"] == [0, 1]
    assert "no TMA" in feasible(spec, Config(128, 64, 8, 3, tma=1), ampere)
    assert feasible(spec, Config(128, 64, 8, 3, tma=1), hopper) is None
    assert feasible(spec, Config(32, 32, 4, 1, tma=1), CPU_INTERPRETER) is None
    assert str(Config(128, 64, 8, 3, tma=1)) == "BM128-BN64-w8-s3-tma"
    with pytest.raises(ValueError, match="tma: expected 0 \\(off\\) or 1"):
        Config.from_dict({"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2, "tma": 2})
    assert Config.from_dict({"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}).tma == 0
