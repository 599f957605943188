"""Direct launches of compiled kernels (``tilegen.triton_internals.launch``).

The launches themselves are checked in a process of their own, compiled for sm90 with no GPU
(``direct_launch_check.py``): every call of the ops' hot paths against the generated launcher
through ``JITFunction.run`` on the same arguments, and which calls go through the JIT. Here,
in the interpreter's process: the interpreter always takes the JIT's path, a Triton whose
internals are not recognised does too, and the fingerprint's model of Triton's
specialization agrees with Triton's own on the values that decide it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

import tilegen
from tilegen import dispatch
from tilegen.triton_internals import launch
from tilegen.codegen import module_for
from tilegen.families.attention_fwd import AttentionSpec

SPEC = AttentionSpec(head_dim=64, dtype="bf16", mask="none")
#: The Triton versions whose launch path tilegen.triton_internals.launch was written against.
KNOWN = {"3.6.0", "3.7.0", "3.7.1", "3.8.0", "3.9.0"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks against a fake driver; a GPU runs the real launches")
def test_direct_launches_match_the_jit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TILEGEN_CACHE_DIR"] = str(tmp_path / "cache")
    env["TILEGEN_DB"] = str(tmp_path / "tuning.sqlite")
    script = Path(__file__).with_name("direct_launch_check.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    if "not recognised" in done.stdout:
        assert triton.__version__ not in KNOWN
        pytest.skip(f"Triton {triton.__version__}: every launch goes through the JIT")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for case in ("dense", "dense_decode", "paged_decode", "paged_prefill", "small_ops", "jit_only", "disagreement",
                 "state", "direct_kernel", "tma"):
        assert f"ok {case} " in done.stdout


@pytest.mark.slow
def test_a_new_process_finds_checked_kernels_without_the_jit(tmp_path):
    """The kernel index: a second process launches what the first checked, from Triton's cache."""
    if torch.cuda.is_available():
        pytest.skip("the fake driver stands in for a GPU only where there is none")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TILEGEN_CACHE_DIR=str(tmp_path / "cache"), TILEGEN_DB=str(tmp_path / "tuning.sqlite"),
               TRITON_CACHE_DIR=str(tmp_path / "triton"))
    script = Path(__file__).with_name("kernel_index_check.py")

    def run(phase):
        done = subprocess.run([sys.executable, str(script), phase], env=env, capture_output=True, text=True,
                              timeout=600, check=False)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        return done.stdout

    first = run("record")
    if "not recognised" in first:
        pytest.skip(f"Triton {triton.__version__}: every launch goes through the JIT")
    assert "ok record" in first
    assert list((tmp_path / "cache" / "kernels").glob("*.pkl"))
    assert "ok reuse 0" in run("reuse")
    # Kernels gone from Triton's cache: the index is no help, and the JIT compiles them again.
    shutil.rmtree(tmp_path / "triton")
    assert "ok record" in run("record")


def test_the_interpreter_takes_the_jit_path(device):
    if device != "cpu":
        pytest.skip("the interpreter runs without a GPU only")
    launcher = dispatch.launcher_for(SPEC)
    assert "interpreter" in launch.support()
    assert launcher.direct is module_for(SPEC).launch
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    expected = tilegen.attention(q, k, v)
    torch.testing.assert_close(tilegen.attention(q, k, v), expected, rtol=0, atol=0)


def test_installed_triton_is_recognised_by_its_internals():
    found = launch._internals()
    assert isinstance(found, launch._Variant) == (triton.__version__ in KNOWN), found
    if isinstance(found, launch._Variant):
        assert triton.__version__ in found.versions


def test_unknown_triton_internals_fall_back(monkeypatch):
    monkeypatch.setattr(launch, "_VARIANTS", {})
    launch._internals.cache_clear()
    try:
        reason = launch._internals()
        assert isinstance(reason, str) and "JITFunction.run is not one this module knows" in reason
    finally:
        launch._internals.cache_clear()


class _Fingerprinting:
    """What ``DirectKernel._fingerprint`` reads of its kernel: no constexpr parameters, no debug."""

    constexpr = frozenset()
    fn = types.SimpleNamespace(debug=False)


class _Param:
    """The flags of a kernel parameter that Triton's specialization reads."""

    def __init__(self, specialize=True, align=True, constexpr=False):
        self.do_not_specialize = not specialize
        self.do_not_specialize_on_alignment = not align
        self.is_constexpr = constexpr


INTS = [0, 1, 2, 15, 16, 17, -1, -16, 48, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1, (1 << 63) - 16,
        1 << 63, (1 << 64) - 1]


@pytest.mark.parametrize("flags", [(True, True), (True, False), (False, True)])
def test_fingerprint_model_agrees_with_triton(flags):
    """``_agrees`` is what lets an entry be kept: it must accept Triton's own specialization of
    every kind of value the fingerprint classifies, and the fingerprint must separate values
    that Triton specializes differently."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    specialize, align = flags
    param = _Param(specialize, align)
    base = torch.empty(64, dtype=torch.bfloat16)
    tile = torch.empty(64, 64, dtype=torch.float16)
    descriptors = [TensorDescriptor(tile, [64, 64], [64, 1], [16, 64]), TensorDescriptor(tile, [64, 64], [64, 1], [32, 32])]
    values = INTS + [0.5, 1.0, True, False, None, base, base[1:], base[8:], torch.empty(4, dtype=torch.int32),
                     *descriptors]
    by_class = {}
    for value in values:
        spec = native_specialize_impl(BaseBackend, value, False, specialize, align)
        assert launch._agrees(param, value, spec), (value, spec)
        if value.__class__ is int:
            by_class.setdefault(launch._int_class(value), set()).add(spec)
    assert all(len(specs) == 1 for specs in by_class.values()), by_class
    # Descriptors that differ in block shape are specialized apart, and the fingerprint tells them apart.
    specs = [native_specialize_impl(BaseBackend, d, False, specialize, align) for d in descriptors]
    assert specs[0] != specs[1]
    assert len({launch.DirectKernel._fingerprint(_Fingerprinting, (1,), (d,), {}) for d in descriptors}) == 2



def _twice(monkeypatch, make):
    """``make()`` plans and returns a call: its results with direct launches (three calls: the
    first records, the others replay) and through the JIT."""
    from tilegen import dispatch

    dispatch.launcher_for.cache_clear()
    call = make()
    direct = [call() for _ in range(3)]
    monkeypatch.setenv("TILEGEN_DIRECT_LAUNCH", "0")
    dispatch.reset()
    dispatch.launcher_for.cache_clear()
    try:
        return direct, make()()
    finally:
        monkeypatch.delenv("TILEGEN_DIRECT_LAUNCH")
        dispatch.reset()
        dispatch.launcher_for.cache_clear()


@pytest.mark.gpu
def test_direct_launches_on_the_gpu_give_the_jits_results(monkeypatch):
    if triton.__version__ in KNOWN:
        assert launch.support() is None, launch.support()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, offset=0):
        flat = torch.randn(offset + torch.Size(shape).numel(), device="cuda", generator=gen, dtype=torch.bfloat16)
        return flat[offset:].view(*shape)

    q, k, v = rand(1, 8, 16, 64), rand(1, 8, 16, 64), rand(1, 8, 16, 64)
    q_odd = rand(1, 8, 16, 64, offset=1)  # 2 bytes past a 16-byte boundary
    for inputs in ((q, k, v), (q_odd, k, v), (rand(2, 32, 1, 128), rand(2, 8, 300, 128), rand(2, 8, 300, 128))):
        direct, jit = _twice(monkeypatch, lambda inputs=inputs: lambda: tilegen.attention(*inputs, causal=True))
        for result in direct:
            torch.testing.assert_close(result, jit, rtol=0, atol=0)

    pages = 64
    cache = tilegen.PagedKVCache(
        rand(pages, 16, 8, 128), rand(pages, 16, 8, 128), torch.tensor([0, 3, 40], dtype=torch.int32, device="cuda"),
        torch.randperm(pages, device="cuda")[:40].to(torch.int32),
        torch.tensor([5, 16], dtype=torch.int32, device="cuda"))
    q_run = rand(2, 32, 128)
    for splits in (1, 5):
        def make(splits=splits):
            decode = tilegen.PagedDecode()
            decode.plan(cache, heads_q=32, num_splits=splits, return_lse=True)
            return lambda: decode.run(q_run, cache)

        direct, (out, lse) = _twice(monkeypatch, make)
        for result, result_lse in direct:
            torch.testing.assert_close(result, out, rtol=0, atol=0)
            torch.testing.assert_close(result_lse, lse, rtol=0, atol=0)
