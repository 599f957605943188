"""The attention kernel's Gluon paths (config ``wgmma`` 1, 2 and 3): Hopper's wgmma pipeline written
out, in one partition or warp-specialized (a loader warp, two consumer warpgroups, with or without
ping-pong turns).

Gluon has no interpreter, so on the CPU machine these tests check what the knob promises without
running it: where it is offered, what it refuses and why, that a launch falls back to the Triton
kernel where the Gluon one cannot run, and that the kernel compiles for sm90 with every wgmma
kept asynchronous (ptxas serializes them all if one is in flight across a loop's back edge). On
a GPU the ``gpu`` tests run it against the float64 reference.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from helpers import (Case, OnGpu, check_against_reference, compile_for_sm90, gluon_descriptor, param,
                     poisoned_like_out)

from tilegen.codegen.cache import module_for
from tilegen.device import CPU_INTERPRETER, DeviceInfo, device_info
from tilegen.families.attention_fwd import FAMILY as ATTENTION_FWD
from tilegen.families.attention_fwd import AttentionSpec, Config
from tilegen.families.attention_fwd.config import (
    default_rule,
    feasible,
    has_wgmma,
    search_space,
    wgmma_unsupported,
)
from tilegen.families.base import ConfigError
from tilegen.families.lowering import gluon_widths
from tilegen.ops.attention import prepare_call, run_with_config

HOPPER = DeviceInfo("NVIDIA H200", (9, 0), 132, 141 << 30, 232448)
AMPERE = DeviceInfo("NVIDIA A100", (8, 0), 108, 80 << 30, 166912)
BLACKWELL = DeviceInfo("NVIDIA B200", (10, 0), 148, 180 << 30, 232448)
TRITON_36 = triton.__version__.startswith("3.6.")
WGMMA = Config(128, 128, 8, 3, tma=1, wgmma=1)
WS = Config(128, 128, 8, 2, tma=1, wgmma=2)
WS_PINGPONG = Config(128, 64, 8, 3, tma=1, wgmma=3)


def test_offered_on_hopper_with_triton_36_only():
    spec = ATTENTION_FWD.presets["mha-d128-causal"]
    assert search_space(spec, HOPPER)["wgmma"] == ([0, 1, 2, 3] if TRITON_36 else [0])
    for device in (AMPERE, BLACKWELL, CPU_INTERPRETER):
        assert not has_wgmma(device)
        assert search_space(spec, device)["wgmma"] == [0]
        for config in (WGMMA, WS, WS_PINGPONG):
            assert "needs an sm90 GPU and Triton 3.6" in feasible(spec, config, device)
    # The knob is a choice of kernel: a stored config names one of them or is refused.
    assert Config.from_dict(WS_PINGPONG.to_dict()) == WS_PINGPONG
    with pytest.raises(ConfigError, match="wgmma: expected one of 0, 1, 2, 3, got 4"):
        Config.from_dict({**WS.to_dict(), "wgmma": 4})
    assert [str(c) for c in (WGMMA, WS, WS_PINGPONG)] == [
        "BM128-BN128-w8-s3-tma-wgmma", "BM128-BN128-w8-s2-tma-ws", "BM128-BN64-w8-s3-tma-ws-pp"]


@pytest.mark.skipif(not TRITON_36, reason="the wgmma knob is offered under Triton 3.6 only")
@pytest.mark.parametrize("spec,config,reason", [
    (AttentionSpec(head_dim=64, mask="window", dtype="bf16"), WGMMA, "a window is the warp-specialized kernel's"),
    (AttentionSpec(head_dim=32, dtype="bf16"), WGMMA, "equal ones from 64 to 256"),
    (AttentionSpec(head_dim=128, head_dim_v=64, dtype="bf16"), WGMMA, "a narrower V is the warp-specialized"),
    (AttentionSpec(head_dim=256, head_dim_v=192, dtype="bf16"), WS, "or a V of 64 to 128 below a wider QK"),
    (AttentionSpec(head_dim=96, head_dim_v=128, dtype="bf16"), WGMMA, "equal ones from 64 to 256"),
    (AttentionSpec(head_dim=192, dtype="bf16"), WGMMA, "takes two consumers, BM128-BN64 and two slots"),
    (AttentionSpec(head_dim=256, dtype="bf16"), WS, "takes two consumers, BM128-BN64 and two slots"),
    (AttentionSpec(head_dim=256, dtype="bf16"), Config(128, 64, 8, 3, tma=1, wgmma=2), "takes two consumers"),
    # A QK of 192 above a V of 128 is read in 192 columns: three slots fit, four do not.
    (AttentionSpec(head_dim=192, head_dim_v=128, dtype="bf16"), Config(128, 64, 8, 4, tma=1, wgmma=2),
     "head dim 192 (read as 192) takes two consumers, BM128-BN64 and 2 to 3 slots"),
    (AttentionSpec(head_dim=160, head_dim_v=128, dtype="bf16"), Config(128, 128, 8, 2, tma=1, wgmma=2),
     "head dim 160 (read as 192)"),
    (AttentionSpec(head_dim=64, dtype="fp32"), WGMMA, "bf16 or fp16"),
    (AttentionSpec(head_dim=128, dtype="bf16"), Config(128, 128, 8, 3, tma=0, wgmma=1), "goes with tma=1"),
    (AttentionSpec(head_dim=128, dtype="bf16"), Config(128, 64, 4, 3, tma=1, wgmma=1), "BM128 with 8"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(64, 32, 4, 3, tma=1, wgmma=1), "64 or 128"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(64, 64, 4, 1, tma=1, wgmma=1), "two slots"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(64, 64, 4, 2, tma=1, wgmma=4), "expected one of 0, 1, 2, 3"),
    (AttentionSpec(head_dim=128, dtype="bf16"), Config(128, 128, 8, 2, tma=0, wgmma=3), "goes with tma=1"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(64, 64, 4, 2, tma=1, wgmma=2), "BM128 with 8 warps"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(128, 64, 4, 2, tma=1, wgmma=3), "BM128 with 8 warps"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(128, 32, 8, 2, tma=1, wgmma=2), "64 or 128"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(128, 64, 8, 1, tma=1, wgmma=2), "two slots"),
    (AttentionSpec(head_dim=128, dtype="bf16"), Config(128, 128, 8, 4, tma=1, wgmma=2), "shared memory"),
    (AttentionSpec(head_dim=128, dtype="bf16"), Config(192, 128, 12, 2, tma=1, wgmma=2), "head dim 64 only"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(192, 128, 8, 2, tma=1, wgmma=2), "BM192 with 12"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(192, 128, 12, 2, tma=1, wgmma=1), "BM64 with 4 warps"),
    (AttentionSpec(head_dim=64, dtype="bf16"), Config(192, 128, 12, 2, tma=1, wgmma=0), "power of two"),
])
def test_refuses_what_the_kernel_does_not_implement(spec, config, reason):
    assert reason in feasible(spec, config, HOPPER)
    # A spec the kernel does not implement is never offered the knob; a config it refuses is.
    assert search_space(spec, HOPPER)["wgmma"] == ([0] if wgmma_unsupported(spec) else [0, 1, 2, 3])


@pytest.mark.skipif(not TRITON_36, reason="the wgmma knob is offered under Triton 3.6 only")
def test_a_window_is_offered_the_warp_specialized_kernel():
    """A window runs in the warp-specialized kernel (its tiles read the key blocks from the window's first on), not
    in the one-partition kernel, whose launcher refuses it rather than run it unmasked."""
    spec = AttentionSpec(head_dim=128, q_per_kv=4, mask="window", dtype="bf16")
    for config in (WS, WS_PINGPONG, Config(128, 64, 8, 2, tma=1, wgmma=2)):
        assert feasible(spec, config, HOPPER) is None, config
    assert feasible(AttentionSpec(head_dim=64, mask="window", dtype="bf16"), Config(192, 128, 12, 2, tma=1, wgmma=2),
                    HOPPER) is None
    assert [c for _, c in default_rule(spec, HOPPER)][1:] == [WS]
    # At d64 too two consumers with 128-key blocks, not the full rule's three from 2k on (measured on an H100).
    assert default_rule(AttentionSpec(head_dim=64, mask="window", dtype="bf16"), HOPPER)[1:] == [(None, WS)]
    from tilegen.codegen import source_for

    source = source_for(spec)
    assert "_wgmma_ws(" in source and "window_left, window_right,\n" in source
    assert '"window; the warp-specialized one (wgmma 2 or "' in source
    assert "_ws_window_blocks(" in source
    assert "_ws_window_blocks" not in source_for(AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16"))


@pytest.mark.skipif(not TRITON_36, reason="the wgmma knob is offered under Triton 3.6 only")
def test_feasible_configs_and_default_rule():
    for spec in (AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", return_lse=True),
                 AttentionSpec(head_dim=64, dtype="fp16")):
        for config in (WGMMA, Config(64, 128, 4, 3, tma=1, wgmma=1), Config(64, 64, 4, 2, tma=1, wgmma=1), WS,
                       WS_PINGPONG, Config(128, 128, 8, 2, tma=1, wgmma=3)):
            assert feasible(spec, config, HOPPER) is None, (spec, config)
    # The warp-specialized kernel stages its output in a buffer of its own beside Q's and the ring: three slots of
    # 128 keys fit at d64, not at d128 (256 KiB; 224 without the buffer), nor four beside a V of 64 at 128/64.
    assert feasible(AttentionSpec(head_dim=64, dtype="fp16"), Config(128, 128, 8, 3, tma=1, wgmma=3), HOPPER) is None
    narrow_v = AttentionSpec(head_dim=128, head_dim_v=64, dtype="bf16")
    for spec, config in ((AttentionSpec(head_dim=128, dtype="bf16"), Config(128, 128, 8, 3, tma=1, wgmma=3)),
                         (narrow_v, Config(128, 128, 8, 4, tma=1, wgmma=2))):
        assert "shared memory" in feasible(spec, config, HOPPER), (spec, config)
        assert feasible(spec, dataclasses.replace(config, wgmma=0), HOPPER) is None  # the Triton kernel stages none
    for config in (Config(192, 128, 12, 2, tma=1, wgmma=2), Config(192, 64, 12, 3, tma=1, wgmma=3)):
        assert feasible(AttentionSpec(head_dim=64, dtype="fp16"), config, HOPPER) is None, config
    # From 512 keys the d128 rule takes the warp-specialized kernel, causal with 64-key blocks up to 1k; d64
    # from 2k on causal (ping-pong at 4k) and 512 on full, with three consumers from 8k causal and 2k full
    # (measured on the H200).
    causal = default_rule(AttentionSpec(head_dim=128, mask="causal", dtype="bf16"), HOPPER)
    full = default_rule(AttentionSpec(head_dim=128, dtype="fp16", q_per_kv=4), HOPPER)
    assert causal[1:] == [(1024, Config(128, 64, 8, 3, tma=1, wgmma=2)), (None, WS)]
    assert full[1:] == [(None, WS)]
    assert not causal[0][1].wgmma and not full[0][1].wgmma
    d64 = default_rule(AttentionSpec(head_dim=64, dtype="bf16"), HOPPER)
    assert d64[1:] == [(1024, WS), (None, Config(192, 128, 12, 2, tma=1, wgmma=3))]
    assert not d64[0][1].wgmma
    d64 = default_rule(AttentionSpec(head_dim=64, mask="causal", dtype="bf16"), HOPPER)
    assert d64[1:] == [(512, Config(128, 128, 8, 2, tma=1, wgmma=3)), (1024, WS),
                       (4096, Config(128, 128, 8, 2, tma=1, wgmma=3)), (None, Config(192, 128, 12, 2, tma=1, wgmma=2))]
    assert not d64[0][1].wgmma
    assert 192 not in search_space(AttentionSpec(head_dim=128, dtype="bf16"), HOPPER)["block_m"]
    assert 192 in search_space(AttentionSpec(head_dim=64, dtype="bf16"), HOPPER)["block_m"]
    # The ragged kernels' space has no three-consumer tile (tests/test_varlen_wgmma.py checks its wgmma knob).
    from tilegen.families.attention_varlen import VarlenAttentionSpec
    from tilegen.families.attention_varlen.config import search_space as varlen_space

    assert varlen_space(VarlenAttentionSpec(head_dim=64, dtype="bf16"), HOPPER) == {
        "block_m": [64, 128, 256], "block_n": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3, 4],
        "wgmma": [0, 2, 3]}
    assert not any(c.wgmma for _, c in default_rule(AttentionSpec(head_dim=128, softcap=True, dtype="bf16"), HOPPER))
    # Past 128 a softcap keeps the Triton kernel in 128 x 64 tiles with TMA (Gemma 2's d256).
    wide_softcap = AttentionSpec(head_dim=256, q_per_kv=2, mask="causal", softcap=True, dtype="bf16")
    assert [c for _, c in default_rule(wide_softcap, HOPPER)] == [Config(128, 64, 8, 2, tma=1)]
    assert feasible(wide_softcap, Config(128, 64, 8, 2, tma=1), HOPPER) is None
    assert not any(c.wgmma for _, c in default_rule(AttentionSpec(head_dim=128, dtype="bf16"), AMPERE))


def test_only_specs_it_implements_carry_the_kernel():
    from tilegen.codegen import source_for

    source = source_for(AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16"))
    assert "_wgmma(" in source and "_wgmma_ws(" in source
    assert "_wgmma" not in source_for(AttentionSpec(head_dim=64, mask="window", dtype="fp32"))
    assert "gluon" not in source_for(AttentionSpec(head_dim=96, head_dim_v=128, dtype="fp16"))
    # Past 128 into 256 columns, the output staged in Q's buffer.
    wide = source_for(AttentionSpec(head_dim=192, dtype="fp16"))
    assert "[1, 1, q_rows, 256], [1, 1, block_n, 256]" in wide and "< 192" in wide and "o_smem = q_smem\n" in wide
    # A head dim below 128 is read into 128 columns: the pointer store masks the columns past it.
    padded = source_for(AttentionSpec(head_dim=96, mask="causal", dtype="fp16"))
    assert "_wgmma_ws(" in padded and "[1, 1, q_rows, 128], [1, 1, block_n, 128]" in padded
    assert "gl.arange(0, HEAD_DIM, col_o)[None, :] < 96" in padded
    assert "< 128)" not in source_for(AttentionSpec(head_dim=128, mask="causal", dtype="fp16"))


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
    configs = [Config(64, 64, 4, 2, tma=1, wgmma=1), Config(128, 64, 8, 2, tma=1, wgmma=3)]
    if case.head_dim == 64:  # three consumers' 192-row tiles: the Triton kernel takes 128
        configs.append(Config(192, 128, 12, 2, tma=1, wgmma=2))
    for config in configs:
        poisoned = poisoned_like_out(q, v)
        out, lse = run_with_config(spec, config, q, k, v, scale, softcap, left, right, out=poisoned)
        assert not torch.isnan(poisoned).any()
        check_against_reference(out, lse, q, k, v, causal=case.causal)


@pytest.mark.parametrize("head_dim,causal,n_q,heads,grid,scheduled", [
    (64, True, 1000, 16, 128, True),  # 8 query tiles x 16 heads: fewer tiles than programs
    (64, True, 4096, 8, 132, True),  # 256 tiles dealt to 132 programs
    (128, True, 4096, 8, 131, False),  # d128: in turns over an odd count of programs
    (64, True, 4097, 8, 33 * 8, False),  # past 32 query tiles a head: a program per tile
    (128, False, 4097, 8, 132, False),  # full: a program per SM, in turns
])
def test_warp_specialized_launch_grid(head_dim, causal, n_q, heads, grid, scheduled, monkeypatch):
    """The persistent kernel's grid: a program per SM (132 here); for d64 causal up to 32 query tiles a head,
    with a schedule of its tiles (its first call builds it, the next reuses it), for d128 causal an odd count
    of programs; for causal past 32 query tiles a head one program per tile."""
    spec = AttentionSpec(head_dim=head_dim, mask="causal" if causal else "none", dtype="bf16")
    config = Config(128, 128, 8, 2, tma=1, wgmma=2)
    schedules = {}
    launches = [_launch_on_a_stand_in_gpu(spec, config, heads, n_q, monkeypatch, schedules=schedules)
                for _ in range(2)]
    for (g, kwargs), in launches:
        assert g == (grid, ) and kwargs["SCHEDULED"] == scheduled and (kwargs["Sched"] is not None) == scheduled
    if scheduled:
        first, again = (kwargs["Sched"] for (_, kwargs), in launches)
        assert again is first
        table = first.tolist()
        assert table[0] == grid + 1 and table[grid] == len(table) - 1
        assert sorted(table[grid + 1:-1]) == list(range(-(-n_q // 128) * heads))


def test_warp_specialized_schedule_while_capturing(monkeypatch):
    """A causal shape first called while a CUDA graph is captured runs without a schedule, its programs taking
    turns: an odd count of them."""

    class Capturing(OnGpu):
        @property
        def device(self):
            return torch.device("cuda", 0)

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    (grid, kwargs), = _launch_on_a_stand_in_gpu(AttentionSpec(head_dim=64, mask="causal", dtype="bf16"),
                                                Config(128, 128, 8, 2, tma=1, wgmma=2), 8, 4096, monkeypatch,
                                                stand_in=Capturing)
    assert grid == (131, ) and not kwargs["SCHEDULED"] and kwargs["Sched"] is None


@pytest.mark.parametrize("n_m,n_bh,n_q,n_k,programs", [
    (8, 512, 1024, 1024, 132),  # d64 causal 1k, 16 x 32 heads
    (16, 256, 2048, 2048, 132),
    (32, 128, 4096, 4096, 132),
    (8, 64, 1000, 1000, 132),  # fewer tiles than four rounds: all of them heaviest first
    (5, 300, 600, 600, 132),
    (3, 5, 300, 100, 7),  # rows that see no key: one block each
    (8, 16, 1000, 1100, 128),  # one tile a program
])
def test_tile_schedule_balances_key_blocks(n_m, n_bh, n_q, n_k, programs):
    """The causal schedule deals every tile once, as many tiles to each program as to the others give or take
    one; its busiest program runs no more key blocks than the average and half the heaviest tile, and no more
    than with the programs taking turns (an odd count of them), where there it ran more."""
    module = module_for(AttentionSpec(head_dim=64, mask="causal", dtype="bf16"))
    if module.gluon is None:
        pytest.skip("this Triton has no Gluon")
    table = module._tile_schedule(n_m, n_bh, n_q, n_k, 128, 128, programs)
    offsets = table[:programs + 1]
    assert offsets[0] == programs + 1 and offsets[-1] == len(table) - 1 and offsets == sorted(offsets)
    n_tiles = n_m * n_bh
    assert sorted(table[programs + 1:-1]) == list(range(n_tiles))
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    assert max(counts) - min(counts) <= 1
    blocks = [max(-(-min(n_k, (n_m - t % n_m) * 128 + n_k - n_q) // 128), 1) for t in range(n_tiles)]
    busiest = max(sum(blocks[t] for t in table[a:b]) for a, b in zip(offsets, offsets[1:]))
    assert busiest <= max(sum(blocks) / programs + max(blocks) / 2, max(blocks), -(-n_tiles // programs) * min(blocks))
    odd = programs - 1 + programs % 2
    turns = max(sum(blocks[p::odd]) for p in range(odd))
    assert busiest <= turns
    if n_m * n_bh > 4 * programs:
        assert busiest < turns


def _launch_on_a_stand_in_gpu(spec, config, heads, n_q, monkeypatch, out=None, schedules=None,
                              stand_in=OnGpu):
    """Run the launcher on stand-in CUDA tensors of a 132-SM GPU (writing `out`, else Q); return the (grid,
    keyword arguments) of its warp-specialized kernel's launches, the output and schedule arguments under
    "Out" and "Sched". Causal schedules are kept in `schedules`, else in a dict of this call's own."""
    module = module_for(spec)
    if module.gluon is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(module, "TMA_MIN_WORK", 0)
    monkeypatch.setattr(module, "_SMS", {})
    if hasattr(module, "_SCHEDULES"):
        monkeypatch.setattr(module, "_SCHEDULES", {} if schedules is None else schedules)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("P", (), {"multi_processor_count": 132}))
    launches = []
    monkeypatch.setattr(module, f"_{spec.name}_kernel_wgmma_ws", type("Spy", (), {
        "__getitem__": lambda self, grid: (lambda *args, **kwargs: launches.append(
            (grid, {**kwargs, "Out": args[3], "Sched": args[5]})))
    })())
    q, k, v = (torch.empty(1, heads, n_q, spec.head_dim, dtype=torch.bfloat16).as_subclass(stand_in) for _ in range(3))
    module.launch(q, k, v, q if out is None else out, q, scale=0.1, softcap=0.0, window_left=1 << 30,
                  window_right=1 << 30, **config.to_dict())
    return launches


@pytest.mark.parametrize("knobs,message", [
    ({"block_m": 128, "block_n": 128, "wgmma": 2}, "block table is for 64x64 blocks, the launch runs 128x128"),
    ({"block_m": 64, "block_n": 64, "wgmma": 1}, "the one-partition Gluon kernel has no mask mod"),
    ({"block_m": 192, "block_n": 64, "wgmma": 2}, "block_m=192: three consumer warpgroups walk no mask mod's"),
], ids=["other-blocks", "one-partition", "three-consumers"])
def test_a_mask_mods_launch_refuses_a_kernel_or_table_that_would_drop_its_mask(knobs, message, monkeypatch):
    """A direct launch (which feasible's checks do not guard) never runs a mask mod's spec unmasked: the
    one-partition Gluon kernel has no mask mod, and a table of other blocks than the launch's tiles, or a tile no
    kernel walks a table in, is refused before any kernel runs."""
    from tilegen.mods import library
    from tilegen.mods.blocks import block_table
    from tilegen.mods.trace import trace

    traced = trace(library.document_mask(torch.tensor([0] * 300 + [1] * 700)), "mask_mod")
    spec = AttentionSpec(head_dim=128, dtype="bf16", mask_mod=traced.canonical)
    module = module_for(spec)
    if module.gluon is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(module, "TMA_MIN_WORK", 0)
    monkeypatch.setattr(module, "_SMS", {0: 132})
    ran = []
    for name in (f"_{spec.name}_kernel_wgmma_ws", f"_{spec.name}_kernel_wgmma", f"_{spec.name}_kernel"):
        monkeypatch.setattr(module, name, type("Spy", (), {"__getitem__": lambda self, grid: ran.append})())
    q, k, v = (torch.empty(1, 2, 1000, 128, dtype=torch.bfloat16).as_subclass(OnGpu) for _ in range(3))
    rows = 192 if knobs["block_m"] == 192 else 64  # the table of the launch's tiles where the tiles are refused
    table = block_table(traced.canonical, traced.tensors, 1, 2, 1000, 1000, rows, 64, "cpu")
    with pytest.raises(ValueError, match=message):
        module.launch(q, k, v, q, q, scale=0.1, softcap=0.0, window_left=1 << 30, window_right=1 << 30, num_warps=8,
                      num_stages=2, tma=1, mod_tensors=traced.tensors, mod_blocks=table, **knobs)
    assert not ran


@pytest.mark.parametrize("offset", [0, 1])
def test_warp_specialized_output_store(offset, monkeypatch):
    """The output goes out through a TMA descriptor of one consumer's 64 rows where its base and strides allow
    one, else through pointers (a base one element past 16-byte alignment)."""
    heads, n_q = 4, 1000
    out = torch.empty(heads * n_q * 64 + offset, dtype=torch.bfloat16)[offset:].view(1, heads, n_q, 64)
    (_, kwargs), = _launch_on_a_stand_in_gpu(AttentionSpec(head_dim=64, dtype="bf16"),
                                             Config(128, 128, 8, 2, tma=1, wgmma=2), heads, n_q, monkeypatch,
                                             out.as_subclass(OnGpu))
    assert kwargs["TMA_STORE"] == (offset == 0)
    if offset:
        assert kwargs["Out"].data_ptr() == out.data_ptr()
    else:
        assert kwargs["Out"].block_shape == [1, 1, 64, 64] and kwargs["Out"].base.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("config,grid,consumers", [
    (Config(192, 128, 12, 2, tma=1, wgmma=2), 6 * 16, 3),  # 1000 rows in 192-row tiles: 6 a head
    (Config(128, 128, 8, 2, tma=1, wgmma=3), 8 * 16, 2),
])
def test_warp_specialized_consumers(config, grid, consumers, monkeypatch):
    """The launcher gives the kernel a consumer warpgroup per 64 rows of the config's tile, and sizes the
    grid by that tile."""
    launches = _launch_on_a_stand_in_gpu(AttentionSpec(head_dim=64, dtype="bf16"), config, 16, 1000, monkeypatch)
    assert [(g, k["CONSUMERS"], k["PINGPONG"]) for g, k in launches] == [((grid, ), consumers, config.wgmma == 3)]


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernel is written against Triton 3.6's API")
@pytest.mark.parametrize("spec", [
    AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", return_lse=True),
    AttentionSpec(head_dim=64, mask="none", dtype="fp16"),
    AttentionSpec(head_dim=96, q_per_kv=2, mask="causal", dtype="bf16"),
    AttentionSpec(head_dim=192, head_dim_v=128, mask="causal", dtype="bf16"),
    AttentionSpec(head_dim=128, q_per_kv=4, mask="window", dtype="bf16", return_lse=True),
], ids=lambda s: s.name)
def test_compiles_for_sm90_with_asynchronous_wgmma(spec, tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    script = Path(__file__).with_name("sm90_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TILEGEN_CACHE_DIR"] = str(tmp_path)
    configs = [("kernel_wgmma", 128, 128, 3, 8, {"BLOCK_M": 128}), ("kernel_wgmma", 64, 128, 3, 4, {"BLOCK_M": 64}),
               ("kernel_wgmma", 64, 64, 2, 4, {"BLOCK_M": 64}),
               ("kernel_wgmma_ws", 64, 128, 2, 4, {"PINGPONG": False, "CONSUMERS": 2, "TMA_STORE": True}),
               ("kernel_wgmma_ws", 64, 128, 2, 4, {"PINGPONG": False, "CONSUMERS": 2, "TMA_STORE": False}),
               ("kernel_wgmma_ws", 64, 64, 3, 4, {"PINGPONG": True, "CONSUMERS": 2, "TMA_STORE": True})]
    if spec.head_dim == 96 or spec.mask == "window":
        # Read into 128 columns, or a window: the warp-specialized kernel, both stores.
        configs = configs[3:5] + (configs[5:] if spec.mask == "window" else [])
    if spec.head_dim == 192:  # Q and K in three parts of 64 columns: 64-key blocks, two or three slots, both stores
        configs = [(kernel, q_rows, 64, stages, warps, constants) for stages in (2, 3)
                   for kernel, q_rows, _, _, warps, constants in configs[3:5]]
    if spec.head_dim == 64:
        configs += [("kernel_wgmma_ws", 64, 128, 2, 4, {"PINGPONG": True, "CONSUMERS": 3, "TMA_STORE": True}),
                    ("kernel_wgmma_ws", 64, 128, 2, 4, {"PINGPONG": False, "CONSUMERS": 3, "TMA_STORE": False})]
    dim, dim_v = gluon_widths(spec.head_dim, spec.dv)
    dim //= 3 if dim == 192 else 1  # a part's columns
    for kernel, q_rows, block_n, stages, warps, constants in configs:
        if kernel == "kernel_wgmma_ws":  # causal: the tiles as the host's schedule deals them
            constants = {**constants, "SCHEDULED": spec.mask == "causal"}
        # The warp-specialized kernel stores through a descriptor of Q's block where the output allows one.
        out = gluon_descriptor(q_rows, dim_v, spec.dtype) if constants.get("TMA_STORE") else f"*{spec.dtype}"
        pointers = {"Out": out, "Lse": "*fp32", "Sched": "*i32", "qk_scale": "fp32",
                    "q_desc": gluon_descriptor(q_rows, dim, spec.dtype),
                    "k_desc": gluon_descriptor(block_n, dim, spec.dtype),
                    "v_desc": gluon_descriptor(block_n, dim_v, spec.dtype)}
        request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "kernel": kernel, "ptxas": True,
                   "configs": [{**constants, "BLOCK_N": block_n, "STAGES": stages, "num_warps": warps}]}
        done = subprocess.run([sys.executable, str(script), json.dumps(request)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "cubin bytes" in done.stdout and done.stdout.strip().endswith("wgmma async"), done.stdout
        spilled = int(done.stdout.split("spill stores bytes")[1].split()[0])
        if kernel == "kernel_wgmma_ws" and constants["TMA_STORE"] and (block_n == 128 or spec.head_dim == 192):
            # The shipped tiles: with the output leaving through TMA no value is spilled (with pointer
            # stores d128 causal spilled 54 words and d64 full with three consumers 86; BENCHMARKS.md).
            assert spilled == 0, done.stdout


def _alibi_text(heads: int) -> str:
    from tilegen.mods import library
    from tilegen.mods.trace import trace

    return trace(library.alibi(torch.rand(heads)), "score_mod").canonical


@pytest.mark.skipif(not TRITON_36, reason="the wgmma knob is offered under Triton 3.6 only")
def test_a_score_mod_and_a_softcap_are_offered_the_gluon_kernels_and_a_mask_mod_alone():
    """A score mod runs in the Gluon kernels' softmax: the tuner may choose them (it checks every candidate against
    the reference), and the default rule takes the ping-pong kernel at d128 (measured there), not at d64; a softcap
    only a tune (its Gluon kernels ran slower). The warp-specialized kernel walks a mask mod's block table where the
    mod is the only mask (BM128: the table's query blocks are its tiles), where a tune chooses it; a mask mod beside
    a built-in mask, and a gather by both positions, stay the Triton kernel's."""
    from tilegen.mods import library
    from tilegen.mods.trace import trace

    alibi = AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", score_mod=_alibi_text(8))
    assert wgmma_unsupported(alibi) is None and search_space(alibi, HOPPER)["wgmma"] == [0, 1, 2, 3]
    assert feasible(alibi, WS, HOPPER) is None
    assert default_rule(alibi, HOPPER)[-1][1] == Config(128, 128, 8, 2, tma=1, wgmma=3)
    d64 = alibi.replace(head_dim=64)
    assert wgmma_unsupported(d64) is None and not any(c.wgmma for _, c in default_rule(d64, HOPPER))
    documents = alibi.replace(score_mod=None, mask_mod=trace(library.document_mask(torch.zeros(8, dtype=torch.int64)),
                                                             "mask_mod").canonical)
    assert "a mask mod alone" in wgmma_unsupported(documents)
    documents = documents.replace(mask="none")
    assert wgmma_unsupported(documents) is None and feasible(documents, WS, HOPPER) is None
    assert feasible(documents, WS_PINGPONG, HOPPER) is None
    assert "two consumers (BM128)" in feasible(documents, WGMMA, HOPPER)
    # Offered to a tune, not taken by the default (it led the Triton rows for one mask of three measured).
    assert not any(c.wgmma for _, c in default_rule(documents, HOPPER))
    assert search_space(documents, HOPPER)["wgmma"] == [0, 1, 2, 3]
    assert "two consumers (BM128)" in feasible(documents.replace(head_dim=64), Config(192, 128, 12, 2, tma=1, wgmma=2),
                                               HOPPER)
    bias = alibi.replace(score_mod=trace(library.relative_bias(torch.randn(8, 32)), "score_mod").canonical)
    assert "gather" in wgmma_unsupported(bias)
    allowed = torch.rand(64, 64) > 0.5
    pairs = documents.replace(mask_mod=trace(lambda b, h, q_idx, kv_idx: allowed[q_idx, kv_idx], "mask_mod").canonical)
    assert "mask_mod: a gather by both positions" in wgmma_unsupported(pairs)
    softcap = AttentionSpec(head_dim=128, mask="causal", dtype="bf16", softcap=True)
    assert search_space(softcap, HOPPER)["wgmma"] == [0, 1, 2, 3] and feasible(softcap, WS, HOPPER) is None
    assert not any(c.wgmma for _, c in default_rule(softcap, HOPPER))


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernel is written against Triton 3.6's API")
@pytest.mark.parametrize("spec", [
    AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", return_lse=True, score_mod=_alibi_text(8)),
    AttentionSpec(head_dim=64, mask="none", dtype="fp16", score_mod=_alibi_text(4)),
    AttentionSpec(head_dim=128, q_per_kv=2, mask="causal", dtype="bf16", softcap=True),
], ids=["d128-causal-alibi", "d64-alibi", "d128-causal-softcap"])
def test_the_gluon_kernels_with_a_score_mod_compile_for_sm90(spec, tmp_path):
    """Each Gluon kernel with ALiBi, or the softcap, in its softmax (the half step of consumer 0's causal diagonal at
    d128, three consumers at d64) compiles for sm90, its wgmma kept asynchronous."""
    pytest.importorskip("triton.backends.nvidia")
    configs = [("kernel_wgmma", 128, 128, 3, 8, {"BLOCK_M": 128}),
               ("kernel_wgmma_ws", 64, 128, 2, 4, {"PINGPONG": False, "CONSUMERS": 2, "TMA_STORE": True}),
               ("kernel_wgmma_ws", 64, 64, 3, 4, {"PINGPONG": True, "CONSUMERS": 2, "TMA_STORE": False})]
    if spec.head_dim == 64:
        configs.append(("kernel_wgmma_ws", 64, 128, 2, 4, {"PINGPONG": True, "CONSUMERS": 3, "TMA_STORE": True}))
    for kernel, q_rows, block_n, stages, warps, constants in configs:
        if kernel == "kernel_wgmma_ws":
            constants = {**constants, "SCHEDULED": False}
        out = gluon_descriptor(q_rows, spec.head_dim, spec.dtype) if constants.get("TMA_STORE") else f"*{spec.dtype}"
        pointers = {"Out": out, "Lse": "*fp32", "Sched": "*i32", "qk_scale": "fp32", "sm_t0": "*fp32",
                    "softcap_scale": "fp32",
                    "q_desc": gluon_descriptor(q_rows, spec.head_dim, spec.dtype),
                    "k_desc": gluon_descriptor(block_n, spec.head_dim, spec.dtype),
                    "v_desc": gluon_descriptor(block_n, spec.head_dim, spec.dtype)}
        request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "kernel": kernel, "ptxas": True,
                   "configs": [{**constants, "BLOCK_N": block_n, "STAGES": stages, "num_warps": warps}]}
        out = compile_for_sm90(request, tmp_path, kernels=1)
        assert out.strip().endswith("wgmma async"), out


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernel is written against Triton 3.6's API")
@pytest.mark.parametrize("head_dim,dtype,mod", [(128, "bf16", "documents"), (64, "fp16", "documents"),
                                               (128, "bf16", "chunks")])
def test_the_warp_specialized_kernel_with_a_mask_mod_compiles_for_sm90(head_dim, dtype, mod, tmp_path):
    """The warp-specialized kernel walking a document mask's block table (gathers of document ids by each position,
    in the steps the table marks partial) compiles for sm90, its wgmma kept asynchronous; so does a mod whose
    integer // and % by numbers make those numbers scalars (a cast: Gluon's tl.full asks for a layout)."""
    pytest.importorskip("triton.backends.nvidia")
    from tilegen.mods import library
    from tilegen.mods.trace import trace

    documents = trace(library.document_mask(torch.zeros(64, dtype=torch.int32)), "mask_mod").canonical
    chunks = trace(lambda b, h, q_idx, kv_idx: (q_idx // 64 >= kv_idx // 64) & ((q_idx + b) % 5 != 1),
                   "mask_mod").canonical
    spec = AttentionSpec(head_dim=head_dim, q_per_kv=4, dtype=dtype, return_lse=True,
                         mask_mod=documents if mod == "documents" else chunks)
    for block_n, stages, constants in ((128, 2, {"PINGPONG": False, "TMA_STORE": True}),
                                       (64, 3, {"PINGPONG": True, "TMA_STORE": False})):
        out = gluon_descriptor(64, head_dim, dtype) if constants["TMA_STORE"] else f"*{dtype}"
        pointers = {"Out": out, "Lse": "*fp32", "Sched": "*i32", "qk_scale": "fp32", "mm_t0": "*i32",
                    "BlkCount": "*i32", "BlkIndex": "*i32", "BlkFull": "*i8",
                    "q_desc": gluon_descriptor(64, head_dim, dtype), "k_desc": gluon_descriptor(block_n, head_dim, dtype),
                    "v_desc": gluon_descriptor(block_n, head_dim, dtype)}
        request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "kernel": "kernel_wgmma_ws", "ptxas": True,
                   "configs": [{**constants, "CONSUMERS": 2, "SCHEDULED": False, "BLOCK_N": block_n, "STAGES": stages,
                                "num_warps": 4}]}
        out = compile_for_sm90(request, tmp_path, kernels=1)
        assert out.strip().endswith("wgmma async"), out


GPU_CASES = [
    param(Case(1, 1, dtype="bf16", head_dim=64, causal=True)),
    param(Case(17, dtype="bf16", head_dim=128, heads_q=4, heads_kv=2, causal=True)),
    param(Case(257, dtype="fp16", head_dim=64, batch=2, heads_q=8, heads_kv=2)),
    param(Case(1000, dtype="bf16", head_dim=128, heads_q=4, heads_kv=4, causal=True)),
    param(Case(100, 300, dtype="bf16", head_dim=64, heads_q=4, heads_kv=1, causal=True)),
    param(Case(300, 100, dtype="fp16", head_dim=128, causal=True)),  # rows that see no key
    param(Case(129, 1000, dtype="bf16", head_dim=64, heads_q=8, heads_kv=8)),
    param(Case(1000, dtype="fp16", head_dim=128, batch=2, scale=0.3)),
    # More 128-row tiles (256 and 264) than the H200 has SMs: the persistent kernel's programs take several.
    param(Case(1000, 1100, dtype="bf16", head_dim=128, batch=4, heads_q=8, heads_kv=2, causal=True)),
    param(Case(1050, 900, dtype="fp16", head_dim=64, batch=3, heads_q=11, heads_kv=11)),
    # Head dims read padded into 128 columns.
    param(Case(257, dtype="bf16", head_dim=96, heads_q=4, heads_kv=2, causal=True)),
    param(Case(1000, 1100, dtype="fp16", head_dim=80, batch=2, heads_q=4, heads_kv=4, causal=True)),
    param(Case(129, 1000, dtype="bf16", head_dim=96, heads_q=8, heads_kv=8)),
    # Past 128 columns: read into 256, the output staged in Q's buffer.
    param(Case(1000, 1100, dtype="bf16", head_dim=256, batch=2, heads_q=8, heads_kv=2, causal=True)),
    param(Case(257, dtype="fp16", head_dim=256, heads_q=4, heads_kv=1)),
    param(Case(300, 100, dtype="bf16", head_dim=192, heads_q=4, heads_kv=2, causal=True)),  # rows that see no key
    # A QK past 128 above a V of 128 or fewer: read into 192 columns in three parts, V and the output in their own.
    param(Case(1000, 1100, dtype="bf16", head_dim=160, head_dim_v=128, batch=2, heads_q=8, heads_kv=2, causal=True)),
    param(Case(257, 1000, dtype="fp16", head_dim=192, head_dim_v=64, heads_q=4, heads_kv=1)),
    param(Case(1, 300, dtype="bf16", head_dim=136, head_dim_v=128, heads_q=2, heads_kv=2, causal=True)),
    param(Case(1050, 900, dtype="bf16", head_dim=192, batch=3, heads_q=11, heads_kv=11)),
    # A narrower V: its own descriptors and output columns (DeepSeek's 192/128).
    param(Case(1000, 1100, dtype="bf16", head_dim=192, head_dim_v=128, batch=2, heads_q=8, heads_kv=8, causal=True)),
    param(Case(257, 300, dtype="fp16", head_dim=128, head_dim_v=64, heads_q=4, heads_kv=2)),
]


def _skip_without_gluon(case, config) -> None:
    if not has_wgmma(device_info(torch.cuda.current_device())):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
    if config.block_m == 192 and case.head_dim != 64:
        pytest.skip("three consumer warpgroups at head dim 64 only")
    if case.head_dim > 128:
        spec = AttentionSpec(head_dim=case.head_dim, head_dim_v=case.dv, dtype=case.dtype)
        reason = feasible(spec, config, device_info(torch.cuda.current_device()))
        if reason is not None:
            pytest.skip(reason)
    if case.dv != case.head_dim and config.wgmma == 1:
        pytest.skip("a narrower V: the warp-specialized kernel only")


def _run_gluon(spec, config, q, k, v, launch_values, monkeypatch, out=None, **launch_kwargs):
    """``(out, lse)`` of ``spec``'s Gluon kernel that ``config`` names, into a poisoned output (``out``, else a new
    one); asserts the launcher took that kernel and wrote every element."""
    from functools import partial

    module = module_for(spec)
    monkeypatch.setattr(module, "TMA_MIN_WORK", 0)
    name = f"_{spec.name}_kernel_wgmma" + ("_ws" if config.wgmma > 1 else "")
    kernel = getattr(module, name)
    runs = []
    monkeypatch.setattr(module, name, type("Spy", (), {"__getitem__": lambda self, grid: runs.append(grid) or kernel[grid]})())
    poisoned = poisoned_like_out(q, v) if out is None else out
    out, lse = run_with_config(spec, config, q, k, v, *launch_values, out=poisoned,
                               launch=partial(module.launch, **launch_kwargs))
    torch.cuda.synchronize()
    assert len(runs) == 1, "the launcher did not take the Gluon kernel the config names"
    assert not torch.isnan(poisoned).any(), f"{torch.isnan(poisoned).sum().item()} output elements never written"
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("config", [WGMMA, Config(64, 128, 4, 3, tma=1, wgmma=1), Config(64, 64, 4, 2, tma=1, wgmma=1),
                                    WS, WS_PINGPONG, Config(128, 64, 8, 2, tma=1, wgmma=2),
                                    Config(128, 64, 8, 2, tma=1, wgmma=3), Config(128, 64, 8, 3, tma=1, wgmma=2),
                                    Config(192, 128, 12, 2, tma=1, wgmma=2), Config(192, 64, 12, 3, tma=1, wgmma=3)],
                         ids=str)
@pytest.mark.parametrize("case", GPU_CASES)
def test_gluon_kernel_matches_reference(case, config, monkeypatch):
    _skip_without_gluon(case, config)
    q, k, v = case.inputs(torch.device("cuda"))
    spec, left, right, scale, softcap = prepare_call(q, k, v, case.causal, None, None, case.scale, True)
    out, lse = _run_gluon(spec, config, q, k, v, (scale, softcap, left, right), monkeypatch)
    check_against_reference(out, lse, q, k, v, causal=case.causal, scale=case.scale)


WINDOW_CASES = [
    param(Case(1000, dtype="bf16", head_dim=128, heads_q=4, heads_kv=2, window=(300, 0))),  # a sliding window
    param(Case(1000, 1100, dtype="bf16", head_dim=128, batch=2, heads_q=8, heads_kv=2, window=(100, 50))),
    param(Case(300, 100, dtype="fp16", head_dim=128, window=(20, 10))),  # rows that see no key
    param(Case(1, 300, dtype="bf16", head_dim=64, heads_q=2, heads_kv=1, window=(5, 0))),
    param(Case(257, dtype="fp16", head_dim=64, heads_q=4, heads_kv=1, window=(64, 64))),
    # More 128-row tiles than SMs; a window of no left bound; past 128 columns.
    param(Case(1050, 900, dtype="fp16", head_dim=64, batch=3, heads_q=11, heads_kv=11, window=(500, 0))),
    param(Case(129, 1000, dtype="bf16", head_dim=96, heads_q=8, heads_kv=8, window=(None, 10))),
    param(Case(1000, 1100, dtype="bf16", head_dim=192, head_dim_v=128, heads_q=4, heads_kv=2, window=(256, 0))),
    param(Case(257, dtype="bf16", head_dim=256, heads_q=4, heads_kv=2, window=(100, 3))),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [WS, WS_PINGPONG, Config(128, 64, 8, 2, tma=1, wgmma=2),
                                    Config(128, 64, 8, 3, tma=1, wgmma=3), Config(192, 128, 12, 2, tma=1, wgmma=2)],
                         ids=str)
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_gluon_kernel_with_a_window_matches_reference(case, config, monkeypatch):
    _skip_without_gluon(case, config)
    reason = feasible(AttentionSpec(head_dim=case.head_dim, head_dim_v=case.dv, mask="window", dtype=case.dtype),
                      config, device_info(torch.cuda.current_device()))
    if reason is not None:
        pytest.skip(reason)
    q, k, v = case.inputs(torch.device("cuda"))
    spec, left, right, scale, softcap = prepare_call(q, k, v, False, case.window, None, case.scale, True)
    assert spec.mask == "window"
    out, lse = _run_gluon(spec, config, q, k, v, (scale, softcap, left, right), monkeypatch)
    check_against_reference(out, lse, q, k, v, window=case.window, scale=case.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [WGMMA, WS, WS_PINGPONG, Config(128, 64, 8, 3, tma=1, wgmma=2),
                                    Config(128, 64, 8, 2, tma=1, wgmma=3)], ids=str)
@pytest.mark.parametrize("head_dim,head_dim_v", [(72, 72), (96, 96), (120, 120), (200, 200), (168, 120)])
@pytest.mark.parametrize("aligned", [True, False], ids=["tma-store", "pointer-store"])
def test_a_padded_head_dim_writes_no_column_past_it(head_dim, head_dim_v, config, aligned, monkeypatch):
    """A head dim read into 128, 192 or 256 columns writes its own: the output is a view of a wider buffer whose
    extra columns hold a pattern, left as it was, through the TMA store and (a base off 16 bytes) the pointer
    store."""
    case = Case(300, 333, dtype="bf16", head_dim=head_dim, head_dim_v=head_dim_v, batch=2, heads_q=4, heads_kv=2,
                causal=True)
    _skip_without_gluon(case, config)
    q, k, v = case.inputs(torch.device("cuda"))
    offset = 0 if aligned else 1
    width = head_dim_v + 16
    buffer = torch.full((2 * 4 * 300 * width + offset, ), math.nan, dtype=q.dtype, device="cuda")
    wide = buffer[offset:].view(2, 4, 300, width)
    wide[..., head_dim_v:] = 7.0
    out = wide[..., :head_dim_v]
    spec, left, right, scale, softcap = prepare_call(q, k, v, True, None, None, None, True)
    _run_gluon(spec, config, q, k, v, (scale, softcap, left, right), monkeypatch, out=out)
    assert bool((wide[..., head_dim_v:] == 7.0).all()), "a column past the head dim was written"
    check_against_reference(out, None, q, k, v, causal=True)


_SOME_CONFIGS = [WGMMA, WS, WS_PINGPONG, Config(128, 64, 8, 2, tma=1, wgmma=2), Config(192, 128, 12, 2, tma=1, wgmma=2)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", _SOME_CONFIGS, ids=str)
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[3], GPU_CASES[4], GPU_CASES[5], GPU_CASES[8]])
def test_gluon_kernel_with_a_score_mod_matches_reference(case, config, monkeypatch):
    """ALiBi inlined in the Gluon kernels' softmax, against the float64 reference with the same mod (and its LSE)."""
    from tilegen.families import relative_error
    from tilegen.families.attention_fwd.reference import attention_reference
    from tilegen.mods import library
    from tilegen.ops.memo import with_mod_fields

    _skip_without_gluon(case, config)
    q, k, v = case.inputs(torch.device("cuda"))
    slopes = torch.rand(q.shape[1], device="cuda") + 0.1
    spec, left, right, scale, softcap = prepare_call(q, k, v, case.causal, None, None, case.scale, True)
    spec = with_mod_fields(spec, _alibi_text(q.shape[1]), None)
    out, lse = _run_gluon(spec, config, q, k, v, (scale, softcap, left, right), monkeypatch, mod_tensors=(slopes,))
    ref, ref_lse = attention_reference(q, k, v, causal=case.causal, scale=case.scale, score_mod=library.alibi(slopes))
    assert relative_error(out, ref)[0] < 1e-2
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (lse.double()[seen] - ref_lse[seen]).abs().max() < 2e-2


def _mask_mod_cases():
    from tilegen.mods import library

    docs = torch.tensor([0] * 300 + [1] * 129 + [2] * 500 + [3] * 71, device="cuda")
    docs_batched = torch.tensor([[0] * 400 + [1] * 857, [0] * 1 + [5] * 1256], device="cuda")
    prefix = torch.tensor([700, 0], dtype=torch.int32, device="cuda")
    # (id, mask mod, batch, query heads, KV heads, n_q, n_k, head dim, dtype)
    return [
        ("document-d128-gqa", library.document_mask(docs), 1, 8, 2, 1000, 1000, 128, torch.bfloat16),
        ("document-batched-d64", library.document_mask(docs_batched), 2, 4, 4, 1257, 1257, 64, torch.float16),
        ("prefix-lm-d128", library.prefix_lm(prefix), 2, 4, 1, 1000, 1100, 128, torch.bfloat16),
        ("sliding-global-d64", library.sliding_window(100, global_tokens=17), 1, 11, 11, 1050, 900, 64, torch.float16),
        ("causal-one-row-d96", library.causal(), 1, 2, 2, 1, 300, 96, torch.bfloat16),
        ("chunks-d128", lambda b, h, q_idx, kv_idx: (q_idx // 64 >= kv_idx // 64) & ((q_idx + b) % 5 != 1), 2, 4, 2,
         1000, 1000, 128, torch.bfloat16),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [WS, WS_PINGPONG, Config(128, 64, 8, 2, tma=1, wgmma=2),
                                    Config(128, 64, 8, 3, tma=1, wgmma=3)], ids=str)
@pytest.mark.parametrize("name", ["document-d128-gqa", "document-batched-d64", "prefix-lm-d128", "sliding-global-d64",
                                  "causal-one-row-d96", "chunks-d128"])
def test_gluon_kernel_with_a_mask_mod_matches_reference(name, config, monkeypatch):
    """The warp-specialized kernel walking a mask mod's block table (empty blocks skipped, whole ones unmasked, the
    mod evaluated on the others), against the float64 reference with the same mod, into a poisoned output."""
    from tilegen.families import relative_error
    from tilegen.families.attention_fwd.reference import attention_reference
    from tilegen.mods.blocks import block_table
    from tilegen.mods.trace import trace
    from tilegen.ops.memo import with_mod_fields

    if not has_wgmma(device_info(torch.cuda.current_device())):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
    _, mask_mod, batch, hq, hkv, n_q, n_k, dim, dtype = next(c for c in _mask_mod_cases() if c[0] == name)
    gen = torch.Generator().manual_seed(n_q + dim)
    q, k, v = (torch.randn(batch, h, n, dim, generator=gen).to("cuda", dtype)
               for h, n in ((hq, n_q), (hkv, n_k), (hkv, n_k)))
    spec, left, right, scale, softcap = prepare_call(q, k, v, False, None, None, None, True)
    traced = trace(mask_mod, "mask_mod")
    spec = with_mod_fields(spec, None, traced.canonical)
    table = block_table(traced.canonical, traced.tensors, batch, hq, n_q, n_k, config.block_m, config.block_n,
                        q.device)
    out, lse = _run_gluon(spec, config, q, k, v, (scale, softcap, left, right), monkeypatch,
                          mod_tensors=traced.tensors, mod_blocks=table)
    ref, ref_lse = attention_reference(q, k, v, mask_mod=mask_mod)
    assert relative_error(out, ref)[0] < 1e-2
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (lse.double()[seen] - ref_lse[seen]).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config", _SOME_CONFIGS, ids=str)
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[2], GPU_CASES[5], GPU_CASES[8]])
def test_gluon_kernel_with_a_softcap_matches_reference(case, config, monkeypatch):
    _skip_without_gluon(case, config)
    q, k, v = case.inputs(torch.device("cuda"))
    spec, left, right, scale, softcap = prepare_call(q, k, v, case.causal, None, 5.0, case.scale, True)
    out, lse = _run_gluon(spec, config, q, k, v, (scale, softcap, left, right), monkeypatch)
    check_against_reference(out, lse, q, k, v, causal=case.causal, softcap=5.0, scale=case.scale)


def test_the_head_dim_presets_render_and_their_defaults_are_feasible():
    """The presets for the other common head dims (96, 128 with a softcap, 192/128) build, render, and take a
    feasible default on an H200, where d96, the softcap at 128 and 192/128 are offered the Gluon kernels (192/128
    by default: the warp-specialized kernel with 64-key blocks)."""
    from tilegen.cli.spec_args import presets
    from tilegen.codegen import source_for

    for name in ("phi3-prefill", "gemma2-27b", "gemma2-27b-local", "deepseek-prefill"):
        spec = presets()[name]
        assert spec.name in source_for(spec)
        for _, config in default_rule(spec, HOPPER):
            assert feasible(spec, config, HOPPER) is None, (name, config)
    assert wgmma_unsupported(presets()["gemma2-27b"]) is None and wgmma_unsupported(presets()["phi3-prefill"]) is None
    deepseek = presets()["deepseek-prefill"]
    assert wgmma_unsupported(deepseek) is None
    if TRITON_36:  # the Gluon kernels run under Triton 3.6 only
        assert [c for _, c in default_rule(deepseek, HOPPER)] == [Config(128, 64, 8, 2, tma=1, wgmma=2)]
