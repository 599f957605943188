"""The attention kernel's Gluon path (config ``wgmma=1``): Hopper's wgmma pipeline written out.

Gluon has no interpreter, so on the CPU machine these tests check what the knob promises without
running it: where it is offered, what it refuses and why, that a launch falls back to the Triton
kernel where the Gluon one cannot run, and that the kernel compiles for sm90 with every wgmma
kept asynchronous (ptxas serializes them all if one is in flight across a loop's back edge). On
a GPU the ``gpu`` tests run it against the float64 reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from helpers import Case, check_against_reference, param, poisoned_like_out

from tilegen.codegen.cache import module_for
from tilegen.device import CPU_INTERPRETER, DeviceInfo, device_info
from tilegen.families.attention_fwd import AttentionFwd, AttentionSpec, Config
from tilegen.families.attention_fwd.config import (
    default_rule,
    feasible,
    has_wgmma,
    search_space,
    wgmma_unsupported,
)
from tilegen.ops.attention import prepare_call, run_with_config

HOPPER = DeviceInfo("NVIDIA H200", (9, 0), 132, 141 << 30, 232448)
AMPERE = DeviceInfo("NVIDIA A100", (8, 0), 108, 80 << 30, 166912)
BLACKWELL = DeviceInfo("NVIDIA B200", (10, 0), 148, 180 << 30, 232448)
TRITON_36 = triton.__version__.startswith("3.6.")
WGMMA = Config(128, 128, 8, 3, tma=1, wgmma=1)


def test_offered_on_hopper_with_triton_36_only():
    spec = AttentionFwd.presets["mha-d128-causal"]
    assert search_space(spec, HOPPER)["wgmma"] == ([0, 1] if TRITON_36 else [0])
    for device in (AMPERE, BLACKWELL, CPU_INTERPRETER):
        assert not has_wgmma(device)
        assert search_space(spec, device)["wgmma"] == [0]
        assert "needs an sm90 GPU and Triton 3.6" in feasible(spec, WGMMA, device)
    assert str(WGMMA) == "BM128-BN128-w8-s3-tma-wgmma"


@pytest.mark.skipif(not TRITON_36, reason="the wgmma knob is offered under Triton 3.6 only")
@pytest.mark.parametrize("spec,config,reason", [
    (AttentionSpec(head_dim=64, mask="window", dtype="bf16"), WGMMA, "no window"),
    (AttentionSpec(head_dim=128, softcap=True, dtype="bf16"), WGMMA, "softcap"),
    (AttentionSpec(head_dim=96, dtype="bf16"), WGMMA, "64 or 128"),
    (AttentionSpec(head_dim=128, head_dim_v=64, dtype="bf16"), WGMMA, "64 or 128, equal"),
    (AttentionSpec(head_dim=64, dtype="fp32"), WGMMA, "bf16 or fp16"),
    (AttentionSpec(head_dim=128, dtype="bf16"), Config(128, 128, 8, 3, tma=0, wgmma=1), "goes with tma=1"),
    (AttentionSpec(head_dim=128, dtype="bf16"), Config(128, 64, 4, 3, tma=1, wgmma=1), "BM128 with 8"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(64, 32, 4, 3, tma=1, wgmma=1), "64 or 128"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(64, 64, 4, 1, tma=1, wgmma=1), "two slots"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(64, 64, 4, 2, tma=1, wgmma=2), "expected 0 or 1"),
])
def test_refuses_what_the_kernel_does_not_implement(spec, config, reason):
    assert reason in feasible(spec, config, HOPPER)
    # A spec the kernel does not implement is never offered the knob; a config it refuses is.
    assert search_space(spec, HOPPER)["wgmma"] == ([0] if wgmma_unsupported(spec) else [0, 1])


@pytest.mark.skipif(not TRITON_36, reason="the wgmma knob is offered under Triton 3.6 only")
def test_feasible_configs_and_default_rule():
    for spec in (AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", return_lse=True),
                 AttentionSpec(head_dim=64, dtype="fp16")):
        for config in (WGMMA, Config(64, 128, 4, 3, tma=1, wgmma=1), Config(64, 64, 4, 2, tma=1, wgmma=1)):
            assert feasible(spec, config, HOPPER) is None, (spec, config)
    # Past 2k the d128 rule takes the Gluon kernel (measured on the H200); d64 keeps the Triton one.
    d128 = default_rule(AttentionSpec(head_dim=128, mask="causal", dtype="bf16"), HOPPER)
    assert d128[-2] == (2048, Config(128, 128, 8, 3, 1)) and d128[-1] == (None, WGMMA)
    assert not any(c.wgmma for _, c in default_rule(AttentionSpec(head_dim=64, dtype="bf16"), HOPPER))
    assert not any(c.wgmma for _, c in default_rule(AttentionSpec(head_dim=128, softcap=True, dtype="bf16"), HOPPER))
    assert not any(c.wgmma for _, c in default_rule(AttentionSpec(head_dim=128, dtype="bf16"), AMPERE))


def test_only_specs_it_implements_carry_the_kernel():
    from tilegen.codegen import source_for

    assert "_wgmma(" in source_for(AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16"))
    assert "_wgmma(" not in source_for(AttentionSpec(head_dim=64, mask="window", dtype="bf16"))
    assert "gluon" not in source_for(AttentionSpec(head_dim=96, dtype="fp16"))


@pytest.mark.parametrize("case", [
    param(Case(33, 70, dtype="bf16", head_dim=64, heads_q=4, heads_kv=2, causal=True)),
    param(Case(17, dtype="fp16", head_dim=128)),
])
def test_falls_back_to_the_triton_kernel_off_the_gpu(case, device, monkeypatch):
    """Where the Gluon kernel cannot run (here: no CUDA tensors) a wgmma config runs the Triton kernel
    with the same tiles, into every element of the output."""
    if str(device).startswith("cuda"):
        pytest.skip("on a GPU the Gluon kernel runs: the gpu tests below")
    q, k, v = case.inputs(device)
    spec, left, right, scale, softcap = prepare_call(q, k, v, case.causal, None, None, None, True)
    monkeypatch.setattr(module_for(spec), "TMA_MIN_WORK", 0)
    poisoned = poisoned_like_out(q, v)
    out, lse = run_with_config(spec, Config(64, 64, 4, 2, tma=1, wgmma=1), q, k, v, scale, softcap, left, right,
                               out=poisoned)
    assert not torch.isnan(poisoned).any()
    check_against_reference(out, lse, q, k, v, causal=case.causal)


def _descriptor(rows: int, head_dim: int, dtype: str) -> str:
    from triton.experimental.gluon import language as gl

    element = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], element)
    return f"tensordesc<{dtype}[1, 1, {rows}, {head_dim}],{layout!r}>"


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernel is written against Triton 3.6's API")
@pytest.mark.parametrize("spec", [
    AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", return_lse=True),
    AttentionSpec(head_dim=64, mask="none", dtype="fp16"),
], ids=lambda s: s.name)
def test_compiles_for_sm90_with_asynchronous_wgmma(spec, tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    script = Path(__file__).with_name("sm90_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TILEGEN_CACHE_DIR"] = str(tmp_path)
    configs = [(128, 128, 3, 8), (64, 128, 3, 4), (64, 64, 2, 4)]
    for block_m, block_n, stages, warps in configs:
        pointers = {"Out": f"*{spec.dtype}", "Lse": "*fp32", "qk_scale": "fp32",
                    "q_desc": _descriptor(block_m, spec.head_dim, spec.dtype),
                    "k_desc": _descriptor(block_n, spec.head_dim, spec.dtype),
                    "v_desc": _descriptor(block_n, spec.head_dim, spec.dtype)}
        request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "kernel": "kernel_wgmma", "ptxas": True,
                   "configs": [{"BLOCK_M": block_m, "BLOCK_N": block_n, "STAGES": stages, "num_warps": warps}]}
        done = subprocess.run([sys.executable, str(script), json.dumps(request)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "cubin bytes" in done.stdout and done.stdout.strip().endswith("wgmma async"), done.stdout


GPU_CASES = [
    param(Case(1, 1, dtype="bf16", head_dim=64, causal=True)),
    param(Case(17, dtype="bf16", head_dim=128, heads_q=4, heads_kv=2, causal=True)),
    param(Case(257, dtype="fp16", head_dim=64, batch=2, heads_q=8, heads_kv=2)),
    param(Case(1000, dtype="bf16", head_dim=128, heads_q=4, heads_kv=4, causal=True)),
    param(Case(100, 300, dtype="bf16", head_dim=64, heads_q=4, heads_kv=1, causal=True)),
    param(Case(300, 100, dtype="fp16", head_dim=128, causal=True)),  # rows that see no key
    param(Case(129, 1000, dtype="bf16", head_dim=64, heads_q=8, heads_kv=8)),
    param(Case(1000, dtype="fp16", head_dim=128, batch=2, scale=0.3)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [WGMMA, Config(64, 128, 4, 3, tma=1, wgmma=1), Config(64, 64, 4, 2, tma=1, wgmma=1)],
                         ids=str)
@pytest.mark.parametrize("case", GPU_CASES)
def test_gluon_kernel_matches_reference(case, config, monkeypatch):
    if not has_wgmma(device_info(torch.cuda.current_device())):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
    q, k, v = case.inputs(torch.device("cuda"))
    spec, left, right, scale, softcap = prepare_call(q, k, v, case.causal, None, None, case.scale, True)
    module = module_for(spec)
    monkeypatch.setattr(module, "TMA_MIN_WORK", 0)
    kernel = getattr(module, f"_{spec.name}_kernel_wgmma")
    runs = []
    monkeypatch.setattr(module, f"_{spec.name}_kernel_wgmma",
                        type("Spy", (), {"__getitem__": lambda self, grid: runs.append(grid) or kernel[grid]})())
    poisoned = poisoned_like_out(q, v)
    out, lse = run_with_config(spec, config, q, k, v, scale, softcap, left, right, out=poisoned)
    torch.cuda.synchronize()
    assert len(runs) == 1, "the launcher did not take the Gluon kernel"
    assert not torch.isnan(poisoned).any(), f"{torch.isnan(poisoned).sum().item()} output elements never written"
    check_against_reference(out, lse, q, k, v, causal=case.causal, scale=case.scale)
