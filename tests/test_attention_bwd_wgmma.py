"""The attention backward's Gluon kernels (config ``wgmma`` 1: dK/dV, 2: dQ too): Hopper's wgmma pipeline written
out, on TMA descriptors.

Gluon has no interpreter, so on the CPU machine these tests check what the knob promises without running it:
where it is offered, what it refuses and why, that a launch falls back to the Triton kernels where the Gluon ones
cannot run, and that both kernels compile for sm90 with every wgmma kept asynchronous. On a GPU the ``gpu`` tests
run them against the float64 reference, into NaN-poisoned gradients.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import triton
from helpers import Case, compile_for_sm90, effective_mask, gluon_descriptor, param
from test_attention_backward import _direct_inputs, _launch, check_grads, ragged_launch_matches_reference

from tilegen.codegen import module_for
from tilegen.device import CPU_INTERPRETER, DeviceInfo, device_info
from tilegen.families.attention_bwd import AttentionBwdSpec, Config
from tilegen.families.attention_bwd.config import default_rule, feasible, search_space, wgmma_unsupported
from tilegen.families.attention_bwd.reference import attention_backward_reference
from tilegen.families.attention_fwd.config import has_wgmma

HOPPER = DeviceInfo("NVIDIA H200", (9, 0), 132, 141 << 30, 232448)
AMPERE = DeviceInfo("NVIDIA A100", (8, 0), 108, 80 << 30, 166912)
TRITON_36 = triton.__version__.startswith("3.6.")
D128 = AttentionBwdSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16")
DKDV = Config(64, 128, 8, 2, 128, 64, 8, 2, tma=1, wgmma=1)
BOTH = Config(64, 128, 8, 2, 128, 64, 8, 2, tma=1, wgmma=2)
WS = Config(64, 128, 8, 2, 128, 64, 8, 3, tma=1, wgmma=3)
ATOMIC_WS = Config(64, 128, 8, 3, 64, 128, 8, 3, atomic_dq=1, tma=1, wgmma=3)
ATOMIC_WS_2 = Config(64, 128, 8, 2, 64, 128, 8, 2, atomic_dq=1, tma=1, wgmma=3)


def _mod_text(mod, kind: str = "score_mod") -> str:
    from tilegen.mods.trace import trace

    return trace(mod, kind).canonical


def _alibi(heads: int = 8) -> str:
    from tilegen.mods import library

    return _mod_text(library.alibi(torch.rand(heads)))


ALIBI = D128.replace(score_mod=_alibi())


def _document() -> str:
    from tilegen.mods import library
    from tilegen.mods.trace import trace

    return trace(library.document_mask(torch.zeros(2, 64, dtype=torch.int32)), "mask_mod").canonical


DOCUMENT = D128.replace(mask="none", mask_mod=_document())


@pytest.mark.parametrize("spec,reason", [
    (AttentionBwdSpec(head_dim=128, softcap=True), "softcap"),
    (AttentionBwdSpec(head_dim=48), "head dims 48/48"),
    (AttentionBwdSpec(head_dim=136), "head dims 136/136: the Gluon kernels take equal ones from 64 to 128"),
    (AttentionBwdSpec(head_dim=128, head_dim_v=64), "head dims 128/64"),
    (AttentionBwdSpec(head_dim=64, dtype="fp32"), "dtype=fp32"),
], ids=lambda x: x if isinstance(x, str) else x.name)
def test_refuses_what_the_kernels_do_not_implement(spec, reason):
    assert reason in wgmma_unsupported(spec)
    assert search_space(spec, HOPPER)["wgmma"] == [0]


@pytest.mark.parametrize("config,reason", [
    (Config(64, 128, 8, 2, 128, 64, 8, 2, tma=0, wgmma=1), "tma=1"),
    (Config(64, 128, 8, 2, 64, 128, 8, 2, atomic_dq=1, tma=1, wgmma=1), "atomic_dq=0"),
    (Config(64, 128, 8, 2, 64, 128, 8, 2, atomic_dq=1, tma=1, wgmma=2), "atomic_dq=0"),
    (Config(64, 128, 4, 2, 128, 64, 8, 2, tma=1, wgmma=1), "num_warps1=4"),
    (Config(64, 32, 4, 2, 128, 64, 8, 2, tma=1, wgmma=1), "block_n1=32"),
    (Config(64, 128, 8, 2, 128, 64, 4, 2, tma=1, wgmma=2), "num_warps2=4"),
    (Config(64, 128, 8, 2, 128, 16, 8, 2, tma=1, wgmma=2), "blocks of 32, 64 or 128 rows, not 16"),
    (Config(64, 64, 4, 2, 128, 64, 8, 2, tma=1, wgmma=3), "two warpgroups (block_n1=128, num_warps1=8)"),
], ids=str)
@pytest.mark.skipif(not TRITON_36, reason="the knob is offered under Triton 3.6 only")
def test_infeasible_configs_say_why(config, reason):
    assert reason in feasible(D128, config, HOPPER)


@pytest.mark.parametrize("device", [HOPPER, AMPERE], ids=lambda d: d.name)
def test_every_default_is_a_config_its_own_feasible_takes(device):
    # Past d128 the default once held more than the registers (feasible refused it, and it spilled: 0.4x the tiles
    # that fit, BENCHMARKS.md); a default the tuner would never measure is no default.
    for head_dim, head_dim_v in ((16, 16), (64, 64), (72, 72), (128, 128), (160, 160), (192, 128), (192, 192),
                                 (256, 256), (128, 256)):
        for dtype in ("bf16", "fp16", "fp32"):
            for mask, q_per_kv in (("causal", 1), ("none", 4)):
                spec = AttentionBwdSpec(head_dim=head_dim, head_dim_v=head_dim_v, q_per_kv=q_per_kv, mask=mask,
                                        dtype=dtype)
                for _, config in default_rule(spec, device):
                    assert feasible(spec, config, device) is None, (spec.name, config)


def test_offered_on_hopper_with_triton_36_only():
    assert "sm90" in feasible(D128, BOTH, AMPERE)
    assert "sm90" in feasible(D128, BOTH, CPU_INTERPRETER)
    assert search_space(D128, AMPERE)["wgmma"] == [0]
    if TRITON_36:
        assert feasible(D128, DKDV, HOPPER) is None and feasible(D128, BOTH, HOPPER) is None
        assert search_space(D128, HOPPER)["wgmma"] == [0, 1, 2, 3] and feasible(D128, WS, HOPPER) is None
        # The default: the warp-specialized dK/dV kernel at d128, at d64 with GQA, and at d64 multi-head past 2k
        # (measured ahead at each; at d64 over 128-row query blocks), the Triton kernels at d64 for a ragged batch or a
        # score mod (not measured).
        [(_, rule)] = default_rule(D128, HOPPER)
        assert rule.wgmma == 3 and feasible(D128, rule, HOPPER) is None
        d64 = D128.replace(head_dim=64)
        [(_, gqa_rule)] = default_rule(d64, HOPPER)
        mha = d64.replace(q_per_kv=1)
        [(short, triton_kernels), (longer, rule)] = default_rule(mha, HOPPER)
        assert (short, longer) == (2048, None) and not triton_kernels.wgmma  # up to 2k the Triton kernels
        assert rule == gqa_rule
        assert (rule.wgmma, rule.block_m1) == (3, 128) and feasible(d64, rule, HOPPER) is None
        assert feasible(mha, rule, HOPPER) is None
        for other in (d64.replace(layout="ragged"), ALIBI.replace(head_dim=64)):
            assert not any(c.wgmma for _, c in default_rule(other, HOPPER))
        # Head dims between 64 and 128 are read into 128 columns, and take d128's kernels.
        for head_dim in (72, 96, 120):
            spec = D128.replace(head_dim=head_dim)
            assert wgmma_unsupported(spec) is None and default_rule(spec, HOPPER) == default_rule(D128, HOPPER)
        # The Gluon ring holds every stage: six of 64-row Q and dO blocks at d128 do not fit beside K and V, five do.
        assert feasible(D128, Config(64, 128, 8, 5, 128, 64, 8, 2, tma=1, wgmma=1), HOPPER) is None
        assert "shared memory" in feasible(D128, Config(64, 128, 8, 6, 128, 64, 8, 2, tma=1, wgmma=1), HOPPER)
    else:
        assert "Triton 3.6" in feasible(D128, BOTH, HOPPER)


@pytest.mark.parametrize("mask", ["causal", "none"])
def test_d64_takes_the_warp_specialized_kernel_with_gqa_at_every_length_and_multi_head_past_2k(mask, monkeypatch):
    """The rule itself, whatever Triton is installed (the Gluon kernels' availability stubbed as on Hopper with
    Triton 3.6): measured at 1k and 2k, GQA led on the 128-row kernel and multi-head on the Triton kernels."""
    from tilegen.families.attention_bwd import config as bwd_config

    monkeypatch.setattr(bwd_config, "has_wgmma", lambda device: True)
    monkeypatch.setattr(bwd_config, "wgmma_unsupported", lambda spec: None)
    gqa = AttentionBwdSpec(head_dim=64, q_per_kv=4, mask=mask, dtype="bf16")
    [(longest, ws)] = default_rule(gqa, HOPPER)
    assert longest is None and (ws.wgmma, ws.block_m1, ws.block_n1, ws.num_stages1) == (3, 128, 128, 2)
    [(short, triton_kernels), (longer, rule)] = default_rule(gqa.replace(q_per_kv=1), HOPPER)
    assert (short, longer) == (2048, None) and not triton_kernels.wgmma and rule == ws
    for other in (gqa.replace(layout="ragged"), gqa.replace(dtype="fp32")):
        assert not any(c.wgmma for _, c in default_rule(other, HOPPER))  # not measured: the Triton kernels
    [(_, window)] = default_rule(gqa.replace(mask="window"), HOPPER)  # a window ran faster on 64-row blocks
    assert (window.wgmma, window.block_m1, window.block_n1, window.num_stages1) == (3, 64, 128, 3)


def test_the_warp_specialized_kernel_adds_dq_by_tma_reductions_for_a_dense_batch():
    atomic = Config(64, 128, 8, 3, 64, 128, 8, 3, atomic_dq=1, tma=1, wgmma=3)
    full = D128.replace(mask="none")
    if not TRITON_36:
        assert "Triton 3.6" in feasible(full, atomic, HOPPER)
        return
    assert feasible(full, atomic, HOPPER) is None and feasible(D128, atomic, HOPPER) is None
    assert "atomic_dq=0" in feasible(full.replace(layout="ragged"), atomic, HOPPER)
    assert feasible(full.replace(head_dim=64), atomic, HOPPER) is None  # each consumer adds 32 head dims
    # The default takes it without a mask, where it was measured ahead; causal keeps the dQ kernel.
    [(_, rule)] = default_rule(full, HOPPER)
    assert rule.atomic_dq and rule.wgmma == 3
    [(_, rule)] = default_rule(D128, HOPPER)
    assert not rule.atomic_dq and rule.wgmma == 3


def test_a_score_mod_on_a_dense_batch_takes_the_gluon_kernels():
    """A score mod runs in the Gluon kernels (its scores and its derivative, as the Triton kernels apply them), by
    default on Hopper with Triton 3.6 (the warp-specialized kernel; adding dQ by TMA reductions without a mask), and
    in every Gluon config the tuner may choose. A ragged batch, a mask mod beside causal and a gather by both
    positions stay the Triton kernels'."""
    from tilegen.mods import library
    from tilegen.mods.trace import trace

    assert wgmma_unsupported(ALIBI) is None and wgmma_unsupported(ALIBI.replace(mask="none")) is None
    causal, full = (default_rule(spec, HOPPER)[0][1] for spec in (ALIBI, ALIBI.replace(mask="none")))
    if TRITON_36:
        assert (causal.wgmma, causal.atomic_dq, full.wgmma, full.atomic_dq) == (3, 0, 3, 1)
        assert feasible(ALIBI, causal, HOPPER) is None and feasible(ALIBI.replace(mask="none"), full, HOPPER) is None
    else:
        assert not causal.wgmma and not full.wgmma
    assert "dense batches only" in wgmma_unsupported(ALIBI.replace(layout="ragged"))
    documents = D128.replace(mask_mod=trace(library.document_mask(torch.zeros(8, dtype=torch.int64)),
                                            "mask_mod").canonical)
    assert "mask mod" in wgmma_unsupported(documents)
    assert "gather" in wgmma_unsupported(D128.replace(score_mod=_mod_text(library.relative_bias(torch.randn(8, 32)))))
    pairs = torch.rand(64, 64) > 0.5  # a mask read at both positions: the Triton kernels', as the forward's

    def by_pairs(b, h, q_idx, kv_idx):
        return pairs[q_idx % 64, kv_idx % 64]

    assert "mask_mod: a gather by both positions" in wgmma_unsupported(
        D128.replace(mask="none", mask_mod=_mod_text(by_pairs, "mask_mod")))
    if TRITON_36:
        assert search_space(ALIBI, HOPPER)["wgmma"] == [0, 1, 2, 3]
        for config in (DKDV, BOTH, WS):
            assert feasible(ALIBI, config, HOPPER) is None
        assert feasible(ALIBI.replace(mask="none"), ATOMIC_WS, HOPPER) is None


def test_a_window_takes_the_gluon_dkdv_kernels_where_they_were_timed():
    """A window's Gluon dK/dV kernels with the Triton dQ kernel: searched, and the default, on dense batches, where
    they were timed; on ragged batches only under a forced config."""
    window = D128.replace(mask="window")
    assert wgmma_unsupported(window) is None and wgmma_unsupported(window.replace(layout="ragged")) is None
    for spec in (window, window.replace(head_dim=96), window.replace(head_dim=64), ALIBI.replace(mask="window")):
        assert search_space(spec, HOPPER)["wgmma"] == ([0, 1, 2, 3] if TRITON_36 else [0])
        assert [c.wgmma for _, c in default_rule(spec, HOPPER)] == [3 if TRITON_36 else 0]
        assert not any(c.atomic_dq for _, c in default_rule(spec, HOPPER))
    assert search_space(window.replace(layout="ragged"), HOPPER)["wgmma"] == [0]
    assert not any(c.wgmma for _, c in default_rule(window.replace(layout="ragged"), HOPPER))
    if not TRITON_36:
        return
    assert "a window has no Gluon dQ kernel (wgmma 1 or 3 run its Gluon dK/dV kernels)" in feasible(
        window, BOTH, HOPPER)
    for config in (DKDV, WS, ATOMIC_WS):
        assert feasible(window, config, HOPPER) is None
    assert feasible(window.replace(layout="ragged"), WS, HOPPER) is None


def _record_launches(module, monkeypatch) -> dict:
    """Every kernel of the backward's ``module`` replaced by a recorder: ``calls[name]`` is the first launch's
    ``(args, kwargs)``, and nothing runs."""
    calls = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.setdefault(self.name, (args, kwargs))

    for name in ("_preprocess", "_dkdv_wgmma_ws", "_dkdv", "_dq", "_dq_scale", "_dkdv_wgmma", "_dq_wgmma"):
        if hasattr(module, name):  # a mask mod's module has no one-partition Gluon kernels
            monkeypatch.setattr(module, name, Recorder(name))
    return calls


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernels are written against Triton 3.6's API")
@pytest.mark.parametrize("config", [DKDV, WS], ids=str)
def test_a_windows_launch_passes_its_sides_to_the_gluon_dkdv_kernel(config, monkeypatch):
    """CPU tensors posing as CUDA ones, the kernels recorded, not run: the window's sides reach the Gluon dK/dV
    kernel, and dQ is the Triton kernel's."""
    from helpers import OnGpu

    spec = D128.replace(mask="window", q_per_kv=1)
    module = module_for(spec)
    q, k, v, out, dout, dq, dk, dv = (torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16).as_subclass(OnGpu)
                                      for _ in range(8))
    lse, delta, lse2 = (torch.zeros(1, 2, 64).as_subclass(OnGpu) for _ in range(3))
    calls = _record_launches(module, monkeypatch)
    module.launch(q, k, v, out, dout, lse, None, dq, dk, dv, delta, lse2, torch.zeros(q.shape).as_subclass(OnGpu),
                  None, None, 64, 64, scale=0.1, softcap=0.0, window_left=13, window_right=7, **config.to_dict())
    kernel = {1: "_dkdv_wgmma", 3: "_dkdv_wgmma_ws"}[config.wgmma]
    assert sorted(calls) == sorted(["_preprocess", kernel, "_dq"])
    args, _ = calls[kernel]
    at = next(i for i, a in enumerate(args) if isinstance(a, float) and a == 0.1) + 1  # after the softmax scale
    assert args[at:at + 2] == (13, 7)


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernels are written against Triton 3.6's API")
@pytest.mark.parametrize("atomic", [False, True], ids=["dq-kernel", "dq-reductions"])
def test_a_mask_mods_launch_passes_its_block_table_to_the_warp_specialized_kernel(atomic, monkeypatch):
    """CPU tensors posing as CUDA ones, the kernels recorded, not run: the mod's captured tensor and its transposed
    table reach the warp-specialized dK/dV kernel, dQ the Triton kernel's on the forward's table; a direct launch
    asking for dQ by reductions is refused before the dK/dV kernel (feasible refuses it for the search)."""
    from helpers import OnGpu

    from tilegen.mods.blocks import block_table

    spec = DOCUMENT.replace(q_per_kv=1)
    config = ATOMIC_WS if atomic else WS
    module = module_for(spec)
    q, k, v, out, dout, dq, dk, dv = (torch.zeros(2, 2, 256, 128, dtype=torch.bfloat16).as_subclass(OnGpu)
                                      for _ in range(8))
    lse, delta, lse2 = (torch.zeros(2, 2, 256).as_subclass(OnGpu) for _ in range(3))
    docs = (torch.arange(256) // 100).repeat(2, 1).to(torch.int32)
    tables = [block_table(spec.mask_mod, [docs], 2, 2, 256, 256, m, n, "cpu", transposed)
              for m, n, transposed in ((config.block_m1, config.block_n1, True),
                                       (config.block_m2, config.block_n2, False))]
    calls = _record_launches(module, monkeypatch)
    launch = functools.partial(
        module.launch, q, k, v, out, dout, lse, None, dq, dk, dv, delta, lse2,
        torch.zeros(q.shape).as_subclass(OnGpu), None, None, 256, 256, scale=0.1, softcap=0.0, window_left=0,
        window_right=0, mod_tensors=[docs], mod_grads=[], mod_blocks_dkdv=tables[0],
        mod_blocks_dq=None if atomic else tables[1], **config.to_dict())
    if atomic:
        with pytest.raises(NotImplementedError, match="its dQ is the Triton kernel's"):
            launch()
        assert not calls
        return
    launch()
    assert sorted(calls) == ["_dkdv_wgmma_ws", "_dq", "_preprocess"]
    args, kwargs = calls["_dkdv_wgmma_ws"]
    at = next(i for i, a in enumerate(args) if a is docs)
    assert args[at:at + 5] == (docs, *docs.stride(), *docs.shape)
    listed = args[at + 5:at + 11]
    assert listed[0] is tables[0].count and listed[1] is tables[0].indices and listed[2] is tables[0].full
    assert listed[3:] == (tables[0].stride_b, tables[0].stride_h, tables[0].indices.shape[1])
    assert kwargs["ATOMIC_DQ"] is False


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernels are written against Triton 3.6's API")
def test_a_mask_mods_launch_refuses_a_warp_specialized_kernel_of_other_keys(monkeypatch):
    """A direct launch (which feasible's checks do not guard) of the warp-specialized kernel over other than 128 keys
    is refused before a dK/dV kernel runs, its table matching or not."""
    from helpers import OnGpu

    from tilegen.mods.blocks import block_table

    spec = DOCUMENT.replace(q_per_kv=1)
    config = Config(64, 64, 4, 3, 128, 64, 8, 3, tma=1, wgmma=3)
    module = module_for(spec)
    q, k, v, out, dout, dq, dk, dv = (torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16).as_subclass(OnGpu)
                                      for _ in range(8))
    lse, delta, lse2 = (torch.zeros(1, 2, 256).as_subclass(OnGpu) for _ in range(3))
    docs = (torch.arange(256) // 100).view(1, -1).to(torch.int32)
    tables = [block_table(spec.mask_mod, [docs], 1, 2, 256, 256, m, n, "cpu", t) for m, n, t in ((64, 64, True),
                                                                                                  (128, 64, False))]
    calls = _record_launches(module, monkeypatch)
    with pytest.raises(ValueError, match="holds 128 keys in two warpgroups"):
        module.launch(q, k, v, out, dout, lse, None, dq, dk, dv, delta, lse2,
                      torch.zeros(q.shape).as_subclass(OnGpu), None, None, 256, 256, scale=0.1, softcap=0.0,
                      window_left=0, window_right=0, mod_tensors=[docs], mod_grads=[], mod_blocks_dkdv=tables[0],
                      mod_blocks_dq=tables[1], **config.to_dict())
    assert list(calls) == ["_preprocess"]  # the delta pass only


def test_a_ragged_batch_is_offered_the_warp_specialized_dkdv_kernel_alone():
    ragged = D128.replace(layout="ragged")
    assert wgmma_unsupported(ragged) is None
    if not TRITON_36:
        assert search_space(ragged, HOPPER)["wgmma"] == [0]
        return
    assert search_space(ragged, HOPPER)["wgmma"] == [0, 3]
    assert feasible(ragged, WS, HOPPER) is None
    for config in (DKDV, BOTH):
        assert "a ragged batch runs the warp-specialized Gluon dK/dV kernel only (wgmma=3)" in feasible(
            ragged, config, HOPPER)
    [(_, rule)] = default_rule(ragged, HOPPER)
    assert rule.wgmma == 3


def test_falls_back_to_the_triton_kernels_off_the_gpu(device):
    """A CPU launch with the knob on runs the Triton kernels with the same tiles: right gradients, every element."""
    if device != "cpu":
        pytest.skip("the fallback is for tensors Gluon cannot take")
    case = Case(37, 21, dtype="bf16", head_dim=64, heads_q=4, heads_kv=2, causal=True)
    spec = AttentionBwdSpec(head_dim=64, q_per_kv=2, mask="causal", dtype="bf16")
    assert wgmma_unsupported(spec) is None
    config = Config(16, 32, 4, 1, 32, 16, 4, 1, tma=1, wgmma=2)
    q, k, v, out, dout, lse, dlse = _direct_inputs(case, device)
    grads = _launch(spec, config, case, q, k, v, out, dout, lse, dlse)
    check_grads(grads, attention_backward_reference(q, k, v, dout, dlse=dlse, **case.mask_kwargs()), torch.bfloat16)


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernels are written against Triton 3.6's API")
@pytest.mark.parametrize("spec,kernel,held,streamed,stages", [
    (D128, "_dkdv_wgmma", 128, 64, 2),
    (D128, "_dkdv_wgmma_ws", 64, 64, 2),  # each consumer's 64 keys
    (D128, "_dkdv_wgmma_ws_stats", 64, 64, 3),  # the LSE and Delta by TMA
    (D128.replace(q_per_kv=1, mask="none"), "_dkdv_wgmma_ws_atomic_stats", 64, 64, 3),
    (D128.replace(layout="ragged"), "_dkdv_wgmma_ws", 64, 64, 3),
    (D128.replace(mask="none"), "_dkdv_wgmma_ws_atomic", 64, 64, 3),  # dQ by TMA reductions too
    (AttentionBwdSpec(head_dim=64, mask="causal", dtype="bf16"), "_dkdv_wgmma_ws_atomic", 64, 64, 3),
    (AttentionBwdSpec(head_dim=64, mask="none", dtype="fp16"), "_dq_wgmma", 128, 64, 3),
    (ALIBI, "_dkdv_wgmma", 128, 64, 2),  # a score mod, in every kernel
    (ALIBI, "_dkdv_wgmma_ws", 64, 64, 3),
    (ALIBI.replace(mask="none"), "_dkdv_wgmma_ws_atomic", 64, 64, 3),
    (D128.replace(head_dim=96), "_dkdv_wgmma_ws", 64, 64, 3),  # read into 128 columns
    (D128.replace(head_dim=80, mask="none"), "_dkdv_wgmma_ws_atomic_stats", 64, 64, 3),
    (D128.replace(head_dim=96), "_dq_wgmma", 128, 64, 3),
    (ALIBI, "_dq_wgmma", 128, 64, 3),
    # A window: the band's query blocks, masked at both edges.
    (D128.replace(mask="window"), "_dkdv_wgmma", 128, 64, 2),
    (D128.replace(mask="window"), "_dkdv_wgmma_ws_stats", 64, 64, 3),
    (D128.replace(mask="window", layout="ragged"), "_dkdv_wgmma_ws", 64, 64, 3),
    (ALIBI.replace(mask="window", head_dim=64), "_dkdv_wgmma_ws", 64, 64, 2),
    # A mask mod: its block table's query blocks, the mod evaluated in those it does not keep whole.
    (DOCUMENT, "_dkdv_wgmma_ws_stats", 64, 64, 3),
    (DOCUMENT.replace(q_per_kv=1), "_dkdv_wgmma_ws_atomic", 64, 64, 3),
    (DOCUMENT.replace(head_dim=64), "_dkdv_wgmma_ws", 64, 128, 2),
    (D128.replace(mask="none", mask_mod=_mod_text(lambda b, h, q_idx, kv_idx: (q_idx // 64 >= kv_idx // 64)
                                                  & ((q_idx + b) % 5 != 1), "mask_mod")), "_dkdv_wgmma_ws", 64, 64, 3),
], ids=lambda x: x.name if isinstance(x, AttentionBwdSpec) else str(x))
def test_compiles_for_sm90_with_asynchronous_wgmma(spec, kernel, held, streamed, stages, tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    d, dt = triton.next_power_of_2(spec.head_dim), spec.dtype  # read padded
    streamed_desc, held_desc = gluon_descriptor(streamed, d, dt), gluon_descriptor(held, d, dt)
    stats = kernel.endswith("_stats")
    atomic = kernel.removesuffix("_stats").endswith("_atomic")
    kernel = kernel.removesuffix("_stats").removesuffix("_atomic")
    if kernel.startswith("_dkdv"):
        pointers = {"q_desc": streamed_desc, "do_desc": streamed_desc, "k_desc": held_desc, "v_desc": held_desc,
                    "dK": f"*{dt}", "dV": f"*{dt}"}
        # The warp-specialized kernel's warps are its first consumer's; its key block is two of k_desc's.
        blocks = {"BLOCK_M": streamed} if kernel.endswith("_ws") else {"BLOCK_M": streamed, "BLOCK_N": held}
        if kernel.endswith("_ws"):
            # dQ's fp32 sum, in tiles of half the head dim, or none.
            blocks["ATOMIC_DQ"] = atomic
            if atomic:
                pointers["dq_desc"] = gluon_descriptor(streamed, d // 2, "fp32")
            else:
                pointers["dq_desc"], blocks["dq_desc"] = "constexpr", None
            # The LSE's and Delta's rows, fp32 [batch, heads, n_q] in blocks of [1, 1, BLOCK_M], or none.
            blocks["STATS"] = stats
            from triton.experimental.gluon import language as gl

            stats_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
            for name in ("lse_desc", "delta_desc"):
                if stats:
                    pointers[name] = f"tensordesc<fp32[1, 1, {streamed}],{stats_layout!r}>"
                else:
                    pointers[name], blocks[name] = "constexpr", None
    else:
        pointers = {"q_desc": held_desc, "do_desc": held_desc, "k_desc": streamed_desc, "v_desc": streamed_desc,
                    "dQ": f"*{dt}"}
        blocks = {"BLOCK_M": held, "BLOCK_N": streamed}
    pointers.update({"Delta": "*fp32", "Lse2": "*fp32", "qk_scale": "fp32", "sm_scale": "fp32", "CuQ": "*i32",
                     "CuK": "*i32", "sm_t0": "*fp32",  # the ALiBi slopes (an argument of the mod's kernels only)
                     # the document ids, and the mask mod's block table
                     "mm_t0": "*i32", "BlkCount": "*i32", "BlkIndex": "*i32", "BlkFull": "*i8"})
    request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "kernel": kernel, "ptxas": True,
               "configs": [{**blocks, "STAGES": stages, "num_warps": 4 if kernel.endswith("_ws") else held // 16}]}
    out = compile_for_sm90(request, tmp_path, kernels=1)
    assert out.strip().endswith("wgmma async"), out


GPU_CASES = [
    param(Case(1, dtype="bf16", head_dim=64, causal=True)),
    param(Case(17, dtype="bf16", head_dim=128, heads_q=4, heads_kv=2, causal=True)),
    param(Case(257, dtype="fp16", head_dim=64, batch=2, heads_q=8, heads_kv=2)),
    param(Case(1000, dtype="bf16", head_dim=128, heads_q=4, heads_kv=1, causal=True)),
    param(Case(100, 300, dtype="bf16", head_dim=64, heads_q=4, heads_kv=1, causal=True)),
    param(Case(300, 100, dtype="fp16", head_dim=128, causal=True)),  # rows that see no key
    param(Case(129, 1000, dtype="bf16", head_dim=128, heads_q=8, heads_kv=8)),
    param(Case(1000, dtype="fp16", head_dim=128, batch=2, scale=0.3)),
    param(Case(1050, 900, dtype="bf16", head_dim=64, batch=3, heads_q=6, heads_kv=2, causal=True)),
    # Fewer rows than a query block, a multiple of 4: the LSE's block by TMA, most of it past n_q.
    param(Case(20, 300, dtype="bf16", head_dim=128, batch=2, heads_q=4, heads_kv=1, causal=True)),
    # Head dims read into 128 columns.
    param(Case(1000, dtype="bf16", head_dim=96, heads_q=8, heads_kv=2, causal=True)),
    param(Case(257, 300, dtype="fp16", head_dim=80, heads_q=4, heads_kv=4)),
    param(Case(1, 129, dtype="bf16", head_dim=120, heads_q=2, heads_kv=1, causal=True)),
    # Windows: the band's query blocks masked at both edges (a causal one, Mistral's; two-sided; one side unbounded;
    # rows that see no key).
    param(Case(1000, dtype="bf16", head_dim=128, heads_q=4, heads_kv=1, window=(100, 0))),
    param(Case(257, 300, dtype="fp16", head_dim=64, heads_q=4, heads_kv=2, window=(37, 5))),
    param(Case(300, 100, dtype="bf16", head_dim=128, window=(16, 16))),
    param(Case(1050, 900, dtype="bf16", head_dim=96, batch=2, heads_q=6, heads_kv=2, window=(None, 64))),
    param(Case(129, 1000, dtype="bf16", head_dim=128, heads_q=8, heads_kv=2, window=(300, None))),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [DKDV, BOTH, Config(32, 128, 8, 3, 64, 64, 4, 3, tma=1, wgmma=2),
                                    Config(64, 64, 4, 2, 128, 128, 8, 2, tma=1, wgmma=2), WS,
                                    Config(128, 128, 8, 2, 128, 64, 8, 3, tma=1, wgmma=3),
                                    Config(64, 128, 8, 3, 64, 128, 8, 3, atomic_dq=1, tma=1, wgmma=3)], ids=str)
@pytest.mark.parametrize("case", GPU_CASES)
def test_gluon_kernels_match_reference(case, config, monkeypatch):
    if not has_wgmma(device_info(torch.cuda.current_device())):
        pytest.skip("the Gluon kernels need an sm90 GPU and Triton 3.6")
    spec = AttentionBwdSpec(head_dim=case.head_dim, q_per_kv=case.heads_q // case.heads_kv,
                            mask=effective_mask(case.causal, case.window), dtype=case.dtype)
    if feasible(spec, config, device_info(torch.cuda.current_device())) is not None:
        pytest.skip(feasible(spec, config, device_info(torch.cuda.current_device())))
    module = module_for(spec)
    runs, stats = [], []

    def spied(name, kernel):
        def launch(grid):
            runs.append(name)
            return lambda *args, **kwargs: stats.append(kwargs.get("STATS")) or kernel[grid](*args, **kwargs)
        return type("Spy", (), {"__getitem__": lambda self, grid: launch(grid)})()

    for name in ("_dkdv_wgmma", "_dq_wgmma", "_dkdv_wgmma_ws"):
        monkeypatch.setattr(module, name, spied(name, getattr(module, name)))
    q, k, v, out, dout, lse, dlse = _direct_inputs(case, "cuda")
    grads = _launch(spec, config, case, q, k, v, out, dout, lse, dlse)
    torch.cuda.synchronize()
    taken = {1: ["_dkdv_wgmma"], 2: ["_dkdv_wgmma", "_dq_wgmma"], 3: ["_dkdv_wgmma_ws"]}[config.wgmma]
    assert runs == taken, "the launcher did not take the Gluon kernels the config names"
    if config.wgmma == 3:
        # The LSE and Delta come by TMA where their rows are 16-byte aligned (n_q a multiple of 4); both paths run.
        assert stats == [case.n_q % 4 == 0], stats
    check_grads(grads, attention_backward_reference(q, k, v, dout, dlse=dlse, **case.mask_kwargs()), case.torch_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [DKDV, BOTH, WS, ATOMIC_WS], ids=str)
@pytest.mark.parametrize("mask", ["causal", "none"])
@pytest.mark.parametrize("grads", [False, True], ids=["fixed", "learned"])
def test_a_score_mod_through_the_gluon_kernels(config, mask, grads, monkeypatch, tmp_path):
    """ALiBi (GQA 4) through each Gluon kernel, as the tuner runs a trial (NaN-poisoned gradients, the reference's
    autograd through the mod); with a gradient wanted for the slopes, the launcher takes the Triton kernels, which
    add it."""
    device = device_info(torch.cuda.current_device())
    infeasible = feasible(ALIBI.replace(mask=mask), config, device)
    if not has_wgmma(device) or infeasible is not None:
        pytest.skip(f"the Gluon kernels need an sm90 GPU and Triton 3.6; {infeasible}")
    runs = _score_mod_through_the_launcher(config, mask, grads, monkeypatch, tmp_path)
    gluon = {1: ["_dkdv_wgmma"], 2: ["_dkdv_wgmma", "_dq_wgmma"], 3: ["_dkdv_wgmma_ws"]}[config.wgmma]
    assert runs == (["_dkdv"] if grads else gluon), runs


def _score_mod_through_the_launcher(config, mask, grads, monkeypatch, tmp_path, mod=("score_mod", "make_alibi"),
                                    n: int = 1024) -> list[str]:
    """One trial of the tuner's (``Problem``: NaN-poisoned gradients, checked against the reference's autograd
    through the mod) of an ALiBi spec with ``config``; with ``grads``, a gradient wanted for the slopes. ``mod``
    names another (kind, factory of test_mods_tune's MODS). Returns the kernels the launcher ran."""
    import json
    import types

    from test_mods_tune import MODS, _importable

    from tilegen.dispatch import launcher_for
    from tilegen.families.attention_bwd.problem import Problem
    from tilegen.mods import sources

    # The tuner finds a mod by import path: the tuning tests' ALiBi factory.
    (tmp_path / "tune_mods.py").write_text(MODS)
    _importable(tmp_path, monkeypatch)
    kind, path = mod[0], f"tune_mods:{mod[1]}"
    monkeypatch.setenv(sources.ENV, json.dumps({kind: path}))
    spec = D128.replace(mask=mask, **{kind: sources.canonical_text(path, kind)})
    module = module_for(spec)
    # The spies see launches through the JIT: a direct launch calls the compiled kernel past the module's names
    # (on the GPU; the interpreter launches through the JIT anyway).
    monkeypatch.setenv("TILEGEN_DIRECT_LAUNCH", "0")
    launcher_for.cache_clear()
    runs = []
    for name in ("_dkdv_wgmma", "_dq_wgmma", "_dkdv_wgmma_ws", "_dkdv"):
        if not hasattr(module, name):  # a mask mod's module has no one-partition Gluon kernels
            continue
        kernel = getattr(module, name)
        spy = type("Spy", (), {"__getitem__": lambda self, grid, name=name, kernel=kernel:
                               runs.append(name) or kernel[grid]})
        monkeypatch.setattr(module, name, spy())
    on_gpu = torch.cuda.is_available()
    problem = Problem.for_bucket(spec, n, on_gpu=on_gpu, batch=2, heads_q=8)
    inputs = problem.inputs(0)
    outputs = problem.outputs(inputs)
    slopes = torch.zeros_like(inputs[-1].tensors[0], dtype=torch.float32) if kind == "score_mod" else None
    launcher = launcher_for(spec)
    if grads:  # the trial's launch, with a gradient asked for the slopes
        launcher = types.SimpleNamespace(launch=lambda *a, **kw: launcher_for(spec).launch(*a, **{**kw,
                                                                                             "mod_grads": [slopes]}))
    try:
        problem.launch(launcher, config, inputs, outputs)
    finally:
        launcher_for.cache_clear()  # later tests launch directly again
    if on_gpu:
        torch.cuda.synchronize()
    assert slopes is None or (slopes.abs().sum() > 0) == grads
    error, _ = problem.check(inputs, outputs)
    assert error < 1e-2, error
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize("config", [WS, Config(128, 128, 8, 2, 128, 64, 8, 3, tma=1, wgmma=3)], ids=str)
@pytest.mark.parametrize("mod", ["make_documents", "near", "chunks"])
@pytest.mark.parametrize("n", [1024, 1000, 129])
def test_a_mask_mod_through_the_warp_specialized_dkdv_kernel(config, mod, n, monkeypatch, tmp_path):
    """A mask mod (documents of 7 tokens, one-position gathers; a window with a sink, no tensors; chunks, integer //
    and % by numbers; GQA 4) through the warp-specialized dK/dV kernel, walking the mod's transposed block table, as
    the tuner runs a trial; lengths that are not multiples of a block leave the LSE's rows to the global loads."""
    device = device_info(torch.cuda.current_device())
    infeasible = feasible(DOCUMENT, config, device)
    if not has_wgmma(device) or infeasible is not None:
        pytest.skip(f"the Gluon kernels need an sm90 GPU and Triton 3.6; {infeasible}")
    runs = _score_mod_through_the_launcher(config, "none", False, monkeypatch, tmp_path, mod=("mask_mod", mod), n=n)
    assert runs == ["_dkdv_wgmma_ws"], runs


def test_a_mask_mod_takes_the_warp_specialized_dkdv_kernel_alone():
    """Searched, and the default with the Triton dQ kernel; a mask mod beside a built-in mask, on a ragged batch or
    beside a score mod stays the Triton kernels'."""
    for spec in (DOCUMENT, DOCUMENT.replace(q_per_kv=1), DOCUMENT.replace(head_dim=64)):
        assert wgmma_unsupported(spec) is None
        assert search_space(spec, HOPPER)["wgmma"] == ([0, 1, 2, 3] if TRITON_36 else [0])
        assert [(c.wgmma, c.atomic_dq) for _, c in default_rule(spec, HOPPER)] == [(3 if TRITON_36 else 0, 0)]
    for spec in (DOCUMENT.replace(mask="causal"), DOCUMENT.replace(layout="ragged"),
                 DOCUMENT.replace(score_mod=ALIBI.score_mod)):
        assert "mask_mod: the Gluon kernels take a mask mod on dense batches, as the only mask" in wgmma_unsupported(
            spec)
    if not TRITON_36:
        return
    assert feasible(DOCUMENT, WS, HOPPER) is None
    for config in (ATOMIC_WS, ATOMIC_WS_2):
        assert "writes dQ by the Triton kernel (atomic_dq=0)" in feasible(DOCUMENT, config, HOPPER)
    for config in (DKDV, BOTH):
        assert "a mask mod runs the warp-specialized Gluon dK/dV kernel only (wgmma=3)" in feasible(
            DOCUMENT, config, HOPPER)


def test_a_score_mod_with_the_gluon_knob_runs_the_triton_kernels_off_the_gpu(device, monkeypatch, tmp_path):
    """Off the GPU (Gluon has no interpreter) the knob's launch takes the Triton kernels with its tiles: the harness
    of the GPU tests above, checked where it can run (a mask mod's too)."""
    if device != "cpu":
        pytest.skip("the fallback is for tensors Gluon cannot take")
    for grads in (False, True):
        runs = _score_mod_through_the_launcher(Config(16, 32, 4, 1, 32, 16, 4, 1, tma=1, wgmma=2), "causal", grads,
                                               monkeypatch, tmp_path)
        assert runs == ["_dkdv"]
    runs = _score_mod_through_the_launcher(Config(16, 32, 4, 1, 32, 16, 4, 1, tma=1, wgmma=3), "none", False,
                                           monkeypatch, tmp_path, mod=("mask_mod", "chunks"), n=100)
    assert runs == ["_dkdv"]


@pytest.mark.gpu
@pytest.mark.parametrize("mask,window", [("causal", None), ("none", None), ("window", (150, 0)), ("window", (40, 90))],
                         ids=["causal", "full", "window-150-0", "window-40-90"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_ragged_batch_through_the_warp_specialized_kernel(mask, window, dtype, monkeypatch):
    """A packed batch of odd lengths through the warp-specialized dK/dV kernel, whose tiles read past each sequence
    into the next (``ragged_launch_matches_reference``); the LSE and Delta by loads, not TMA copies (a block's rows
    past its sequence would bring the next one's)."""
    if not has_wgmma(device_info(torch.cuda.current_device())):
        pytest.skip("the Gluon kernels need an sm90 GPU and Triton 3.6")
    spec = AttentionBwdSpec(head_dim=128, q_per_kv=4, mask=mask, dtype=dtype, layout="ragged")
    module = module_for(spec)
    stats = []
    kernel = module._dkdv_wgmma_ws

    def launch(grid):
        return lambda *args, **kwargs: stats.append(kwargs["STATS"]) or kernel[grid](*args, **kwargs)

    monkeypatch.setattr(module, "_dkdv_wgmma_ws", type("Spy", (), {"__getitem__": lambda self, grid: launch(grid)})())
    lens = [300, 0, 1, 1000, 129, 64, 7], [300, 5, 0, 1000, 129, 200, 7]
    ragged_launch_matches_reference(spec, WS, *lens, heads_q=8, device="cuda", window=window)
    # Rows no sequence owns hold NaN: the last sequence's last query block reads them, and must zero them before its
    # products (0 x NaN).
    ragged_launch_matches_reference(spec, WS, *lens, heads_q=8, device="cuda", window=window, tail=9)
    assert stats == [False, False], "the launcher did not take the warp-specialized kernel, or took the TMA copies"


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernels are written against Triton 3.6's API")
@pytest.mark.parametrize("lse_shape,lse_view,rows,stats", [
    ((2, 4, 64), None, 64, True),  # the op's own: contiguous, rows a multiple of 4
    ((2, 4, 66), None, 66, False),  # rows 264 bytes apart: no descriptor
    ((1, 1, 1001), (slice(None), slice(None), slice(0, 64)), 64, False),  # a size-1 dim's stride is 1001 floats
    ((2, 64, 4), "transposed", 64, False),  # the scratch's strides (contiguous) are not the LSE's
    ((2, 4, 100), None, 64, False),  # n_q below the tensors' rows: rows the delta pass never writes
], ids=["contiguous", "rows-66", "size-1-dim-stride", "lse-head-last", "n_q-short"])
def test_the_lse_goes_by_tma_only_where_it_is_addressed_as_the_kernels_address_it(lse_shape, lse_view, rows, stats,
                                                                                  monkeypatch):
    """The launcher passes the LSE's and Delta's descriptors only where a TMA copy reads what the loads would: the
    scratch 16-byte aligned and laid out as the LSE is, n_q rows (CPU tensors posing as CUDA ones, the kernels
    recorded, not run). The BPT layer's one-head LSE, a slice of a longer buffer, once made the descriptor assert."""
    from helpers import OnGpu

    spec = AttentionBwdSpec(head_dim=128, q_per_kv=1, mask="causal", dtype="bf16")
    module = module_for(spec)
    lse = torch.zeros(lse_shape)
    if lse_view == "transposed":
        lse = lse.transpose(1, 2)  # [2, 4, 64] stored head-last
    elif lse_view is not None:
        lse = lse[lse_view]
    heads, n_q = lse.shape[1], rows
    q, k, v, out, dout, dq, dk, dv = (torch.zeros(lse.shape[0], heads, lse.shape[2], 128, dtype=torch.bfloat16)
                                      .as_subclass(OnGpu) for _ in range(8))
    scratch = [torch.empty(lse.shape).as_subclass(OnGpu) for _ in range(2)]  # contiguous, as plain callers make it
    if lse_view != "transposed":
        scratch = [torch.empty_like(lse).as_subclass(OnGpu) for _ in range(2)]
    calls = _record_launches(module, monkeypatch)
    module.launch(q, k, v, out, dout, lse.as_subclass(OnGpu), None, dq, dk, dv, *scratch,
                  torch.zeros(q.shape).as_subclass(OnGpu), None, None, n_q, n_q, scale=0.1, softcap=0.0,
                  window_left=-1, window_right=0, **WS.to_dict())
    assert calls["_dkdv_wgmma_ws"][1]["STATS"] is stats
