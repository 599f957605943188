"""Ragged batches on the warp-specialized Gluon kernel (the attention_varlen family's ``wgmma`` knob).

On the CPU: what the knob is offered for and refused for, the default rule, and the sm90 compile of the ragged
kernel with every wgmma asynchronous. On a GPU (``gpu``): ragged batches with empty and one-token sequences,
lengths off every block, keys longer than queries, GQA and padded head dims, against the float64 reference,
into a poisoned output; and wrong offsets that stay inside the tensors.
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

HOPPER = DeviceInfo("NVIDIA H200", (9, 0), 132, 141 << 30, 232448)
AMPERE = DeviceInfo("NVIDIA A100", (8, 0), 108, 80 << 30, 166912)
TRITON_36 = triton.__version__.startswith("3.6.")
WS = VarlenConfig(128, 128, 8, 2, wgmma=2)
WS_PINGPONG = VarlenConfig(128, 128, 8, 2, wgmma=3)
WS_SHORT = VarlenConfig(128, 64, 8, 3, wgmma=2)
LLAMA = VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16")


def test_the_knob_reads_and_labels_like_the_dense_ones():
    assert VarlenConfig.from_dict({"block_m": 64, "block_n": 64, "num_stages": 3, "num_warps": 4}).wgmma == 0
    assert VarlenConfig.from_dict(WS_PINGPONG.to_dict()) == WS_PINGPONG
    with pytest.raises(ConfigError, match="wgmma: expected one of 0, 2, 3, got 1"):
        VarlenConfig.from_dict({**WS.to_dict(), "wgmma": 1})
    assert [str(c) for c in (WS, WS_PINGPONG)] == ["BM128-BN128-w8-s2-ws", "BM128-BN128-w8-s2-ws-pp"]


@pytest.mark.skipif(not TRITON_36, reason="the wgmma knob is offered under Triton 3.6 only")
@pytest.mark.parametrize("spec,config,reason", [
    (VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", kv_layout="paged", page_size=16),
     WS, "not pages"),
    (VarlenAttentionSpec(head_dim=128, mask="window", dtype="bf16"), WS, "no window"),
    (VarlenAttentionSpec(head_dim=128, mask="causal", dtype="bf16", softcap=True), WS, "takes neither"),
    (VarlenAttentionSpec(head_dim=128, mask="causal", dtype="fp32"), WS, "bf16 or fp16"),
    (VarlenAttentionSpec(head_dim=192, head_dim_v=128, dtype="bf16"), WS, "equal ones from 64 to 128"),
    (LLAMA, VarlenConfig(64, 64, 4, 2, wgmma=2), "BM128 with 8 warps"),
    (LLAMA, VarlenConfig(128, 32, 8, 2, wgmma=2), "64 or 128"),
    (LLAMA, VarlenConfig(128, 128, 8, 4, wgmma=2), "shared memory"),
])
def test_refuses_what_the_ragged_kernel_does_not_run(spec, config, reason):
    assert reason in feasible(spec, config, HOPPER)
    offered = search_space(spec, HOPPER)["wgmma"]
    assert offered == [0, 2, 3] if spec == LLAMA else offered == [0]


@pytest.mark.skipif(not TRITON_36, reason="the wgmma knob is offered under Triton 3.6 only")
def test_default_rule_takes_the_warp_specialized_kernel_from_512_tokens_on_hopper():
    for spec in (LLAMA, VarlenAttentionSpec(head_dim=96, dtype="fp16"), VarlenAttentionSpec(head_dim=64, dtype="bf16")):
        rule = default_rule(spec, HOPPER)
        assert rule[0][0] == 256 and not rule[0][1].wgmma and rule[-1] == (None, WS), (spec, rule)
        for _, config in rule:
            assert feasible(spec, config, HOPPER) is None, (spec, config)
    assert (1024, WS_SHORT) in default_rule(LLAMA, HOPPER)
    assert not any(c.wgmma for _, c in default_rule(LLAMA, AMPERE))
    paged = VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", kv_layout="paged",
                                page_size=16)
    assert not any(c.wgmma for _, c in default_rule(paged, HOPPER))


def test_only_ragged_specs_carry_the_gluon_kernel():
    from tilegen.codegen import source_for

    source = source_for(LLAMA)
    assert "_wgmma_ws(" in source and "_ws_tile_ragged" in source and "def _gluon_ragged" in source
    # The one-partition kernel (wgmma=1) is the dense family's alone.
    assert "_kernel_wgmma(" not in source
    assert "gluon" not in source_for(VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16",
                                                         kv_layout="paged", page_size=16))


@pytest.mark.skipif(not TRITON_36, reason="the Gluon kernel is written against Triton 3.6's API")
@pytest.mark.parametrize("spec", [
    VarlenAttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16", return_lse=True),
    VarlenAttentionSpec(head_dim=96, mask="none", dtype="fp16"),
], ids=lambda s: s.name)
def test_the_ragged_kernel_compiles_for_sm90_with_asynchronous_wgmma(spec, tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TILEGEN_CACHE_DIR"] = str(tmp_path)
    dim = triton.next_power_of_2(spec.head_dim)
    pointers = {"Out": f"*{spec.dtype}", "Lse": "*fp32", "Sched": "*i32", "qk_scale": "fp32", "CuQ": "*i32",
                "CuK": "*i32", "q_desc": gluon_descriptor(64, dim, spec.dtype), "k_desc": gluon_descriptor(128, dim, spec.dtype),
                "v_desc": gluon_descriptor(128, dim, spec.dtype)}
    request = {"spec": json.loads(spec.to_json()), "pointers": pointers, "kernel": "kernel_wgmma_ws", "ptxas": True,
               "configs": [{"PINGPONG": pingpong, "CONSUMERS": 2, "TMA_STORE": False, "SCHEDULED": False,
                            "BLOCK_N": 128, "STAGES": 2, "num_warps": 4} for pingpong in (False, True)]}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py")), json.dumps(request)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.endswith("wgmma async") for line in lines), done.stdout


@pytest.mark.parametrize("aligned", [True, False])
def test_the_ragged_launch_views_the_packed_tensors_and_gives_a_program_to_each_tile(aligned, monkeypatch):
    """The descriptors view Q, K and V [total, heads, dim] as [1, heads, total, dim] with their own strides,
    padded to 128 columns at d96; the grid is every (sequence, head)'s tiles of the longest sequence; the lengths
    go per tile (n_q the longest, n_k and the diagonal 0); a Q whose head dim is not contiguous (no descriptor)
    takes the Triton kernel."""
    from tilegen.codegen.cache import module_for

    spec = VarlenAttentionSpec(head_dim=96, q_per_kv=4, mask="causal", dtype="bf16", return_lse=True)
    module = module_for(spec)
    if module.gluon is None:
        pytest.skip("this Triton has no Gluon")
    launches = []
    spy = type("Spy", (), {"__getitem__": lambda self, grid: (lambda *a, **k: launches.append((grid, a, k)))})()
    monkeypatch.setattr(module, f"_{spec.name}_kernel_wgmma_ws", spy)
    monkeypatch.setattr(module, f"_{spec.name}_kernel", spy)
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
    assert grid == (8 * 4 * 8, ) and kwargs["PINGPONG"] is False and kwargs["TMA_STORE"] is False
    q_desc, k_desc = args[0], args[1]
    assert q_desc.shape == [1, 8, total, 96] and q_desc.strides == [total * q.stride(0), 96, q.stride(0), 1]
    assert q_desc.block_shape == [1, 1, 64, 128] and k_desc.block_shape == [1, 1, 128, 128]
    assert k_desc.shape == [1, 2, total, 96] and k_desc.strides == [total * 192, 96, 192, 1]
    assert args[3] is out and args[4] is lse and args[5] is None
    # stride_ob, stride_oh, stride_om, stride_od, n_heads, n_bh, n_q, n_k, diag_offset
    assert args[6:15] == (0, 96, 768, 1, 8, 32, 1000, 0, 0)
    assert args[16] is cu and args[17] is cu and args[18:21] == (total, total, 8)


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
    # (query lengths, extra keys per sequence, causal, query heads / KV heads, head dim, dtype)
    pytest.param([0, 1, 17, 257, 1000, 130], 0, True, (8, 2), 128, torch.bfloat16, id="bf16-d128-gqa4-causal"),
    pytest.param([300, 0, 129, 1], 70, True, (4, 4), 128, torch.float16, id="fp16-d128-mha-causal-longer-keys"),
    pytest.param([64, 1000, 5, 333], 0, False, (8, 1), 64, torch.bfloat16, id="bf16-d64-mqa-full"),
    pytest.param([257, 3, 700], 9, True, (4, 2), 96, torch.bfloat16, id="bf16-d96-causal"),
    pytest.param([2000], 0, True, (2, 2), 80, torch.float16, id="fp16-d80-one-sequence"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [WS, WS_PINGPONG, WS_SHORT], ids=str)
@pytest.mark.parametrize("q_lens, extra, causal, heads, dim, dtype", CASES)
def test_ragged_gluon_matches_reference(q_lens, extra, causal, heads, dim, dtype, config):
    gen = torch.Generator().manual_seed(sum(q_lens) + dim)
    k_lens = [n + extra for n in q_lens]
    q = torch.randn(sum(q_lens), heads[0], dim, generator=gen).to("cuda", dtype)
    k, v = (torch.randn(sum(k_lens), heads[1], dim, generator=gen).to("cuda", dtype) for _ in range(2))
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    out = torch.full_like(q, math.nan)
    spec = VarlenAttentionSpec(head_dim=dim, q_per_kv=heads[0] // heads[1], mask="causal" if causal else "none",
                               dtype="bf16" if dtype == torch.bfloat16 else "fp16", return_lse=True)
    if has_no_gluon(spec):
        pytest.skip("the Gluon kernel needs an sm90 GPU and Triton 3.6")
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
