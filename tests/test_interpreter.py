"""Triton's CPU interpreter: tilegen's fixes go in only where the installed Triton needs them,
and setting TRITON_INTERPRET=1 too late ends in an error that says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from helpers import checkout_pythonpath

from tilegen.env import interpreting
from tilegen.triton_internals.interpreter import mend_interpreter, patch_interpreter

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (no GPU)")


@triton.jit
def _dot_and_cast(A, B, C, D, N: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(A + r[:, None] * N + r[None, :])
    b = tl.load(B + r[:, None] * N + r[None, :])
    c = tl.dot(a, b)
    tl.store(C + r[:, None] * N + r[None, :], c)
    tl.store(D + r[:, None] * N + r[None, :], c.to(tl.bfloat16))


def test_bf16_dot_and_cast_match_torch_once_mended():
    patch_interpreter()
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=gen).bfloat16() for _ in range(2))
    c, d = torch.empty(16, 16), torch.empty(16, 16, dtype=torch.bfloat16)
    _dot_and_cast[(1,)](a, b, c, d, 16)
    expected = a.float() @ b.float()
    assert torch.allclose(c, expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(d, c.bfloat16())  # round to nearest even, as the GPU casts


@triton.jit
def _bf16_arithmetic(X, O, N: tl.constexpr):
    r = tl.arange(0, N)
    y = tl.load(X + r).to(tl.bfloat16)
    tl.store(O + r, y * 4)
    tl.store(O + N + r, y + y)
    tl.store(O + 2 * N + r, -y)
    tl.store(O + 3 * N + r, tl.exp(y.to(tl.float32)).to(tl.bfloat16) / y)
    tl.store(O + 4 * N + r, tl.where(y < 0.5, y, 0.0))


def test_bf16_arithmetic_matches_torch_once_mended():
    """A bf16 product, sum, negation, quotient and comparison, each rounded to bf16 as the GPU rounds."""
    patch_interpreter()
    x = torch.randn(16, generator=torch.Generator().manual_seed(1))
    out = torch.empty(5 * 16, dtype=torch.bfloat16)
    _bf16_arithmetic[(1,)](x, out, 16)
    y = x.bfloat16()
    expected = [y * 4, y + y, -y, torch.exp(y.float()).bfloat16() / y, torch.where(y < 0.5, y, 0.0)]
    for i, want in enumerate(expected):
        assert torch.equal(out[16 * i:16 * (i + 1)], want.bfloat16()), i


def test_a_mended_interpreter_needs_no_further_fix():
    patch_interpreter()
    assert mend_interpreter() == ()  # the probes now find every bug gone


def test_setting_triton_interpret_after_import_says_what_to_do():
    script = textwrap.dedent(
        """
        import os, torch, tilegen
        os.environ["TRITON_INTERPRET"] = "1"
        q = torch.randn(1, 1, 16, 16)
        tilegen.attention(q, q, q)
        """
    )
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = checkout_pythonpath()
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "TRITON_INTERPRET=1 was set after triton was imported" in done.stderr
    assert "above `import tilegen`" in done.stderr


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("0", False), ("", False), (None, False)])
def test_tilegen_debug_follows_the_environment_as_it_changes(monkeypatch, value, on):
    from tilegen import env

    if value is None:
        monkeypatch.delenv("TILEGEN_DEBUG", raising=False)
    else:
        monkeypatch.setenv("TILEGEN_DEBUG", value)
    assert env.debug() is on
