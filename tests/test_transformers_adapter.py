"""tilegen.integrations.transformers' attention function, without transformers: its contract (layouts, GQA,
causal from the module, scale, sliding window, softcap) against SDPA and the float64 reference, and what it
refuses. Importing tilegen must not import transformers."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from tilegen.families.attention_fwd.reference import attention_reference
from tilegen.integrations import transformers as tilegen_hf


def _qkv(device, n=19, heads=4, heads_kv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, n, d, generator=gen).to(device) for h in (heads, heads_kv, heads_kv))
    return q, k, v


def _rel(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("module_causal", [True, False])
def test_output_layout_gqa_and_causal_from_the_module(module_causal, device):
    q, k, v = _qkv(device)
    module = types.SimpleNamespace(is_causal=module_causal)
    out, weights = tilegen_hf.attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.3)
    assert weights is None and out.shape == (2, 19, 4, 16) and out.is_contiguous()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=module_causal, scale=0.3, enable_gqa=True)
    assert _rel(out, ref.transpose(1, 2)) < 1e-4


def test_the_is_causal_keyword_wins_over_the_module(device):
    q, k, v = _qkv(device)
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, None, is_causal=False)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert _rel(out, ref.transpose(1, 2)) < 1e-4


def test_sliding_window_and_softcap(device):
    q, k, v = _qkv(device)
    out, _ = tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, None,
                                          sliding_window=4, softcap=2.0)
    # transformers keeps keys with kv_idx > q_idx - sliding_window: 3 before the diagonal.
    ref = attention_reference(q, k, v, causal=True, window=(3, 0), softcap=2.0)[0]
    assert _rel(out, ref.transpose(1, 2)) < 1e-4


def test_what_it_refuses(device):
    q, k, v = _qkv(device)
    module = types.SimpleNamespace(is_causal=True)
    mask = torch.zeros(2, 1, 19, 19, dtype=torch.bool, device=device)
    with pytest.raises(NotImplementedError, match="attention_mask"):
        tilegen_hf.attention_forward(module, q, k, v, mask)
    with pytest.raises(NotImplementedError, match="dropout"):
        tilegen_hf.attention_forward(module, q, k, v, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="s_aux"):
        tilegen_hf.attention_forward(module, q, k, v, None, s_aux=torch.zeros(4, device=device))
    with pytest.raises(NotImplementedError, match="sliding_window"):
        tilegen_hf.attention_forward(types.SimpleNamespace(is_causal=False), q, k, v, None, sliding_window=4)


def test_register_without_transformers_says_what_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # an import of it fails
    with pytest.raises(ImportError, match="needs transformers"):
        tilegen_hf.register()


def test_importing_tilegen_does_not_import_transformers():
    code = "import sys, tilegen, tilegen.integrations.transformers; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
