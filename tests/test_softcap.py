"""Logit softcapping is exact for every finite positive softcap, tiny to fp32's largest.

``softcap * tanh(s / softcap)`` must keep its digits when ``s / softcap`` is tiny (a large
softcap: the cap is then almost the identity) and must not overflow or underflow in the
launcher's folding of the scales; each case compares with the float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch

import tilegen
from tilegen.families.attention_fwd.reference import attention_reference

FP32_MAX = torch.finfo(torch.float32).max
SOFTCAPS = [1e-3, 1.0, 50.0, 1e4, 1e8, FP32_MAX]
HEAD_DIM = 32


def _inputs(device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, HEAD_DIM, generator=gen) for n in (24, 40, 40))
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def _errors(q, k, v, **kwargs):
    out, lse = tilegen.attention(q, k, v, return_lse=True, **kwargs)
    ref_out, ref_lse = attention_reference(q, k, v, **kwargs)
    out_error = float((out.double() - ref_out).norm() / ref_out.norm())
    lse_error = float(((lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)).max())
    return out_error, lse_error


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=lambda c: f"{c:g}")
def test_softcap_at_the_default_scale_matches_the_reference(softcap, device):
    out_error, lse_error = _errors(*_inputs(device, torch.float32), softcap=softcap, causal=True)
    assert out_error < 1e-5 and lse_error < 1e-5, (out_error, lse_error)


@pytest.mark.parametrize("softcap", [1e-3, 1.0, 50.0], ids=lambda c: f"{c:g}")
def test_softcap_that_binds_matches_the_reference(softcap, device):
    # Logits of a few softcaps: scores fall on both sides of the kernel's small-argument branch.
    # (Logits far above 100 would measure fp32's rounding of the dot product, not the cap.)
    scale = 3.0 * softcap / math.sqrt(HEAD_DIM)
    out_error, lse_error = _errors(*_inputs(device, torch.float32, seed=1), softcap=softcap, scale=scale)
    assert out_error < 1e-5 and lse_error < 1e-5, (out_error, lse_error)


@pytest.mark.parametrize("softcap", [1e8, FP32_MAX], ids=lambda c: f"{c:g}")
def test_large_softcap_in_half_precision_is_the_plain_softmax(softcap, device):
    q, k, v = _inputs(device, torch.bfloat16)
    capped = tilegen.attention(q, k, v, softcap=softcap)
    plain = tilegen.attention(q, k, v)
    assert torch.isfinite(capped).all()
    assert (capped.double() - plain.double()).abs().max() <= 2 ** -7 * plain.double().abs().max()
