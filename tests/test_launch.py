"""Direct launches of compiled kernels (``tilegen.triton_internals.launch``).

The launches themselves are checked in a process of their own, compiled for sm90 with no GPU
(``direct_launch_check.py``): every call of the ops' hot paths against the generated launcher
through ``JITFunction.run`` on the same arguments, and which calls go through the JIT; on a
Triton whose internals are not recognised, every op's launches through the JIT (that Triton,
or one that shows the gate a ``JITFunction.run`` it does not know). Here, in the interpreter's
process: the interpreter always takes the JIT's path, and the fingerprint's model of Triton's
specialization agrees with Triton's own on the values that decide it.
"""

from __future__ import annotations

import json
import os
import pickle
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
from tilegen import dispatch, env
from tilegen.codegen import module_for
from tilegen.triton_internals import gate, launch
from tilegen.families.attention_fwd import AttentionSpec

SPEC = AttentionSpec(head_dim=64, dtype="bf16", mask="none")
#: The Triton versions whose launch path tilegen.triton_internals.launch was written against.
KNOWN = {"3.6.0", "3.7.0", "3.7.1", "3.8.0", "3.9.0"}


def _fake_cuda(tmp_path, script: str, *args: str, **env_vars: str) -> str:
    """Run ``tests/<script>`` in a process of its own on ``fake_cuda``; its output."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(TILEGEN_CACHE_DIR=str(tmp_path / "cache"), TILEGEN_DB=str(tmp_path / "tuning.sqlite"), **env_vars)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), *args], env=environ,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout + done.stderr


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks against a fake driver; a GPU runs the real launches")


@no_gpu
def test_direct_launches_match_the_jit(tmp_path):
    out = _fake_cuda(tmp_path, "direct_launch_check.py")
    if "not recognised" in out:
        # This Triton is not one tilegen knows: the check ran every op through the JIT instead.
        assert triton.__version__ not in KNOWN
        assert "ok unrecognised" in out
        return
    for case in ("dense", "causal", "dense_decode", "paged_decode", "paged_prefill", "small_ops", "jit_only", "disagreement",
                 "state", "direct_kernel", "tma", "gluon"):
        assert f"ok {case} " in out


@no_gpu
def test_a_triton_with_a_jit_run_tilegen_does_not_know_runs_every_op_through_the_jit(tmp_path):
    """What the gate sees changed, not its answer: ``JITFunction.run`` is wrapped before tilegen
    looks, so its source is one tilegen does not know, as a new Triton's would be."""
    out = _fake_cuda(tmp_path, "direct_launch_check.py", FAKE_CUDA_UNKNOWN_TRITON="1")
    assert "not recognised: Triton" in out and "JITFunction.run is not one tilegen knows" in out, out
    assert "ok unrecognised" in out
    assert "compile-ahead is off" in out  # said once, in the log


def _index_phases(tmp_path):
    """``run(phase, *args)`` of ``kernel_index_check.py`` against one tilegen and one Triton cache."""
    if torch.cuda.is_available():
        pytest.skip("the fake driver stands in for a GPU only where there is none")

    def run(phase, *args):
        return _fake_cuda(tmp_path, "kernel_index_check.py", phase, *args, TRITON_CACHE_DIR=str(tmp_path / "triton"))

    return run


@pytest.mark.slow
def test_a_new_process_finds_checked_kernels_without_the_jit(tmp_path):
    """The kernel index: a second process launches what the first checked, from Triton's cache."""
    run = _index_phases(tmp_path)
    first = run("record")
    if "not recognised" in first:
        pytest.skip(f"Triton {triton.__version__}: the index is unused (test_direct_launches_match_the_jit "
                    f"checks every op goes through the JIT)")
    assert "ok record" in first
    records = list((tmp_path / "cache" / "kernels").glob("*.json"))
    assert records and all(r.stat().st_mode & 0o777 == 0o600 for r in records)
    assert (tmp_path / "cache" / "kernels").stat().st_mode & 0o777 == 0o700
    assert "ok reuse 0" in run("reuse")
    # Kernels gone from Triton's cache: the index is no help, and the JIT compiles them again.
    shutil.rmtree(tmp_path / "triton")
    assert "ok record" in run("record")


class _Opens:
    """Unpickled, it creates a file: a record that is a pickle must never be unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _spoilers(tmp_path):
    """Ways to spoil one record, each of which must send its kernel through the JIT."""
    def rewrite(change):
        def spoil(path):
            record = json.loads(path.read_text())
            change(record)
            path.write_text(json.dumps(record))
        return spoil

    def wrong_types(record):
        record["constexprs"] = [[str(k[0]), v] for k, v in record["constexprs"]] or [["0", 1]]

    def gone(path):
        from triton.runtime.cache import _base32  # how Triton names a kernel's folder in its cache

        shutil.rmtree(tmp_path / "triton" / _base32(json.loads(path.read_text())["hash"]))

    return {
        "garbage": lambda path: path.write_bytes(b"\x80\x04\x95garbage\xff"),
        "another layout": rewrite(lambda record: record.update(layout=1)),
        "a key missing": rewrite(lambda record: record.pop("attrs")),
        "wrong types": rewrite(wrong_types),
        "a pickle": lambda path: path.write_bytes(pickle.dumps(_Opens(tmp_path / "unpickled"))),
        "kernel gone from Triton's cache": gone,
        "writable by others": lambda path: path.chmod(0o666),
    }


@pytest.mark.slow
def test_spoilt_kernel_index_records_send_their_kernels_through_the_jit(tmp_path):
    """Each record spoilt one way: every kernel goes through the JIT again, its launches the JIT's
    (kernel_index_check compares each call with the generated launcher's), and the records are
    written afresh; a cache folder others can write is not read at all."""
    run = _index_phases(tmp_path)
    first = run("record")
    if "not recognised" in first:
        pytest.skip(f"Triton {triton.__version__}: the index is unused")
    per_call = next(line for line in first.splitlines() if line.startswith("{"))  # record's JSON line
    index = tmp_path / "cache" / "kernels"
    records = sorted(index.glob("*.json"))
    assert len(records) >= 4, records  # the calls' kernels
    pending, said = list(_spoilers(tmp_path).values()), ""
    while pending:  # as many rounds as it takes to use each spoiler; every record spoilt in each
        spoilers, pending = pending[:len(records)], pending[len(records):]
        for i, path in enumerate(records):
            spoilers[i % len(spoilers)](path)
        said += run("fallback", per_call)
        assert "ok fallback" in said
        assert not (tmp_path / "unpickled").exists()
        assert sorted(index.glob("*.json")) == records
        assert all(r.stat().st_mode & 0o777 == 0o600 for r in records)  # replaced by good ones
    assert "not reading a kernel index record" in said and "writable by other users" in said
    index.chmod(0o777)
    out = run("fallback", per_call)
    assert "not using the kernel index" in out
    index.chmod(0o700)
    assert "ok reuse 0" in run("reuse")  # the records the fallback wrote are good


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
    found = gate.internals()
    assert isinstance(found, gate.Variant) == (triton.__version__ in KNOWN), found
    if isinstance(found, gate.Variant):
        assert triton.__version__ in found.versions


@pytest.fixture
def unknown_triton(monkeypatch):
    """Triton with ``JITFunction.run`` wrapped, a source the gate does not know; looked at afresh."""
    from triton.runtime import jit

    run = jit.JITFunction.run

    def wrapped(self, *args, **kwargs):
        return run(self, *args, **kwargs)

    monkeypatch.setattr(jit.JITFunction, "run", wrapped)
    gate.forget()
    dispatch.launcher_for.cache_clear()
    yield
    monkeypatch.undo()
    gate.forget()
    dispatch.launcher_for.cache_clear()


def test_the_gate_does_not_know_a_wrapped_jit_run(unknown_triton, monkeypatch):
    from triton.runtime import cache as triton_cache

    from tilegen.triton_internals import compile_only, kernel_index, warmup

    reason = gate.reason()
    assert "JITFunction.run is not one tilegen knows" in reason
    assert launch.support() == ("Triton's interpreter runs the kernels" if env.interpreting() else reason)
    assert compile_only.support() == f"compile-ahead is off: {reason}"
    assert kernel_index.load(None, 0, ()) is None  # the gate is asked before anything of the kernel is read
    hashed = []
    monkeypatch.setattr(triton_cache, "triton_key", lambda: hashed.append(1))
    warmup._work()
    assert not hashed, "the warm-up hashed Triton's sources for a Triton it does not know"


def test_an_unknown_triton_gives_every_op_the_right_answer(unknown_triton, device):
    """End to end with the gate saying no: each op's result against torch's."""
    from tilegen.tuning.compile_ahead import CompileAhead

    assert gate.reason() is not None
    assert CompileAhead(2).processes == 0
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=gen, device=device).to(dtype)  # noqa: E731
    q, k, v = (rand(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(tilegen.attention(q, k, v, causal=True).float(), want, rtol=2e-2, atol=2e-2)
    x, cos, sin = rand(5, 2, 64), rand(5, 64), rand(5, 64)
    rotated = torch.cat([-x[..., 32:], x[..., :32]], dim=-1)
    torch.testing.assert_close(tilegen.apply_rope(x, cos, sin), x * cos[:, None] + rotated * sin[:, None],
                               rtol=1e-5, atol=1e-5)
    o_a, o_b, lse_a, lse_b = rand(5, 2, 64), rand(5, 2, 64), rand(5, 2), rand(5, 2)
    lse = torch.logaddexp(lse_a, lse_b)
    o, got_lse = tilegen.merge_states(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(got_lse, lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o, (lse_a - lse).exp()[..., None] * o_a + (lse_b - lse).exp()[..., None] * o_b,
                               rtol=1e-5, atol=1e-5)
    pages = torch.zeros(4, 16, 1, 64, device=device)
    cache = tilegen.PagedKVCache(pages, pages.clone(), torch.tensor([0, 2], dtype=torch.int32, device=device),
                                 torch.tensor([3, 1], dtype=torch.int32, device=device),
                                 torch.tensor([4], dtype=torch.int32, device=device))
    new_k, new_v = rand(3, 1, 64), rand(3, 1, 64)
    tilegen.append_kv(cache, new_k, new_v, torch.tensor([0, 3], dtype=torch.int32, device=device))
    torch.testing.assert_close(cache.k_pages[1, 1:4], new_k)  # tokens 17..19 of 20: the second page's 1..3
    torch.testing.assert_close(cache.v_pages[1, 1:4], new_v)


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
    if gate.reason() is not None:
        pytest.skip(f"the model serves direct launches only, off here: {gate.reason()}")
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


_GPU_PROCESS = """
import json, torch
from triton.runtime import jit
import tilegen
from tilegen.triton_internals import gate

gate.internals()  # looked at before the counting wrapper below, as the unwrapped Triton is the one to recognise
runs, run = [0], jit.JITFunction.run


def counting(self, *args, **kwargs):
    runs[0] += 1
    return run(self, *args, **kwargs)


jit.JITFunction.run = counting
gen = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
out = tilegen.attention(q, k, v, causal=True)
print(json.dumps({"runs": runs[0], "out": out.float().sum().item()}))
"""


@pytest.mark.gpu
def test_on_the_gpu_a_new_process_launches_from_json_records_and_falls_back_past_spoilt_ones(tmp_path):
    if not isinstance(gate.internals(), gate.Variant):
        pytest.skip(f"Triton {triton.__version__}: the index is unused")
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(TILEGEN_CACHE_DIR=str(tmp_path / "cache"), TRITON_CACHE_DIR=str(tmp_path / "triton"),
                   TILEGEN_DB=str(tmp_path / "tuning.sqlite"))

    def run():
        done = subprocess.run([sys.executable, "-c", _GPU_PROCESS], env=environ, capture_output=True, text=True,
                              timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run()
    assert first["runs"] >= 1
    records = list((tmp_path / "cache" / "kernels").glob("*.json"))
    assert records and all(r.stat().st_mode & 0o777 == 0o600 for r in records)
    assert run() == {**first, "runs": 0}  # from the index: no launch through the JIT, the same result
    for path in records:
        path.write_text("[]")
    assert run() == first  # every record refused: through the JIT as in the first process


def test_only_helpers_that_cannot_reach_a_kernel_keep_a_launcher_replayable(device):
    """A launcher's own helper functions run during a capture; one that could launch out of the capture's
    sight (naming a kernel, a module, or a builtin that reaches any object) makes the launcher unreplayable."""
    import types

    from tilegen.codegen import module_for
    from tilegen.families.attention_fwd.spec import AttentionSpec
    from tilegen.families.attention_varlen import VarlenAttentionSpec
    from tilegen.triton_internals.launch import _host_only, replayable

    causal = module_for(AttentionSpec(head_dim=64, dtype="bf16", mask="causal"))
    assert _host_only(causal, causal._tile_schedule)
    # The ragged and paged launchers with their Gluon branch (written into launch for this): a short call's
    # pointer kernel is replayed (36.7 against 20.8 us of host time a call on the H200 while it was not).
    for layout in ({}, {"kv_layout": "paged", "page_size": 16}):
        module = module_for(VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", **layout))
        assert hasattr(module, "_SMEM_LAYOUTS") and replayable(module), layout

    module = types.ModuleType("generated")
    exec(
        "import math\n"
        "LIMIT = 4\n"
        "kernel = object()\n"
        "def pure(n): return [min(i, LIMIT) for i in range(n)]\n"
        "def nested(n): return pure(n) + pure(n + 1)\n"
        "def launches(n): return kernel\n"
        "def through(n): return launches(n)\n"
        "def via_module(n): return math.floor(n)\n"
        "def via_getattr(n): return getattr(n, 'real')\n"
        "PAIR = (1, 'a')\n"
        "KERNELS = (kernel, 2)\n"
        "def via_tuple(n): return PAIR[n % 2]\n"
        "def via_kernel_tuple(n): return KERNELS[0]\n"
        "def recursive(n): return recursive(n - 1) if n else 0\n"
        "def launch(n): return [through(i) for i in range(n)]\n",
        vars(module),
    )
    assert not replayable(module), "a helper that reaches a kernel from inside a comprehension still counts"
    verdicts = {name: _host_only(module, getattr(module, name))
                for name in ("pure", "nested", "launches", "through", "via_module", "via_getattr", "recursive",
                             "via_tuple", "via_kernel_tuple")}
    assert verdicts == {"pure": True, "nested": True, "launches": False, "through": False, "via_module": False,
                        "via_getattr": False, "recursive": True, "via_tuple": True, "via_kernel_tuple": False}
