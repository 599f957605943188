"""Ragged and paged batches on the warp-specialized Gluon kernel (the attention_varlen family's ``wgmma`` knob).

On the CPU: what the knob is offered for and refused for, the default rule, the sm90 compile of the ragged and
paged kernels with every wgmma asynchronous, and the descriptors the launches build. On a GPU (``gpu``): ragged
batches with empty and one-token sequences, lengths off every block, keys longer than queries, GQA and padded
head dims, against the float64 reference, into a poisoned output; paged batches over shuffled pages of 8 to 128
slots, last pages partly filled; and wrong offsets or page tables that stay inside the tensors.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from helpers import OnGpu, assert_guard_bands, gluon_descriptor, inside

import tilegen
from tilegen.bench import forced_config
from tilegen.device import DeviceInfo
from tilegen.families import relative_error
from tilegen.families.attention_varlen import VarlenAttentionSpec
from tilegen.families.attention_varlen.config import VarlenConfig, default_rule, feasible, search_space
from tilegen.families.attention_varlen.reference import varlen_reference
from tilegen.families.base import ConfigError
from tilegen.families.lowering import gluon_widths

HOPPER = DeviceInfo("NVIDIA H200", (9, 0), 132, 141 << 30, 232448)
AMPERE = DeviceInfo("NVIDIA A100", (8, 0), 108, 80 << 30, 166912)
TRITON_36 = triton.__version__.startswith("3.6.")
WS = VarlenConfig(128, 128, 8, 2, wgmma=2)
WS_PINGPONG = VarlenConfig(128, 128, 8, 2, wgmma=3)
WS_SHORT = VarlenConfig(128, 64, 8, 3, wgmma=2)
# Three slots of 128 keys leave no room for the output's own buffer: the stores go from the accumulators.
WS_UNSTAGED = VarlenConfig(128, 128, 8, 3, wgmma=2)
LLAMA = VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16")
PAGED = VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", kv_layout="paged", page_size=16)
# A QK of 192 above a V of 128: Q and K read in three 64-column parts, 64-key blocks.
DEEPSEEK = VarlenAttentionSpec(head_dim=192, head_dim_v=128, mask="causal", dtype="bf16")
WS_QK192 = [VarlenConfig(128, 64, 8, 2, wgmma=2), VarlenConfig(128, 64, 8, 3, wgmma=3)]


def test_the_knob_reads_and_labels_like_the_dense_ones():
    assert VarlenConfig.from_dict({"block_m": 64, "block_n": 64, "num_stages": 3, "num_warps": 4}).wgmma == 0
    assert VarlenConfig.from_dict(WS_PINGPONG.to_dict()) == WS_PINGPONG
    with pytest.raises(ConfigError, match="wgmma: expected one of 0, 2, 3, got 1"):
        VarlenConfig.from_dict({**WS.to_dict(), "wgmma": 1})
    assert [str(c) for c in (WS, WS_PINGPONG)] == ["BM128-BN128-w8-s2-ws", "BM128-BN128-w8-s2-ws-pp"]


@pytest.mark.skipif(not TRITON_36, reason="the wgmma knob is offered under Triton 3.6 only")
@pytest.mark.parametrize("spec,config,reason", [
    (VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", kv_layout="paged", page_size=16,
                         kv_dtype="fp8e4m3"), WS, "pages of the queries' dtype"),
    (VarlenAttentionSpec(head_dim=128, mask="causal", dtype="bf16", kv_layout="paged", page_size=1), WS,
     "multiple of 8 slots"),
    (VarlenAttentionSpec(head_dim=128, mask="causal", dtype="bf16", softcap=True), WS, "takes none of them"),
    (VarlenAttentionSpec(head_dim=128, mask="causal", dtype="fp32"), WS, "bf16 or fp16"),
    (VarlenAttentionSpec(head_dim=192, dtype="bf16"), WS, "equal ones from 64 to 128, or a QK of 136 to 192"),
    (VarlenAttentionSpec(head_dim=128, head_dim_v=64, dtype="bf16"), WS, "equal ones from 64 to 128"),
    (VarlenAttentionSpec(head_dim=192, head_dim_v=48, dtype="bf16"), WS, "the ragged Gluon kernel takes equal ones"),
    (VarlenAttentionSpec(head_dim=192, head_dim_v=128, dtype="bf16"), WS, "takes two consumers, BM128-BN64"),
    (LLAMA, VarlenConfig(64, 64, 4, 2, wgmma=2), "BM128 with 8 warps"),
    (LLAMA, VarlenConfig(128, 32, 8, 2, wgmma=2), "64 or 128"),
    (LLAMA, VarlenConfig(128, 128, 8, 4, wgmma=2), "shared memory"),
])
def test_refuses_what_the_ragged_kernel_does_not_run(spec, config, reason):
    assert reason in feasible(spec, config, HOPPER)
    offered = search_space(spec, HOPPER)["wgmma"]
    runs = spec == LLAMA or (spec.head_dim, spec.dv) == (192, 128)  # the tile is refused, not the kernel
    assert offered == ([0, 2, 3] if runs else [0])
    assert search_space(PAGED, HOPPER)["wgmma"] == [0, 2, 3]


@pytest.mark.skipif(not TRITON_36, reason="the wgmma knob is offered under Triton 3.6 only")
def test_default_rule_takes_the_warp_specialized_kernel_from_512_tokens_on_hopper():
    for spec in (LLAMA, PAGED, VarlenAttentionSpec(head_dim=96, dtype="fp16"),
                 VarlenAttentionSpec(head_dim=64, dtype="bf16", kv_layout="paged", page_size=128)):
        rule = default_rule(spec, HOPPER)
        assert rule[0][0] == 256 and not rule[0][1].wgmma and rule[-1] == (None, WS), (spec, rule)
        for _, config in rule:
            assert feasible(spec, config, HOPPER) is None, (spec, config)
    assert (1024, WS_SHORT) in default_rule(LLAMA, HOPPER)
    assert not any(c.wgmma for _, c in default_rule(LLAMA, AMPERE))
    for spec in (PAGED.replace(kv_dtype="fp8e4m3"), PAGED.replace(page_size=1)):
        assert not any(c.wgmma for _, c in default_rule(spec, HOPPER)), spec
    for spec in (DEEPSEEK, DEEPSEEK.replace(kv_layout="paged", page_size=64, q_per_kv=4)):
        rule = default_rule(spec, HOPPER)
        assert rule == [(256, VarlenConfig(64, 32, 4, 2)), (None, WS_QK192[0])], (spec, rule)
        for _, config in rule:
            assert feasible(spec, config, HOPPER) is None, (spec, config)


def test_ragged_and_paged_specs_carry_the_gluon_kernel():
    from tilegen.codegen import source_for

    source = source_for(LLAMA)
    # The launch takes it over the packed K and V, or over the pages.
    assert "_wgmma_ws(" in source and "_ws_tile_ragged" in source and "sequences = (cu_seqlens_k," in source
    assert "_ws_load_pages" not in source
    # The one-partition kernel (wgmma=1) is the dense family's alone.
    assert "_kernel_wgmma(" not in source
    paged = source_for(PAGED)
    assert "sequences = (page_indptr," in paged and "_ws_load_pages(" in paged and "cu_seqlens_k" not in paged
    for spec in (PAGED.replace(kv_dtype="fp8e4m3"), PAGED.replace(page_size=1)):
        assert "gluon" not in source_for(spec), spec


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernel is written against Triton 3.6's API")
@pytest.mark.parametrize("spec", [
    VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", return_lse=True),
    VarlenAttentionSpec(head_dim=96, mask="none", dtype="fp16"),
    PAGED.replace(return_lse=True),
    PAGED.replace(head_dim=96, q_per_kv=8, page_size=64),
    DEEPSEEK,
    DEEPSEEK.replace(kv_layout="paged", page_size=16, q_per_kv=4),
], ids=lambda s: s.name)
def test_the_ragged_kernel_compiles_for_sm90_with_asynchronous_wgmma(spec, tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TILEGEN_CACHE_DIR"] = str(tmp_path)
    dim, dim_v = gluon_widths(spec.head_dim, spec.dv)
    dim, block_n = (64, 64) if dim == 192 else (dim, 128)  # a QK of 192 in 64-column parts, 64-key blocks
    kv_rows = min(spec.page_size or block_n, block_n)  # a paged descriptor's block is a page
    pointers = {"Out": f"*{spec.dtype}", "Lse": "*fp32", "Sched": "*i32", "qk_scale": "fp32", "CuQ": "*i32",
                "CuK": "*i32", "PageIndptr": "*i32", "Pages": "*i32", "LastLen": "*i32",
                "q_desc": gluon_descriptor(64, dim, spec.dtype), "k_desc": gluon_descriptor(kv_rows, dim, spec.dtype),
                "v_desc": gluon_descriptor(kv_rows, dim_v, spec.dtype)}
    request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "kernel": "kernel_wgmma_ws", "ptxas": True,
               "configs": [{"PINGPONG": pingpong, "CONSUMERS": 2, "TMA_STORE": staged, "SCHEDULED": False,
                            "BLOCK_N": block_n, "STAGES": 2, "num_warps": 4}
                           for pingpong, staged in ((False, True), (True, False))]}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py")), json.dumps(request)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.endswith("wgmma async") for line in lines), done.stdout


def _spied_module(spec, monkeypatch):
    """``spec``'s generated module with its Gluon and Triton kernels replaced by a spy, and the list of the
    launches (grid, arguments, keywords) it records; its stand-in CUDA device 0 has 132 SMs."""
    from tilegen.codegen.cache import module_for

    module = module_for(spec)
    if module.gluon is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(module, "_SMS", {0: 132})
    launches = []
    spy = type("Spy", (), {"__getitem__": lambda self, grid: (lambda *a, **k: launches.append((grid, a, k)))})()
    monkeypatch.setattr(module, f"_{spec.name}_kernel_wgmma_ws", spy)
    monkeypatch.setattr(module, f"_{spec.name}_kernel", spy)
    return module, launches


@pytest.mark.parametrize("aligned", [True, False])
def test_the_ragged_launch_views_the_packed_tensors_and_deals_the_tiles_in_turns(aligned, monkeypatch):
    """The descriptors view Q, K and V [total, heads, dim] as [1, heads, total, dim] with their own strides,
    padded to 128 columns at d96; the tiles are every (sequence, head)'s of the longest sequence; the lengths go
    per tile (n_q the longest, n_k and the diagonal 0); a Q whose head dim is not contiguous (no descriptor) takes
    the Triton kernel."""
    module, launches = _spied_module(
        VarlenAttentionSpec(head_dim=96, q_per_kv=4, mask="causal", dtype="bf16", return_lse=True), monkeypatch)
    lengths, total = [300, 0, 1000, 5], 1305
    q = torch.empty(total, 8, 96 if aligned else 192, dtype=torch.bfloat16)[..., :96].as_subclass(OnGpu)
    if not aligned:
        q = q.transpose(1, 2).contiguous().transpose(1, 2).as_subclass(OnGpu)  # head dim not contiguous
    k, v = (torch.empty(total, 2, 96, dtype=torch.bfloat16).as_subclass(OnGpu) for _ in range(2))
    out, lse = torch.empty(total, 8, 96, dtype=torch.bfloat16), torch.empty(total, 8)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    module.launch(q, k, v, out, lse, cu, cu, 1000, scale=0.1, softcap=0.0, window_left=1 << 30, window_right=0,
                  **WS.to_dict())
    (grid, args, kwargs), = launches
    if not aligned:
        assert "PINGPONG" not in kwargs and grid == (8, 4, 8)  # the Triton kernel's (query blocks, batch, heads)
        return
    # 1305 tokens against 4 x 1000 rows of tiles: under 2 in 5 tiles hold rows, so a program a tile
    assert grid == (8 * 4 * 8, ) and kwargs["PINGPONG"] is False and kwargs["TMA_STORE"] is True  # a staging buffer
    q_desc, k_desc = args[0], args[1]
    assert q_desc.shape == [1, 8, total, 96] and q_desc.strides == [total * q.stride(0), 96, q.stride(0), 1]
    assert q_desc.block_shape == [1, 1, 64, 128] and k_desc.block_shape == [1, 1, 128, 128]
    assert k_desc.shape == [1, 2, total, 96] and k_desc.strides == [total * 192, 96, 192, 1]
    assert args[3] is out and args[4] is lse and args[5] is None
    # stride_ob, stride_oh, stride_om, stride_od, n_heads, n_bh, n_q, n_k, diag_offset
    assert args[6:15] == (0, 96, 768, 1, 8, 32, 1000, 0, 0)
    assert args[16] is cu and args[17] is cu and args[18:21] == (total, total, 8)


def _launch_d128(module, cu, total, max_len, mask, config) -> None:
    """``module``'s launch over ``total`` packed tokens of 8 query and 2 KV heads of 128 (stand-ins on a GPU)."""
    q, out = (torch.empty(total, 8, 128, dtype=torch.bfloat16).as_subclass(OnGpu) for _ in range(2))
    k, v = (torch.empty(total, 2, 128, dtype=torch.bfloat16).as_subclass(OnGpu) for _ in range(2))
    module.launch(q, k, v, out, out, cu, cu, max_len, scale=0.1, softcap=0.0, window_left=1 << 30,
                  window_right=1 << 30 if mask == "none" else 0, **config.to_dict())


@pytest.mark.parametrize("mask, lengths, programs", [
    # 8 heads: 10 sequences of up to 32 query tiles make 2560 tiles, 19.5 a program in turns
    ("causal", [4096] * 9 + [3000], 131),  # 32 query tiles a sequence, most of them full: in turns, an odd count
    ("causal", [4097] + [4000] * 9, 33 * 10 * 8),  # more tiles a sequence: a program a tile, handed out as SMs free
    ("causal", [4096] + [1] * 9, 32 * 10 * 8),  # under 2 in 5 tiles hold rows: a program a tile, the empty ones exit
    ("causal", [4096] * 4 + [1] * 6, 131),  # 16390 of 10 x 4096 rows of tiles: in turns
    ("causal", [4096] * 6, 32 * 6 * 8),  # 1536 tiles, 11.7 a program: a program a tile, no tail of one tile more
    ("none", [64 * 128] * 5, 132),  # without a mask the tiles cost alike: in turns at any length, a program an SM
    ("none", [2, 1, 1], 3 * 8),  # fewer tiles than SMs: a program each
])
def test_the_ragged_grid_takes_turns_up_to_32_causal_query_tiles_of_a_full_batch(mask, lengths, programs,
                                                                                 monkeypatch):
    """The ragged grid is sized as the dense one, and a program a tile where most tiles lie past their rows or a
    program would take fewer than 16."""
    module, launches = _spied_module(VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask=mask, dtype="bf16"),
                                     monkeypatch)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    _launch_d128(module, cu, sum(lengths), max(lengths), mask, WS)
    (grid, _, _), = launches
    assert grid == (programs, )


def test_a_ragged_batch_of_more_tiles_than_int32_numbers_is_refused_by_name(monkeypatch):
    """The tiles (the longest sequence's for every sequence and head) are numbered in int32 inside the kernel: a
    batch past that is refused before the launch, never run on wrapped tile numbers."""
    module, launches = _spied_module(VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="none", dtype="bf16"),
                                     monkeypatch)
    cu = torch.zeros(2 ** 15 + 1, dtype=torch.int32)  # 32768 sequences beside one of 2**20 tokens: 2**34 tiles
    with pytest.raises(ValueError, match=r"max_seqlen_q=1048576: 8192 query tiles .* 32768 sequences and 8 heads"):
        _launch_d128(module, cu, 16, 2 ** 20, "none", WS)
    assert launches == []


@pytest.mark.parametrize("config, staged", [(WS, True), (WS_SHORT, True), (WS_UNSTAGED, False)], ids=str)
def test_the_ragged_output_is_staged_where_a_buffer_fits_beside_the_ring(config, staged, monkeypatch):
    """The output goes through a buffer of its own (the kernel's TMA_STORE) where Q's, the K/V ring's and its own
    fit the H200's shared memory: two slots of 128 keys at d128, not three."""
    module, launches = _spied_module(LLAMA, monkeypatch)
    _launch_d128(module, torch.tensor([0, 300], dtype=torch.int32), 300, 300, "causal", config)
    (_, _, kwargs), = launches
    assert kwargs["TMA_STORE"] is staged


@pytest.mark.parametrize("whole", [True, False])
def test_the_paged_launch_views_the_pages_as_one_tensor_of_slots(whole, monkeypatch):
    """K's and V's descriptors view pages [num_pages, 16, kv_heads, dim] as [1, kv_heads, num_pages * 16, dim] in
    blocks of one page; the kernel takes the page table after CuQ, with its extents. Pages whose slots do not
    follow one another (every other page of a larger tensor) allow no such view and take the Triton kernel."""
    module, launches = _spied_module(PAGED.replace(return_lse=True), monkeypatch)
    k_pages, v_pages = (torch.empty(20 if whole else 40, 16, 2, 128, dtype=torch.bfloat16)[::1 if whole else 2]
                        .as_subclass(OnGpu) for _ in range(2))
    q = torch.empty(300, 8, 128, dtype=torch.bfloat16).as_subclass(OnGpu)
    out, lse = torch.empty(300, 8, 128, dtype=torch.bfloat16), torch.empty(300, 8)
    cu_q = torch.tensor([0, 290, 300], dtype=torch.int32)
    indptr, indices, last = (torch.tensor(x, dtype=torch.int32) for x in ([0, 19, 20], list(range(20)), [5, 16]))
    module.launch(q, k_pages, v_pages, out, lse, cu_q, indptr, indices, last, 290, scale=0.1, softcap=0.0,
                  window_left=1 << 30, window_right=0, **WS.to_dict())
    (grid, args, kwargs), = launches
    if not whole:
        assert "PINGPONG" not in kwargs and grid == (3, 2, 8)  # the Triton kernel's (query blocks, batch, heads)
        return
    assert grid == (3 * 2 * 8, ) and kwargs["BLOCK_N"] == 128 and kwargs["TMA_STORE"] is True  # below 131
    for desc in args[1:3]:
        assert desc.shape == [1, 2, 20 * 16, 128] and desc.strides == [20 * 16 * 256, 128, 256, 1]
        assert desc.block_shape == [1, 1, 16, 128]
    assert args[0].block_shape == [1, 1, 64, 128]
    # n_heads, n_bh, n_q, n_k, diag_offset, then CuQ, the page table, total_q, n_indices, num_pages, the LSE's stride
    assert args[10:15] == (8, 16, 290, 0, 0)
    assert args[16] is cu_q and args[17] is indptr and args[18] is indices and args[19] is last
    assert args[20:24] == (300, 20, 20, 8)


# --------------------------------------------------------------------------------------------------- on a GPU

def _gluon_ran(call) -> list[str]:
    """The names of the kernels ``call`` launched."""
    from triton import knobs

    names = []

    def seen(metadata):
        names.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(seen)
    try:
        call()
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(seen)
    return names


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


CASES = [
    # (query lengths, extra keys per sequence (or the key lengths), causal, query heads / KV heads, head dim, dtype)
    pytest.param([0, 1, 17, 257, 1000, 130], 0, True, (8, 2), 128, torch.bfloat16, id="bf16-d128-gqa4-causal"),
    pytest.param([300, 0, 129, 1], 70, True, (4, 4), 128, torch.float16, id="fp16-d128-mha-causal-longer-keys"),
    pytest.param([64, 1000, 5, 333], 0, False, (8, 1), 64, torch.bfloat16, id="bf16-d64-mqa-full"),
    pytest.param([257, 3, 700], 9, True, (4, 2), 96, torch.bfloat16, id="bf16-d96-causal"),
    pytest.param([2000], 0, True, (2, 2), 80, torch.float16, id="fp16-d80-one-sequence"),
    # A padded batch read in place (tilegen.integrations.transformers): each padding run is queries with no
    # keys, then keys with no queries, beside each row's real tokens. Key lengths given whole.
    pytest.param([130, 0, 257, 61, 0, 700, 9, 0], [0, 130, 257, 0, 61, 700, 0, 40], True, (8, 2), 128,
                 torch.bfloat16, id="bf16-d128-causal-padding-in-place"),
]


def _few_programs(spec, programs, monkeypatch) -> None:
    """With ``programs``, the launcher of ``spec`` sees a GPU of that many SMs: each program then takes many tiles
    in turns, skipping those past their sequences' rows, and reuses its buffers from tile to tile."""
    from tilegen.codegen.cache import module_for

    if programs is not None:
        module = module_for(spec)
        monkeypatch.setitem(module._SMS, torch.cuda.current_device(), programs)
        monkeypatch.setattr(module, "_TURNS_FILL", 0.0)  # in turns however few tiles hold rows
        monkeypatch.setattr(module, "_TURNS_TILES", 1)  # and however few tiles a program takes


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 3], ids=["sms", "3-programs"])
@pytest.mark.parametrize("config", [WS, WS_PINGPONG, WS_SHORT, WS_UNSTAGED], ids=str)
@pytest.mark.parametrize("q_lens, extra, causal, heads, dim, dtype", CASES)
def test_ragged_gluon_matches_reference(q_lens, extra, causal, heads, dim, dtype, config, programs, monkeypatch):
    if programs is not None and config not in (WS, WS_UNSTAGED):
        pytest.skip("many tiles a program are checked with the staged and the unstaged store")
    gen = torch.Generator().manual_seed(sum(q_lens) + dim)
    k_lens = extra if isinstance(extra, list) else [n + extra for n in q_lens]
    q = torch.randn(sum(q_lens), heads[0], dim, generator=gen).to("cuda", dtype)
    k, v = (torch.randn(sum(k_lens), heads[1], dim, generator=gen).to("cuda", dtype) for _ in range(2))
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    out = torch.full_like(q, math.nan)
    spec = VarlenAttentionSpec(head_dim=dim, q_per_kv=heads[0] // heads[1], mask="causal" if causal else "none",
                               dtype="bf16" if dtype == torch.bfloat16 else "fp16", return_lse=True)
    if has_no_gluon(spec):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
    _few_programs(spec, programs, monkeypatch)
    with forced_config("attention_varlen", config):
        names = _gluon_ran(lambda: tilegen.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),
                                                            causal=causal, return_lse=True, out=out))
        _, lse = tilegen.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal,
                                          return_lse=True, out=out)
    assert any("_wgmma_ws" in n for n in names), names
    assert not torch.isnan(out).any(), f"{torch.isnan(out).sum().item()} output elements never written"
    ck = cu_k.tolist()
    ref, ref_lse = varlen_reference(q, [k[a:b] for a, b in zip(ck, ck[1:])], [v[a:b] for a, b in zip(ck, ck[1:])],
                                    cu_q.cpu(), causal=causal)
    assert relative_error(out, ref)[0] < 1e-2
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse.to(lse.device)))
    seen = torch.isfinite(ref_lse).to(lse.device)
    assert (lse.double()[seen] - ref_lse.to(lse.device)[seen]).abs().max() < 2e-2


def has_no_gluon(spec) -> bool:
    from tilegen.device import device_info

    return feasible(spec, WS, device_info(torch.cuda.current_device())) is not None


WRONG = [
    # (which offsets, entry, value, sequences it spoils), as tests/test_varlen.py's WRONG_RAGGED
    pytest.param("q", 4, 32 + 5, {3}, id="q-ends-past-the-rows"),
    pytest.param("q", 3, 1000, {2, 3}, id="q-far-past-the-rows"),
    pytest.param("q", 0, -3, {0}, id="q-negative-start"),
    pytest.param("k", 1, -4, {0, 1}, id="k-negative"),
    pytest.param("k", 3, 2, {2, 3}, id="k-decreasing"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("which, entry, value, spoiled", WRONG)
def test_ragged_gluon_offsets_wrong_in_value_stay_inside_the_tensors(which, entry, value, spoiled, monkeypatch):
    monkeypatch.delenv("TILEGEN_DEBUG", raising=False)
    if has_no_gluon(LLAMA):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
    gen = torch.Generator().manual_seed(entry)
    q_lens, k_lens = [17, 5, 1, 9], [20, 5, 3, 9]
    pad = 8
    q, _ = inside(torch.randn(sum(q_lens), 8, 128, generator=gen).to("cuda", torch.bfloat16), pad, math.nan)
    k, _ = inside(torch.randn(sum(k_lens), 2, 128, generator=gen).to("cuda", torch.bfloat16), pad, math.nan)
    v, _ = inside(torch.randn(sum(k_lens), 2, 128, generator=gen).to("cuda", torch.bfloat16), pad, math.nan)
    cu = {"q": _cu(q_lens), "k": _cu(k_lens)}
    ck = cu["k"].tolist()
    ref, _ = varlen_reference(q, [k[a:b] for a, b in zip(ck, ck[1:])], [v[a:b] for a, b in zip(ck, ck[1:])],
                              cu["q"].cpu(), causal=True)
    cq = cu["q"].tolist()
    good = [r for b in sorted(set(range(4)) - spoiled) for r in range(cq[b], cq[b + 1])]
    wrong = {name: t.clone() for name, t in cu.items()}
    wrong[which][entry] = value
    out, out_buffer = inside(torch.full((q.shape[0], 8, 128), 1e3, device="cuda", dtype=torch.bfloat16), pad, -77.0)
    with forced_config("attention_varlen", WS):
        names = _gluon_ran(lambda: tilegen.varlen_attention(q, k, v, wrong["q"], wrong["k"], max(q_lens),
                                                            max(k_lens), causal=True, out=out))
    assert any("_wgmma_ws" in n for n in names), names
    assert_guard_bands(out_buffer, pad, -77.0)
    assert torch.isfinite(out).all(), "a kernel read outside q, k or v"
    assert relative_error(out[good], ref[good])[0] < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config", [WS, WS_PINGPONG, WS_SHORT], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_a_sequence_reads_none_of_its_neighbours_nan(causal, config):
    """A key block past a sequence's last key reads the next sequence's rows, or rows no sequence owns: NaN in those
    (the second sequence's keys and values, 40 rows past the last) stays out of every other sequence's output."""
    if has_no_gluon(LLAMA):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
    gen = torch.Generator().manual_seed(5)
    lens, tail = [100, 57, 300, 31], 40
    q = torch.randn(sum(lens), 8, 128, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(sum(lens) + tail, 2, 128, generator=gen).to("cuda", torch.bfloat16) for _ in "kv")
    cu = _cu(lens).tolist()
    for t in (k, v):
        t[cu[1]:cu[2]] = math.nan
        t[cu[-1]:] = math.nan
    out = torch.full_like(q, math.nan)
    with forced_config("attention_varlen", config):
        names = _gluon_ran(lambda: tilegen.varlen_attention(q, k, v, _cu(lens), _cu(lens), max(lens), max(lens),
                                                            causal=causal, out=out))
    assert any("_wgmma_ws" in n for n in names), names
    ref, _ = varlen_reference(q, [k[a:b] for a, b in zip(cu, cu[1:])], [v[a:b] for a, b in zip(cu, cu[1:])],
                              _cu(lens).cpu(), causal=causal)
    for b in (0, 2, 3):
        rows = slice(cu[b], cu[b + 1])
        assert torch.isfinite(out[rows]).all(), f"sequence {b} read a neighbour's NaN"
        assert relative_error(out[rows], ref[rows])[0] < 1e-2, f"sequence {b}"


WINDOW_CASES = [
    # (query lengths, extra keys per sequence, window, query heads / KV heads, head dim, dtype)
    pytest.param([0, 1, 17, 257, 1000, 130], 0, (300, 0), (8, 2), 128, torch.bfloat16, id="bf16-d128-sliding"),
    pytest.param([300, 0, 129, 1], 70, (20, 40), (4, 4), 64, torch.float16, id="fp16-d64-both-sides"),
    pytest.param([700, 5], [0, 600], (None, 3), (4, 2), 96, torch.bfloat16, id="bf16-d96-no-left-bound"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 3], ids=["sms", "3-programs"])
@pytest.mark.parametrize("config", [WS, WS_PINGPONG, WS_SHORT], ids=str)
@pytest.mark.parametrize("q_lens, extra, window, heads, dim, dtype", WINDOW_CASES)
@pytest.mark.parametrize("layout", ["ragged", "paged"])
def test_a_window_ragged_and_paged(layout, q_lens, extra, window, heads, dim, dtype, config, programs, monkeypatch):
    """A window's tiles read their key blocks from the window's first on: packed sequences (with empty ones and
    rows that see no key), and pages of 16 slots shuffled, NaN in every unused one."""
    gen = torch.Generator().manual_seed(sum(q_lens) + dim)
    k_lens = extra if isinstance(extra, list) else [n + extra for n in q_lens]
    spec = VarlenAttentionSpec(head_dim=dim, q_per_kv=heads[0] // heads[1], mask="window", return_lse=True,
                               dtype="bf16" if dtype == torch.bfloat16 else "fp16")
    if layout == "paged":
        spec = spec.replace(kv_layout="paged", page_size=16)
    if has_no_gluon(spec):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
    _few_programs(spec, programs, monkeypatch)
    q = torch.randn(sum(q_lens), heads[0], dim, generator=gen).to("cuda", dtype)
    out = torch.full((q.shape[0], heads[0], dim), math.nan, dtype=dtype, device="cuda")
    with forced_config("attention_varlen", config):
        _check_ragged_or_paged(16 if layout == "paged" else None, q, q_lens, k_lens, heads[1], (dim, dim), out, gen,
                               window=window)


def _check_ragged_or_paged(page_size, q, q_lens, k_lens, heads_kv, dims, out, gen, **mask) -> None:
    """``tilegen.varlen_attention`` over packed keys and values drawn from ``gen`` (``page_size`` None), or
    ``PagedAttention`` over a cache of shuffled pages of that size (NaN in every unused slot), each with the mask
    arguments, into the poisoned ``out``: the Gluon kernel ran, wrote every element, and agrees with the float64
    reference (output and LSE)."""
    from test_varlen import make_cache, paged_reference

    cu_q = _cu(q_lens)
    if page_size is not None:
        cache = make_cache(k_lens, page_size, heads_kv, dims[0], q.dtype, "cuda", gen, dim_v=dims[1])
        attn = tilegen.PagedAttention()
        attn.plan(cu_q, cache, heads_q=q.shape[1], return_lse=True, max_seqlen_q=max(q_lens),
                  max_seqlen_k=max(k_lens), **mask)
        names = _gluon_ran(lambda: attn.run(q, cache, out=out))
        _, lse = attn.run(q, cache, out=out)
        ref, ref_lse = paged_reference(q, cache, cu_q, **mask)
    else:
        k, v = (torch.randn(sum(k_lens), heads_kv, d, generator=gen).to("cuda", q.dtype) for d in dims)
        cu_k = _cu(k_lens)

        def call():
            return tilegen.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), return_lse=True, out=out,
                                            **mask)

        names = _gluon_ran(call)
        _, lse = call()
        ck = cu_k.tolist()
        ref, ref_lse = varlen_reference(q, [k[a:b] for a, b in zip(ck, ck[1:])], [v[a:b] for a, b in zip(ck, ck[1:])],
                                        cu_q.cpu(), **mask)
    assert any("_wgmma_ws" in n for n in names), names
    assert not torch.isnan(out).any(), f"{torch.isnan(out).sum().item()} output elements never written"
    assert relative_error(out.cpu(), ref.cpu())[0] < 1e-2
    ref_lse = ref_lse.cpu()
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
    seen = torch.isfinite(ref_lse)
    assert (lse.cpu().double()[seen] - ref_lse[seen]).abs().max() < 2e-2


PAGED_CASES = [
    # (page size, query lengths, extra keys per sequence, query heads / KV heads, head dim, dtype)
    pytest.param(16, [0, 1, 17, 300, 5], [0, 40, 0, 700, 64], (8, 2), 128, torch.bfloat16, id="p16-d128-gqa4"),
    pytest.param(8, [129, 3, 64], [7, 1000, 0], (4, 4), 64, torch.float16, id="p8-d64-mha-fp16"),
    pytest.param(64, [257, 1, 90], [63, 0, 1], (8, 1), 96, torch.bfloat16, id="p64-d96-mqa"),
    pytest.param(128, [500, 33], [129, 300], (8, 2), 128, torch.bfloat16, id="p128-d128"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 3], ids=["sms", "3-programs"])
@pytest.mark.parametrize("page_size, q_lens, extra, heads, dim, dtype", PAGED_CASES)
@pytest.mark.parametrize("config", [WS, WS_PINGPONG, WS_SHORT, WS_UNSTAGED], ids=str)
def test_paged_gluon_matches_reference(page_size, q_lens, extra, heads, dim, dtype, config, programs, monkeypatch):
    """Chunked prefill over shuffled pages (NaN in every unused slot), into a poisoned output: BN128 reads whole
    pages a copy each, or two 64-key blocks of one 128-slot page (WS_SHORT), at the page's offset; with 3
    programs, many tiles each (the loader's zeroing barrier keeps its phase from tile to tile)."""
    from test_varlen import make_cache, paged_reference

    if config != WS and page_size not in (16, 128):
        pytest.skip("ping-pong and 64-key blocks are checked on pages of 16 and 128 slots")
    if programs is not None and config not in (WS, WS_UNSTAGED):
        pytest.skip("many tiles a program are checked with the staged and the unstaged store")
    gen = torch.Generator().manual_seed(page_size + dim)
    k_lens = [n + e for n, e in zip(q_lens, extra)]
    cache = make_cache(k_lens, page_size, heads[1], dim, dtype, "cuda", gen)
    spec = PAGED.replace(head_dim=dim, q_per_kv=heads[0] // heads[1], page_size=page_size, return_lse=True,
                         dtype="bf16" if dtype == torch.bfloat16 else "fp16")
    if has_no_gluon(spec):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
    _few_programs(spec, programs, monkeypatch)
    q = torch.randn(sum(q_lens), heads[0], dim, generator=gen).to("cuda", dtype)
    cu_q = _cu(q_lens)
    attn = tilegen.PagedAttention()
    out = torch.full_like(q, math.nan)
    with forced_config("attention_varlen", config):
        attn.plan(cu_q, cache, heads_q=heads[0], causal=True, return_lse=True, max_seqlen_q=max(q_lens),
                  max_seqlen_k=max(k_lens))
        names = _gluon_ran(lambda: attn.run(q, cache, out=out))
    _, lse = attn.run(q, cache, out=out)
    assert any("_wgmma_ws" in n for n in names), names
    assert not torch.isnan(out).any(), f"{torch.isnan(out).sum().item()} output elements never written"
    ref, ref_lse = paged_reference(q, cache, cu_q, causal=True)
    assert relative_error(out.cpu(), ref)[0] < 1e-2
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
    seen = torch.isfinite(ref_lse)
    assert (lse.cpu().double()[seen] - ref_lse[seen]).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fault, spoiled", [
    pytest.param("page-past-the-cache", {1}), pytest.param("page-negative", {1}),
    pytest.param("last-page-too-long", {1}), pytest.param("indptr-past-indices", {3}),
    pytest.param("indptr-decreasing", {1, 2}), pytest.param("indptr-negative", {0}),
], ids=lambda x: x if isinstance(x, str) else "")
def test_paged_gluon_with_a_wrong_page_table_stays_inside_the_cache(fault, spoiled, monkeypatch):
    from test_varlen import PAGED_K_LENS, guarded_cache, paged_reference

    monkeypatch.delenv("TILEGEN_DEBUG", raising=False)
    if has_no_gluon(PAGED):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
    caches = [guarded_cache(PAGED_K_LENS, 16, 2, 128, "cuda", torch.Generator().manual_seed(1), f,
                            dtype=torch.bfloat16) for f in (None, fault)]
    q_lens, pad = [3, 17, 2, 5], 8
    cu_q = _cu(q_lens)
    q = torch.randn(sum(q_lens), 8, 128, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    q, _ = inside(q, pad, math.nan)
    ref, _ = paged_reference(q, caches[0], cu_q, causal=True)
    out, out_buffer = inside(torch.full((q.shape[0], 8, 128), 1e3, device="cuda", dtype=torch.bfloat16), pad, -77.0)
    attn = tilegen.PagedAttention()
    with forced_config("attention_varlen", WS):
        attn.plan(cu_q, caches[1], heads_q=8, causal=True, max_seqlen_q=max(q_lens), max_seqlen_k=max(PAGED_K_LENS))
        names = _gluon_ran(lambda: attn.run(q, caches[1], out=out))
    assert any("_wgmma_ws" in n for n in names), names
    assert_guard_bands(out_buffer, pad, -77.0)
    assert torch.isfinite(out).all(), "a kernel read outside q, the pages or the page table"
    cq = cu_q.tolist()
    good = [r for b in sorted(set(range(4)) - spoiled) for r in range(cq[b], cq[b + 1])]
    assert relative_error(out[good].cpu(), ref[good])[0] < 1e-2


def test_a_launch_asks_gluon_for_a_blocks_shared_layout_once(monkeypatch):
    """The launcher keeps each key block size's TMA layouts (Gluon's get_default_for costs microseconds a call):
    the kept ones are Gluon's, asked for at the first launch with that block size only."""
    module, launches = _spied_module(PAGED, monkeypatch)
    layouts = module.gl.NVMMASharedLayout
    real = layouts.get_default_for
    asked = []
    monkeypatch.setattr(layouts, "get_default_for", lambda *a, **k: asked.append(a) or real(*a, **k))
    monkeypatch.setattr(module, "_SMEM_LAYOUTS", {})
    k_pages, v_pages = (torch.empty(4, 16, 2, 128, dtype=torch.bfloat16).as_subclass(OnGpu) for _ in range(2))
    q = torch.empty(40, 8, 128, dtype=torch.bfloat16).as_subclass(OnGpu)
    out, lse = torch.empty(40, 8, 128, dtype=torch.bfloat16), torch.empty(40, 8)
    cu_q, indptr, indices, last = (torch.tensor(x, dtype=torch.int32) for x in ([0, 40], [0, 4], [0, 1, 2, 3], [16]))
    for config in (WS, WS, WS_SHORT, WS):
        module.launch(q, k_pages, v_pages, out, lse, cu_q, indptr, indices, last, 40, scale=0.1, softcap=0.0,
                      window_left=1 << 30, window_right=0, **config.to_dict())
    assert [a[0] for a in asked] == [[1, 1, 64, 128], [1, 1, 128, 128], [1, 1, 64, 128], [1, 1, 64, 128]]
    assert len(launches) == 4 and all(grid == (8, ) for grid, _, _ in launches)  # one tile per head
    first, short = launches[0][1], launches[2][1]
    assert first[0].layout == real([1, 1, 64, 128], module.gl.bfloat16) and first[1].layout is launches[1][1][1].layout
    assert first[1].layout == real([1, 1, 128, 128], module.gl.bfloat16)
    assert short[1].layout == real([1, 1, 64, 128], module.gl.bfloat16) and launches[3][1][1].layout is first[1].layout


@pytest.mark.gpu
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "pointer-store"])
@pytest.mark.parametrize("config", WS_QK192, ids=str)
@pytest.mark.parametrize("layout, causal, heads, q_lens, extra", [
    pytest.param("ragged", True, (8, 2), [0, 1, 17, 257, 1000, 130], 0, id="ragged-gqa4-causal"),
    pytest.param("ragged", False, (4, 4), [300, 0, 129, 1], 70, id="ragged-mha-full-longer-keys"),
    pytest.param(16, True, (8, 2), [0, 1, 17, 300, 5], [0, 40, 0, 700, 64], id="p16-gqa4"),
    pytest.param(64, True, (4, 1), [257, 1, 90], [63, 0, 1], id="p64-mqa"),
])
def test_a_qk_of_192_over_a_v_of_128_ragged_and_paged(layout, causal, heads, q_lens, extra, config, staged,
                                                       monkeypatch):
    """DeepSeek's 192/128 through the Gluon kernel, Q and K in three 64-column parts: packed sequences and shuffled
    pages (NaN in every unused slot) against the float64 reference, into a poisoned output, with the output staged
    in its own buffer or stored from the accumulators."""
    from tilegen.codegen.cache import module_for

    dtype = torch.bfloat16
    paged = layout != "ragged"
    spec = DEEPSEEK.replace(q_per_kv=heads[0] // heads[1], mask="causal" if causal else "none", return_lse=True,
                            **({"kv_layout": "paged", "page_size": layout} if paged else {}))
    if has_no_gluon(spec.replace(head_dim=128, head_dim_v=None)):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
    if not staged:
        monkeypatch.setattr(module_for(spec), "_STAGING_SMEM", 0)
    gen = torch.Generator().manual_seed(len(q_lens) + heads[0])
    k_lens = [n + e for n, e in zip(q_lens, extra)] if isinstance(extra, list) else [n + extra for n in q_lens]
    q = torch.randn(sum(q_lens), heads[0], 192, generator=gen).to("cuda", dtype)
    out = torch.full((q.shape[0], heads[0], 128), math.nan, device="cuda", dtype=dtype)
    with forced_config("attention_varlen", config):
        _check_ragged_or_paged(layout if paged else None, q, q_lens, k_lens, heads[1], (192, 128), out, gen,
                               causal=causal)
