"""The kernel index across processes, with kernels compiled for sm90 and no GPU (``fake_cuda``).

    python tests/kernel_index_check.py record|reuse|fallback

Run twice with one TILEGEN_CACHE_DIR and one TRITON_CACHE_DIR (``tests/test_launch.py`` does):
``record`` makes each call's first launch through the JIT, ``reuse`` (a new process) must make
none, loading the kernels the index names from Triton's cache; ``fallback``, after the records
were spoilt, must make as many as ``record`` did, every kernel's record refused. Every call's
launches are also compared with the generated launcher's through the JIT on the same
arguments (``direct_launch_check``). Prints ``ok <phase> <JIT launches>`` and, for ``record``,
a JSON line of each call's.
"""

from __future__ import annotations

import json
import sys

import direct_launch_check as check  # the fake driver, and launches compared with the JIT's
from fake_cuda import INTERNALS

import tilegen
from tilegen import dispatch
from tilegen.codegen import module_for
from tilegen.triton_internals import gate
from tilegen.triton_internals.launch import DirectKernel
from tilegen.families.attention_fwd import AttentionSpec


def calls():
    decode = tilegen.PagedDecode()
    decode.plan(check._cache(), heads_q=8, num_splits=3, return_lse=True)
    bf16 = check.bf16
    # A spec no other call here uses: the index serves only a kernel the JIT has not compiled in this process.
    spec = AttentionSpec(head_dim=64, dtype="bf16", mask="causal")
    module_for(spec).TMA_MIN_WORK = 0  # these shapes are far below the launcher's floor for descriptors
    launcher = dispatch.launcher_for(spec)
    tma = {**check.LAUNCH_KWARGS, "window_right": 0, "tma": 1}  # causal: no key right of the diagonal
    return [
        ("dense", lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64))),
        ("dense causal lse", lambda: tilegen.attention(bf16(1, 8, 40, 64), bf16(1, 8, 40, 64), bf16(1, 8, 40, 64),
                                                       causal=True, return_lse=True)),
        ("decode route", lambda: tilegen.attention(bf16(2, 8, 2, 64), bf16(2, 2, 40, 64), bf16(2, 2, 40, 64),
                                                   causal=True)),
        ("paged decode, split", lambda: decode.run(bf16(2, 8, 64), check._cache())),
        ("dense through TMA descriptors", lambda: launcher.direct(*(bf16(1, 8, 40, 64) for _ in range(4)),
                                                                  bf16(1, 8, 40), **tma)),
    ] + _gluon()


_GLUON = {}


def _gluon():
    """A Gluon kernel on Gluon's descriptors, where this Triton has Gluon's Hopper API."""
    import gluon_copy

    if gluon_copy.KERNEL is None:
        return []
    kernel = _GLUON.setdefault("kernel", DirectKernel(gluon_copy.KERNEL, gate.internals()))

    def call():
        src, dst = gluon_copy.descriptors(48)
        kernel[(3, )](src, dst, 0.5, 48, BLOCK=16, num_warps=4)

    return [("gluon kernel on gluon descriptors", call)]


if __name__ == "__main__":
    if not isinstance(INTERNALS, gate.Variant):
        print("not recognised:", INTERNALS)
        sys.exit(0)
    phase = sys.argv[1]
    check.fresh()
    total, per_call = 0, {}
    for name, call in calls():
        runs = per_call[name] = check.jit_runs(call)
        total += runs
        if phase == "reuse":
            assert runs == 0, f"{name}: {runs} launches through the JIT in a process that should find them indexed"
        elif phase == "fallback":
            want = json.loads(sys.argv[2])[name]
            assert runs == want, f"{name}: {runs} launches through the JIT where every record is spoilt, not {want}"
        else:
            assert runs >= 1, f"{name}: no launch through the JIT in a fresh cache"
        # A second call replays what the first recorded.
        assert check.jit_runs(call) == 0, f"{name}: the second call went through the JIT"
    assert check.CHECKED[0] >= 8, check.CHECKED[0]
    if phase == "record":
        print(json.dumps(per_call))
    print("ok", phase, total, flush=True)
