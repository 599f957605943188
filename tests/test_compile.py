"""GPU only: the correctness checks of test_attention.py with kernels compiled for CUDA.

These run the sizes the CPU interpreter cannot (thousands of rows, eight heads,
batch 2), the GPU's own default configs, every config the tuner may pick, and
``torch.compile``. Every test here is marked ``gpu`` and skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    Case,
    check_against_reference,
    param,
    poisoned_like_out,
    run_public,
)

import tilegen
from tilegen.families import family_of
from tilegen.device import device_info
from tilegen.ops.attention import prepare_call, run_with_config

pytestmark = pytest.mark.gpu

B, H = 2, 8

GPU_CASES = [
    param(Case(1000, batch=B, heads_q=H, heads_kv=H, head_dim=64, dtype="bf16")),
    param(Case(4096, batch=B, heads_q=H, heads_kv=H, head_dim=64, dtype="bf16", causal=True)),
    param(Case(4096, batch=B, heads_q=H, heads_kv=H, head_dim=128, dtype="bf16")),
    param(Case(4096, batch=B, heads_q=H, heads_kv=2, head_dim=128, dtype="bf16", causal=True)),
    param(Case(4096, batch=B, heads_q=H, heads_kv=1, head_dim=64, dtype="bf16", window=(256, 0), tags=("mqa",))),
    param(Case(1000, batch=B, heads_q=H, heads_kv=4, head_dim=128, dtype="bf16", window=(100, 100))),
    param(Case(1000, 4096, batch=B, heads_q=H, heads_kv=H, head_dim=128, dtype="bf16", causal=True)),
    param(Case(4096, 1000, batch=B, heads_q=H, heads_kv=H, head_dim=64, dtype="bf16", causal=True)),
    param(Case(4096, batch=B, heads_q=H, heads_kv=4, head_dim=128, dtype="fp16", causal=True, softcap=30.0)),
    param(Case(1000, batch=B, heads_q=H, heads_kv=H, head_dim=96, head_dim_v=64, dtype="bf16", causal=True)),
    param(Case(1000, batch=B, heads_q=H, heads_kv=2, head_dim=40, dtype="fp16", window=(64, 8))),
    param(Case(4096, batch=1, heads_q=4, heads_kv=4, head_dim=128, dtype="fp32", causal=True)),
    param(Case(4096, batch=B, heads_q=H, heads_kv=2, head_dim=128, dtype="bf16", causal=True, layout="bnhd")),
    param(Case(1000, batch=B, heads_q=H, heads_kv=H, head_dim=64, dtype="bf16", layout="dim-strided")),
    # Decoding: one query row against a long cache (hits the known causal short-query bug).
    param(Case(1, 4096, batch=B, heads_q=H, heads_kv=2, head_dim=128, dtype="bf16", causal=True)),
    param(Case(17, 4096, batch=B, heads_q=H, heads_kv=2, head_dim=128, dtype="bf16", causal=True)),
]


@pytest.mark.parametrize("case", GPU_CASES)
def test_matches_reference_on_gpu(request, case):
    (q, k, v), (out, lse) = run_public(request, case, "cuda")
    check_against_reference(out, lse, q, k, v, **case.mask_kwargs())


SWEEP_CASES = [
    param(Case(1000, 1200, batch=1, heads_q=4, heads_kv=2, head_dim=128, dtype="bf16", window=(300, 17))),
    param(Case(1000, batch=1, heads_q=4, heads_kv=4, head_dim=64, dtype="fp16", causal=True)),
]


@pytest.mark.parametrize("case", SWEEP_CASES)
def test_every_candidate_config_on_gpu(request, case):
    """Every config the tuner may choose on this GPU writes every element and matches the reference."""
    q, k, v = case.inputs("cuda")
    spec, left, right, scale, softcap = prepare_call(q, k, v, case.causal, case.window, None, None, True)
    configs = family_of(spec).candidates(spec, device_info())
    assert configs, "no feasible config on this GPU"
    for config in configs:
        poisoned = poisoned_like_out(q, v)
        out, lse = run_with_config(spec, config, q, k, v, scale, softcap, left, right, out=poisoned)
        torch.cuda.synchronize()
        assert not torch.isnan(poisoned).any(), f"{config}: output elements never written"
        try:
            check_against_reference(out, lse, q, k, v, **case.mask_kwargs())
        except AssertionError as e:
            raise AssertionError(f"config {config}: {e}") from None


def test_offsets_past_int32_are_64_bit():
    """q and out hold more than 2**31 elements: pointer offsets must not wrap around in int32."""
    b, hq, hkv, n, d = 9, 128, 8, 16384, 128
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert q.numel() > 2**31
    out, lse = tilegen.attention(q, k, v, causal=True, return_lse=True)
    # Check where offsets are largest: last batch, last heads, last rows (causal, so the
    # last 1024 query rows against every key is the same bottom-right aligned problem).
    rows = slice(n - 1024, n)
    check_against_reference(
        out[-1:, 120:, rows], lse[-1:, 120:, rows], q[-1:, 120:, rows], k[-1:, 7:], v[-1:, 7:], causal=True
    )


@pytest.mark.parametrize("backend", ["inductor"])
def test_torch_compile_fullgraph_on_gpu(backend):
    case = Case(1000, batch=B, heads_q=H, heads_kv=2, head_dim=128, dtype="bf16", causal=True)
    q, k, v = case.inputs("cuda")

    def f(q, k, v):
        out, lse = tilegen.attention(q, k, v, causal=True, return_lse=True)
        return out.float() * 2, lse

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    out2, lse = compiled(q, k, v)
    check_against_reference((out2 / 2).to(q.dtype), lse, q, k, v, causal=True)


def test_same_result_on_a_side_stream():
    case = Case(1000, batch=B, heads_q=H, heads_kv=H, head_dim=64, dtype="bf16", causal=True)
    q, k, v = case.inputs("cuda")
    expected = tilegen.attention(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = tilegen.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
