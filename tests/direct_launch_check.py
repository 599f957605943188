"""Direct launches against Triton's JIT, with kernels compiled for sm90 and no GPU (``fake_cuda``).

    python tests/direct_launch_check.py [case ...]

Run without TRITON_INTERPRET (``tests/test_launch.py`` does, once per case). Every op call
made here is checked twice: its launches must be exactly those that the generated launcher
makes through ``JITFunction.run`` on the same arguments, and each call must go through the
JIT only when something that decides the specialization is new (counted, and asserted per
call). Prints one ``ok <case>`` line per case.

On a Triton whose internals tilegen does not recognise (a real one, or ``fake_cuda``'s
``FAKE_CUDA_UNKNOWN_TRITON=1``) it runs the ``unrecognised`` case alone: every op, every
launch through the JIT, and none of the other pieces at work.
"""

from __future__ import annotations

import os
import sys

import fake_cuda  # before tilegen's kernels: the fake driver and the recording launcher
import torch
from fake_cuda import JIT_FUSION, JIT_RUNS, LAUNCHES

import tilegen
from tilegen import dispatch, env
from tilegen.codegen import module_for
from tilegen.triton_internals import gate, launch

_replay_call = launch.Replay.__call__
CHECKED = [0]


def _checked_call(self, key, *args):
    """The replay's launches, then the JIT's on the same arguments: they must be equal."""
    start = len(LAUNCHES)
    _replay_call(self, key, *args)
    got = LAUNCHES[start:]
    del LAUNCHES[start:]
    given = [self.views[i](a) if i in self.views else a for i, a in enumerate(args)]
    runs, fusion = JIT_RUNS[0], len(JIT_FUSION)
    self.launcher.jit(*given, **self.kwargs)
    JIT_RUNS[0] = runs  # the reference launch is not the op's
    del JIT_FUSION[fusion:]
    want = LAUNCHES[start:]
    del LAUNCHES[start:]
    assert got == want, f"direct launches differ from the JIT's:\n{got}\n{want}"
    assert got, "no launch recorded"
    CHECKED[0] += 1


launch.Replay.__call__ = _checked_call


def jit_runs(call) -> int:
    """How many launches of ``call`` went through JITFunction.run; each must have passed tilegen's compile
    options (``launch.OPTIONS``), not left them to Triton's defaults."""
    before, fusion = JIT_RUNS[0], len(JIT_FUSION)
    call()
    assert all(f is True for f in JIT_FUSION[fusion:]), f"JIT runs without enable_fp_fusion=True: {JIT_FUSION[fusion:]}"
    return JIT_RUNS[0] - before


def fresh(direct: bool = True) -> None:
    os.environ["TILEGEN_DIRECT_LAUNCH"] = "1" if direct else "0"
    dispatch.reset()
    dispatch.launcher_for.cache_clear()


def bf16(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


def misaligned(*shape):
    """A tensor whose data pointer is 2 bytes past a 16-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    return bf16(n + 1)[1:].view(*shape)


def case_dense() -> None:
    """tilegen.attention: repeats replay; new alignment or int classes go through the JIT once."""
    fresh()
    out = bf16(1, 8, 16, 64)
    calls = [
        ("first call", lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64)), 1),
        ("new tensors", lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64)), 0),
        ("out=", lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), out=out), 0),
        ("misaligned q", lambda: tilegen.attention(misaligned(1, 8, 16, 64), bf16(1, 8, 16, 64),
                                                   bf16(1, 8, 16, 64)), 1),
        ("misaligned q again", lambda: tilegen.attention(misaligned(1, 8, 16, 64), bf16(1, 8, 16, 64),
                                                         bf16(1, 8, 16, 64)), 0),
        ("aligned again", lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64)), 0),
        # Other strides of the same classes (multiples of 16, unit head dim): the kernel compiled already.
        ("heads-major k", lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 16, 8, 64).transpose(1, 2),
                                                    bf16(1, 8, 16, 64)), 0),
        # A head-dim stride of 2 is no longer the constant 1.
        ("strided head dim", lambda: tilegen.attention(bf16(1, 8, 16, 128)[..., ::2], bf16(1, 8, 16, 64),
                                                       bf16(1, 8, 16, 64)), 1),
        ("return_lse", lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64),
                                                 return_lse=True), 1),
        ("return_lse again", lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64),
                                                       return_lse=True), 0),
    ]
    for name, call, expected in calls:
        got = jit_runs(call)
        assert got == expected, f"{name}: {got} launches through the JIT, expected {expected}"


def case_causal() -> None:
    """A causal launcher calls a helper of its module (the tile schedule's host arithmetic): its calls replay
    all the same, with no launcher Python after the first."""
    fresh()
    replayed = [0]
    original = launch._Recording.replay

    def counting(self, *args):
        done = original(self, *args)
        replayed[0] += bool(done)
        return done

    launch._Recording.replay = counting
    try:
        for _ in range(3):
            tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), causal=True)
    finally:
        launch._Recording.replay = original
    assert replayed[0] == 2, f"{replayed[0]} of the two repeated causal calls replayed"


def case_dense_decode() -> None:
    """tilegen.attention with a few query rows goes to the decode kernel: replayed too."""
    fresh()
    for expected in (1, 0, 0):
        got = jit_runs(lambda: tilegen.attention(bf16(2, 8, 2, 64), bf16(2, 2, 40, 64), bf16(2, 2, 40, 64),
                                                 causal=True))
        assert got == expected, (got, expected)


def _cache(batch=2, kv_heads=2, page=16, pages=8, dim=64):
    k, v = bf16(pages, page, kv_heads, dim), bf16(pages, page, kv_heads, dim)
    indptr = torch.tensor([0, 3, 5][: batch + 1], dtype=torch.int32)
    indices = torch.tensor([4, 1, 6, 0, 2], dtype=torch.int32)
    last = torch.tensor([7, 16][:batch], dtype=torch.int32)
    return tilegen.PagedKVCache(k, v, indptr, indices, last)


def case_paged_decode() -> None:
    """PagedDecode.run, split (two kernels per call) and not, across layers' caches."""
    for splits in (1, 3):
        fresh()
        decode = tilegen.PagedDecode()
        decode.plan(_cache(), heads_q=8, num_splits=splits, return_lse=True)
        for layer, expected in enumerate((1 + (splits > 1), 0, 0)):
            got = jit_runs(lambda decode=decode: decode.run(bf16(2, 8, 64), _cache()))
            assert got == expected, (splits, layer, got, expected)
        got = jit_runs(lambda decode=decode: decode.run(misaligned(2, 8, 64), _cache()))
        assert got == 1, got


def case_paged_prefill() -> None:
    """PagedAttention.run (chunked prefill over the paged cache)."""
    fresh()
    attn = tilegen.PagedAttention()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    attn.plan(cu, _cache(), heads_q=8, causal=True, max_seqlen_q=4, max_seqlen_k=48)
    for expected in (1, 0, 0):
        got = jit_runs(lambda: attn.run(bf16(7, 8, 64), _cache()))
        assert got == expected, (got, expected)


def case_small_ops() -> None:
    """rope, merge_states and append_kv replay like attention: new strides or alignment go through the JIT once."""
    fresh()
    x, cos, sin = bf16(17, 3, 64), torch.randn(17, 64), torch.randn(17, 64)
    o, lse = bf16(17, 3, 64), torch.randn(17, 3)
    cache = _cache()
    k, v, cu = bf16(5, 2, 64), bf16(5, 2, 64), torch.tensor([0, 2, 5], dtype=torch.int32)
    calls = [
        ("rope", lambda: tilegen.apply_rope(bf16(17, 3, 64), cos, sin), 1),
        ("rope again", lambda: tilegen.apply_rope(bf16(17, 3, 64), cos, sin), 0),
        ("rope in place", lambda: tilegen.apply_rope(x, cos, sin, out=x), 0),
        ("rope, heads-major x", lambda: tilegen.apply_rope(bf16(3, 17, 64).transpose(0, 1), cos, sin), 0),
        ("rope, misaligned x", lambda: tilegen.apply_rope(misaligned(17, 3, 64), cos, sin), 1),
        ("merge", lambda: tilegen.merge_states(bf16(17, 3, 64), lse, o, torch.randn(17, 3)), 1),
        ("merge again", lambda: tilegen.merge_states(bf16(17, 3, 64), lse, o, torch.randn(17, 3)), 0),
        ("merge into o_a", lambda: tilegen.merge_states(o, lse, bf16(17, 3, 64), torch.randn(17, 3), out=o), 0),
        ("append", lambda: tilegen.append_kv(cache, k, v, cu), 1),
        ("append, other tokens", lambda: tilegen.append_kv(_cache(), bf16(5, 2, 64), bf16(5, 2, 64), cu), 0),
    ]
    for name, call, expected in calls:
        got = jit_runs(call)
        assert got == expected, f"{name}: {got} launches through the JIT, expected {expected}"


def case_mods() -> None:
    """A call with a score mod launches through the generated launcher's JIT path, on every call (its captured tensors
    are arguments), with tilegen's compile options as every other launch."""
    fresh()

    def bias(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) * 0.125

    q, k, v = bf16(1, 4, 16, 64), bf16(1, 2, 16, 64), bf16(1, 2, 16, 64)
    for _ in range(2):
        assert jit_runs(lambda: tilegen.attention(q, k, v, causal=True, score_mod=bias)) == 1


def case_jit_only() -> None:
    """TILEGEN_DIRECT_LAUNCH=0: every launch through the JIT."""
    fresh(direct=False)
    # The generated launcher's own code, its kernels passing tilegen's compile options.
    assert dispatch.launcher_for(_spec()).direct.__code__ is dispatch.launcher_for(_spec()).jit.__code__
    for _ in range(3):
        assert jit_runs(lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64))) == 1
    fresh()
    assert launch.support() is None


def unrecognised() -> None:
    """A Triton whose internals tilegen does not know: every op's every launch goes through
    ``JITFunction.run``, no kernel is launched directly, the kernel index records nothing, the
    warm-up does none of its work and compile-ahead starts no process."""
    from triton.runtime import cache as triton_cache

    from tilegen.triton_internals import compile_only, warmup
    from tilegen.tuning.compile_ahead import CompileAhead

    reason = gate.reason()
    assert reason and launch.support() == reason, (reason, launch.support())
    warmup.wait()
    if hasattr(triton_cache.triton_key, "cache_info"):  # nothing else has launched yet
        assert triton_cache.triton_key.cache_info().currsize == 0, "the warm-up ran on an unrecognised Triton"
    assert CompileAhead(2).processes == 0
    try:
        compile_only.enable()
    except RuntimeError as error:
        assert reason in str(error)
    else:
        raise AssertionError("compile-only mode enabled on an unrecognised Triton")

    launch.Replay.__call__ = _replay_call  # launches counted as made, not compared (and removed) by _checked_call
    fresh()
    # The generated launcher's own code, its kernels passing tilegen's compile options.
    assert dispatch.launcher_for(_spec()).direct.__code__ is dispatch.launcher_for(_spec()).jit.__code__
    decode = tilegen.PagedDecode()
    decode.plan(_cache(), heads_q=8, num_splits=3, return_lse=True)
    prefill = tilegen.PagedAttention()
    prefill.plan(torch.tensor([0, 3, 7], dtype=torch.int32), _cache(), heads_q=8, causal=True, max_seqlen_q=4,
                 max_seqlen_k=48)
    fp32 = lambda *shape: torch.randn(*shape)  # noqa: E731
    calls = {
        "dense": lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64)),
        "dense causal lse": lambda: tilegen.attention(bf16(1, 8, 40, 64), bf16(1, 8, 40, 64), bf16(1, 8, 40, 64),
                                                      causal=True, return_lse=True),
        "decode route": lambda: tilegen.attention(bf16(2, 8, 2, 64), bf16(2, 2, 40, 64), bf16(2, 2, 40, 64),
                                                  causal=True),
        "paged decode, split": lambda: decode.run(bf16(2, 8, 64), _cache()),
        "paged prefill": lambda: prefill.run(bf16(7, 8, 64), _cache()),
        "rope": lambda: tilegen.apply_rope(bf16(5, 8, 64), fp32(5, 64), fp32(5, 64)),
        "merge": lambda: tilegen.merge_states(bf16(5, 8, 64), fp32(5, 8), bf16(5, 8, 64), fp32(5, 8)),
        "kv append": lambda: tilegen.append_kv(_cache(), bf16(3, 2, 64), bf16(3, 2, 64),
                                               torch.tensor([0, 2, 3], dtype=torch.int32)),
    }
    for name, call in calls.items():
        for time in ("first", "again"):
            launches = len(LAUNCHES)
            runs = jit_runs(call)
            made = len(LAUNCHES) - launches
            assert made >= 1 and runs == made, f"{name} ({time}): {made} launches, {runs} through the JIT"
    index = env.cache_dir() / "kernels"
    assert not index.exists() or not any(index.iterdir()), f"kernel index records: {list(index.iterdir())}"


def case_disagreement() -> None:
    """When the JIT's binding contradicts the fingerprint's model, the kernel goes back to the JIT for good."""
    fresh()
    saved = launch._agrees
    launch._agrees = lambda param, arg, spec: False
    try:
        for _ in range(3):
            assert jit_runs(lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64),
                                                      bf16(1, 8, 16, 64))) == 1
    finally:
        launch._agrees = saved
    # Every kernel the call launched (the module's Gluon kernels, for the wgmma knob, never ran).
    kernels = [k for name, k in dispatch.launcher_for(_spec())._kernels.items() if "_wgmma" not in name]
    assert kernels and all(k.broken for k in kernels), [k.broken for k in kernels]


def case_state() -> None:
    """Triton's debug knob and launch hooks, read on every call as the JIT reads them."""
    from triton import knobs

    fresh()
    call = lambda: tilegen.attention(bf16(1, 8, 16, 64), bf16(1, 8, 16, 64), bf16(1, 8, 16, 64))
    assert jit_runs(call) == 1
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        assert jit_runs(call) == 0  # the checked call compares the hooks and metadata passed
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    state = launch._state(gate.internals())
    old = knobs.runtime.debug
    knobs.runtime.debug = not old
    try:
        assert launch._state(gate.internals()) != state
    finally:
        knobs.runtime.debug = old


def _spec():
    from tilegen.families.attention_fwd import AttentionSpec

    return AttentionSpec(head_dim=64, dtype="bf16", mask="none")


#: The generated attention launcher's keyword arguments, as the tuner passes them: no mask, one config.
LAUNCH_KWARGS = {"scale": 0.125, "softcap": 0.0, "window_left": 1 << 30, "window_right": 1 << 30, "block_m": 64,
                 "block_n": 32, "num_warps": 4, "num_stages": 2}


def case_direct_kernel() -> None:
    """The generated launcher with direct kernels, called as the tuner would: same launches as the JIT's."""
    fresh()
    launcher = dispatch.launcher_for(_spec())
    q, k, v, out = (bf16(1, 8, 16, 64) for _ in range(4))
    kwargs = LAUNCH_KWARGS
    for args, expected in (((q, k, v, out, out), 1), ((bf16(1, 8, 16, 64), k, v, out, out), 0),
                           ((misaligned(1, 8, 16, 64), k, v, out, out), 1)):
        start = len(LAUNCHES)
        assert jit_runs(lambda args=args: launcher.direct(*args, **kwargs)) == expected
        launcher.jit(*args, **kwargs)
        assert LAUNCHES[start] == LAUNCHES[start + 1], LAUNCHES[start:]


def case_tma() -> None:
    """With tma=1 the launcher makes TMA descriptors on every call: after the first, their launches
    are direct too, and equal to the JIT's; a tensor that allows no descriptor takes the pointer kernel."""
    fresh()
    module_for(_spec()).TMA_MIN_WORK = 0  # these shapes are far below the launcher's floor for descriptors
    launcher = dispatch.launcher_for(_spec())
    q, k, v, out = (bf16(1, 8, 40, 64) for _ in range(4))
    kwargs = {**LAUNCH_KWARGS, "tma": 1}
    wide_k = bf16(1, 8, 40, 128)[..., :64]  # rows 256 bytes apart: still a descriptor of the same kind
    for args, expected, descriptors in (((q, k, v, out, out), 1, 3), ((bf16(1, 8, 40, 64), k, v, out, out), 0, 3),
                                        ((q, wide_k, v, out, out), 0, 3),
                                        ((misaligned(1, 8, 40, 64), k, v, out, out), 1, 0)):
        start = len(LAUNCHES)
        assert jit_runs(lambda args=args: launcher.direct(*args, **kwargs)) == expected
        launcher.jit(*args, **kwargs)
        assert LAUNCHES[start] == LAUNCHES[start + 1], LAUNCHES[start:]
        assert sum(a[0] == "descriptor" for a in LAUNCHES[start][-1]) == descriptors, LAUNCHES[start][-1]


def case_gluon() -> None:
    """A Gluon kernel's launches on descriptors of Gluon's own class are direct after the first, equal to the
    JIT's; another shared layout or block is another kernel, through the JIT once."""
    import gluon_copy

    if gluon_copy.KERNEL is None:
        print("skip gluon: this Triton spells Gluon's Hopper API otherwise", flush=True)
        return
    kernel = launch.DirectKernel(gluon_copy.KERNEL, gate.internals())
    calls = (
        ("first", lambda: gluon_copy.descriptors(48), 1),
        ("new tensors", lambda: gluon_copy.descriptors(48), 0),
        ("other rows", lambda: gluon_copy.descriptors(80), 0),
        ("another block", lambda: gluon_copy.descriptors(48, block=32), 1),
        ("fp16", lambda: gluon_copy.descriptors(48, dtype=torch.float16), 1),
    )
    for name, make, expected in calls:
        src, dst = make()
        args = (src, dst, 0.5, src.shape[0])
        grid = (src.shape[0] // src.block_shape[0], )
        start = len(LAUNCHES)
        runs = jit_runs(lambda: kernel[grid](*args, BLOCK=src.block_shape[0], num_warps=4))
        assert runs == expected, f"{name}: {runs} launches through the JIT, expected {expected}"
        gluon_copy.KERNEL[grid](*args, BLOCK=src.block_shape[0], num_warps=4)
        assert LAUNCHES[start] == LAUNCHES[start + 1], LAUNCHES[start:]
        del LAUNCHES[start:]
    assert kernel.broken is None, kernel.broken


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    if not isinstance(fake_cuda.INTERNALS, gate.Variant):
        print("not recognised:", fake_cuda.INTERNALS, flush=True)
        unrecognised()
        print("ok unrecognised", flush=True)
        sys.exit(0)
    for name in sys.argv[1:] or CASES:
        CASES[name]()
        print("ok", name, "checked calls:", CHECKED[0], flush=True)
