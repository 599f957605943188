"""The attention-forward config, its search space, what the kernel can run, and the heuristic default.

The search space reads the same kernel contract as the template's ``tl.static_assert``
lines, so Python never offers a config that breaks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import triton

from tilegen.device import DeviceInfo
from tilegen.families import base
from tilegen.families.attention_fwd.spec import AttentionSpec
from tilegen.families.lowering import gluon_widths
from tilegen.mods.lower import gathers_per_score

__all__ = ["Config", "TileConfig", "search_space", "tile_space", "feasible", "default_rule", "has_tma", "has_wgmma",
           "wgmma_unsupported", "WGMMA_KERNELS"]

# Rough per-thread register budget for the fp32 score tile and accumulator; past
# it the kernel spills and is never the winner, so it is not worth compiling.
_MAX_FP32_REGS_PER_THREAD = 160


@dataclass(frozen=True, order=True)
class TileConfig(base.Config):
    """Tiles, warps and stages: what every attention-forward kernel takes (the ragged and paged ones too)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"BM{self.block_m}-BN{self.block_n}-w{self.num_warps}-s{self.num_stages}"


@dataclass(frozen=True, order=True)
class Config(TileConfig):
    """Launch parameters of one dense attention-forward kernel."""

    # 1: Q, K and V are read through TMA tensor descriptors (Hopper and later) where the tensors
    # allow one (16-byte aligned base and strides, contiguous head dim); else through pointers.
    tma: int = 0
    # A Gluon kernel (Hopper wgmma, its pipeline written out) on TMA descriptors, where the call allows
    # descriptors and a positive scale; else the Triton kernel. 1: one partition (attention_fwd/attention_wgmma);
    # 2: warp-specialized, a loader warp and two consumer warpgroups (attention_fwd/attention_wgmma_ws), or three
    # at BM192 (d64);
    # 3: as 2, the consumers taking turns at the tensor cores (ping-pong).
    wgmma: int = 0

    switches = frozenset({"tma"})
    choices = MappingProxyType({"wgmma": (0, 1, 2, 3)})

    def __str__(self) -> str:
        return super().__str__() + ("-tma" if self.tma else "") + _WGMMA_SUFFIX[self.wgmma]


_WGMMA_SUFFIX = {0: "", 1: "-wgmma", 2: "-ws", 3: "-ws-pp"}
WGMMA_KERNELS = Config.choices["wgmma"]
# The default rule's warp-specialized configs: two K/V slots (three of 64 keys for d128 causal up to 1k);
# at d64 three consumers (BM192) from 8k causal and 2k full, with ping-pong for full attention (BENCHMARKS.md).
_WARP_SPECIALIZED = Config(128, 128, 8, 2, tma=1, wgmma=2)
_WS_SHORT_CAUSAL = Config(128, 64, 8, 3, tma=1, wgmma=2)
_WS_PINGPONG = Config(128, 128, 8, 2, tma=1, wgmma=3)
_WS_THREE = Config(192, 128, 12, 2, tma=1, wgmma=2)
_WS_THREE_PINGPONG = Config(192, 128, 12, 2, tma=1, wgmma=3)
_WS_WIDE = Config(128, 64, 8, 2, tma=1, wgmma=2)  # head dims 136 ... 256


def tile_space(device: DeviceInfo) -> dict[str, list[int]]:
    """The Triton kernel's tiles, warps and stages: what the ragged and paged kernels search too."""
    if device.is_interpreter:
        # The interpreter ignores warps and stages; keep the space small so a CPU tune is quick.
        return {"block_m": [16, 32, 64], "block_n": [16, 32, 64], "num_warps": [4], "num_stages": [1]}
    return base.with_smaller({"block_m": [64, 128, 256], "block_n": [32, 64, 128], "num_warps": [4, 8],
                              "num_stages": [2, 3, 4]}, device, block_m=(32,), num_stages=(1,))


def search_space(spec: AttentionSpec, device: DeviceInfo) -> dict[str, list[int]]:
    space = tile_space(device)
    if device.is_interpreter:
        # The TMA path runs under the interpreter too, but a CPU tune need not try it: tests do.
        return {**space, "tma": [0], "wgmma": [0]}
    offered = _offers_wgmma(spec, device)
    space["tma"] = [0, 1] if has_tma(device) else [0]
    space["wgmma"] = list(WGMMA_KERNELS) if offered else [0]
    if offered and spec.head_dim == 64:
        # The warp-specialized kernel's three consumer warpgroups: BM192 with 12 warps.
        space["block_m"].insert(2, 192)
        space["num_warps"].append(12)
    return space


def has_tma(device: DeviceInfo) -> bool:
    """Whether the device has the Tensor Memory Accelerator (sm90 and later); the interpreter
    runs the descriptor path too, so CPU tests cover it."""
    return device.is_interpreter or device.capability >= (9, 0)


def has_wgmma(device: DeviceInfo) -> bool:
    """Whether the Gluon kernel can run: an sm90 GPU (wgmma is Hopper's alone) and Triton 3.6, the
    version whose Gluon API the template is written against and verified with on the H200."""
    return not device.is_interpreter and device.capability[0] == 9 and triton.__version__.startswith("3.6.")


def wgmma_unsupported(spec: AttentionSpec) -> str | None:
    """Why the Gluon kernel does not implement ``spec``, or ``None`` when it does."""
    if spec.mask_mod is not None and (spec.mask != "none" or spec.score_mod is not None or spec.softcap):
        # The warp-specialized kernel walks a mask mod's block table (tilegen.mods.blocks) as the only mask.
        return "mask_mod: the Gluon kernel takes a mask mod alone (no built-in mask, score mod or softcap beside it)"
    for field in ("score_mod", "mask_mod"):
        if gathers_per_score(getattr(spec, field)):
            # Such a gather stages a score tile through shared memory, which the Gluon kernels' rings of K and V fill.
            return f"{field}: a gather by both positions (staged through shared memory) is the Triton kernel's"
    # Head dims 72 ... 120 are read into 128 columns and 136 ... 248 into 256 (above a V of 128 or fewer, up to
    # 192 into 192: lowering.gluon_widths), which TMA fills with zeros past the tensor's (a spec's head dim is a
    # multiple of 8, so a row is a multiple of TMA's 16 bytes).
    # A narrower V (DeepSeek's 192/128) up to 128 columns: a wider one stages the output in Q's buffer, which
    # then must be as wide.
    if not 64 <= spec.dv <= spec.head_dim <= 256 or (spec.dv != spec.head_dim and spec.dv > 128):
        return (f"head dims {spec.head_dim}/{spec.dv}: the Gluon kernel takes equal ones from 64 to 256, or a V of "
                f"64 to 128 below a wider QK")
    if spec.dtype not in ("bf16", "fp16"):
        return f"dtype={spec.dtype}: the Gluon kernel takes bf16 or fp16"
    return None


def _offers_wgmma(spec: AttentionSpec, device: DeviceInfo) -> bool:
    """Whether the knob is on offer: the device runs the Gluon kernel and the kernel implements the spec."""
    return has_wgmma(device) and wgmma_unsupported(spec) is None


def _defaults_to_wgmma(spec: AttentionSpec, device: DeviceInfo) -> bool:
    """Whether the default rule takes the Gluon kernels. Not for a softcap: on the H200 (bf16, 4 x 4096, 32/8
    heads, d128) its Gluon kernels ran slower than the Triton one (one partition 307 TFLOP/s, warp-specialized
    236-237, against 310). A score mod at d128 only, where it was measured (ALiBi there: 542 against 446); at d64
    its Gluon paths are a tune's to choose (every candidate checked against the reference)."""
    if spec.softcap or spec.mask_mod is not None or not _offers_wgmma(spec, device):
        # A mask mod: its Gluon kernel walks the block table in 128-row tiles, which led the tuned Triton rows on
        # an H100 for a prefix-LM mask (1192 against 1332 µs) and trailed them for a document mask (867 against 808)
        # and a sliding window with global tokens (900 against 765; bf16, 4 x 4096, GQA 32/8, d128): a tune's choice.
        return False
    return spec.score_mod is None or max(spec.head_dim, spec.dv) == 128


def _wgmma_infeasible(spec: AttentionSpec, config: Config, device: DeviceInfo) -> str | None:
    if config.wgmma not in WGMMA_KERNELS:
        return f"wgmma={config.wgmma}: expected one of {', '.join(map(str, WGMMA_KERNELS))}"
    if not config.wgmma:
        return None
    knob = f"wgmma={config.wgmma}"
    if not has_wgmma(device):
        return (f"{knob}: needs an sm90 GPU and Triton 3.6, not {device.name} (sm{device.capability[0]}"
                f"{device.capability[1]}) with Triton {triton.__version__}")
    reason = wgmma_unsupported(spec)
    if reason is not None:
        return f"{knob}: {reason}"
    if not config.tma:
        return f"{knob} reads through TMA: it goes with tma=1"
    if config.wgmma == 1 and (config.block_m not in (64, 128) or config.num_warps != config.block_m // 16):
        return f"{knob}: one warpgroup per 64 query rows, so BM64 with 4 warps or BM128 with 8, not {config}"
    if config.wgmma > 1 and (config.block_m, config.num_warps) not in ((128, 8), (192, 12)):
        return (f"{knob}: two or three consumer warpgroups of 64 query rows (and a loader warp), so BM128 with 8 "
                f"warps or BM192 with 12, not {config}")
    if config.block_m == 192 and spec.head_dim != 64:
        # Three consumers get 160 registers each: a 64 x 128 fp32 score tile and a 64 x d accumulator fit at d64.
        return f"{knob}: three consumer warpgroups (BM192) fit in registers at head dim 64 only, not {spec.head_dim}"
    if config.block_n not in (64, 128):
        return f"block_n={config.block_n}: the Gluon kernels take 64 or 128"
    if spec.dv != spec.head_dim and config.wgmma == 1:
        return f"{knob}: a narrower V is the warp-specialized kernel's (wgmma 2 or 3)"
    if spec.mask == "window" and config.wgmma == 1:
        return f"{knob}: a window is the warp-specialized kernel's (wgmma 2 or 3)"
    if spec.mask_mod is not None and (config.wgmma == 1 or config.block_m != 128):
        return f"{knob}: a mask mod is the warp-specialized kernel's with two consumers (BM128), not {config}"
    if spec.head_dim > 128:
        # Two consumers' 64 x 256 fp32 accumulators take 128 of their 240 registers (64 x 192: 96); Q's buffers
        # (the output staged in them past 128 columns of V, else in buffers of its own) and the slots of 64 keys
        # share the shared memory: two slots at 256 columns, three at 192.
        width, stages = gluon_widths(spec.head_dim, spec.dv)[0], _ws_wide_stages(spec, device)
        if config.wgmma == 1 or config.block_m != 128 or config.block_n != 64 or not 2 <= config.num_stages <= stages:
            slots = "two slots" if stages == 2 else f"2 to {stages} slots"
            return (f"{knob}: head dim {spec.head_dim} (read as {width}) takes two consumers, BM128-BN64 and "
                    f"{slots}, not {config}")
    if config.num_stages < 2:
        return f"{knob}: K and V need at least two slots each"
    return None


def _ws_wide_stages(spec: AttentionSpec, device: DeviceInfo) -> int:
    """The most K/V slots of 64 keys (two at least) the warp-specialized kernel's BM128 tile fits past 128 columns
    in the device's shared memory, less a KiB for the barriers."""
    width, width_v = gluon_widths(spec.head_dim, spec.dv)
    stages = 2
    while _smem_bytes(Config(128, 64, 8, stages + 1, tma=1, wgmma=2), width, width_v, 2) + 1024 <= device.smem_bytes:
        stages += 1
    return stages


def _smem_bytes(config: Config, width: int, width_v: int, elt: int, output_buffer: bool = True) -> int:
    """Shared memory of ``config``'s Q tile and K/V ring at these columns, and with ``output_buffer`` the
    warp-specialized kernel's output buffer, which it stages a V of 128 columns or fewer in before its TMA store
    (past 128 columns the output is staged in Q's buffer)."""
    smem = (config.block_m * width + config.num_stages * config.block_n * (width + width_v)) * elt
    if config.wgmma > 1 and output_buffer and width_v <= 128:
        smem += config.block_m * width_v * elt
    return smem


def feasible(spec: AttentionSpec, config: Config, device: DeviceInfo, *, output_buffer: bool = True) -> str | None:
    """Why ``config`` cannot run ``spec`` on ``device``, or ``None``. ``output_buffer``: the warp-specialized kernel
    stages a V of 128 columns or fewer in shared memory of its own before its TMA store (the dense launcher does
    wherever the output allows a descriptor; the ragged one only where the buffer fits, so it passes False)."""
    reason = _wgmma_infeasible(spec, config, device)
    if reason is not None:
        return reason
    if config.tma not in (0, 1):
        return f"tma={config.tma}: expected 0 or 1"
    if config.tma and not has_tma(device):
        return f"tma=1: {device.name} (sm{device.capability[0]}{device.capability[1]}) has no TMA; it needs sm90"
    for name in ("block_m", "block_n"):
        value = getattr(config, name)
        if name == "block_m" and value == 192 and config.wgmma > 1:
            continue  # three consumer warpgroups of 64 rows; checked above
        if value % 16 or value & (value - 1):
            return f"{name}={value}: the template asserts a power of two and a multiple of 16"
    # The Gluon kernels read a QK of 192 in 192 columns (gluon_widths), the Triton kernel in a power of two.
    if config.wgmma:
        dim_pad, dim_v_pad = gluon_widths(spec.head_dim, spec.dv)
    else:
        dim_pad, dim_v_pad = triton.next_power_of_2(spec.head_dim), triton.next_power_of_2(spec.dv)
    if config.block_m * dim_v_pad > 128 * 256:
        return f"block_m={config.block_m}: accumulator of {config.block_m}x{dim_v_pad} exceeds the template's bound"
    if device.is_interpreter:
        return None
    threads = 32 * config.num_warps
    regs = (config.block_m * dim_v_pad + config.block_m * config.block_n) / threads
    if regs > _MAX_FP32_REGS_PER_THREAD:
        return f"~{regs:.0f} fp32 registers per thread for scores and accumulator: spills"
    smem = _smem_bytes(config, dim_pad, dim_v_pad, 4 if spec.dtype == "fp32" else 2, output_buffer)
    if smem > device.smem_bytes:
        return f"~{smem} bytes of shared memory against the device's {device.smem_bytes}"
    return None


def default_rule(spec: AttentionSpec, device: DeviceInfo) -> list[tuple[int | None, Config]]:
    """The GPU rules come from exhaustive grids of bf16 attention on an H200 (BENCHMARKS.md): up to
    1k, few query tiles per head, so smaller tiles keep more SMs busy; from 2k on the largest tiles
    that do not spill win. The tiles were fitted on pointer-load grids from 512 to 32k (within 4%
    of each grid's best); the TMA switch and the 1k tiles on later measurements, below.
    """
    if device.is_interpreter:
        return [(None, Config(32, 32, 4, 1))]
    if spec.dtype == "fp32":
        return [(None, Config(64, 32, 4, 2))]
    dim = max(spec.head_dim, spec.dv)
    if dim <= 128 and any(gathers_per_score(getattr(spec, f, None)) for f in ("score_mod", "mask_mod")):
        # A gather indexed by both positions is staged through shared memory a whole score tile at a time:
        # under Triton 3.6, T5's relative bias at d128 needs 288 KiB at BM128-BN128-s3 (the H200 has 227),
        # 128 KiB at BM128-BN64-s2. Small tiles win there (bf16, 4 x 4096, 32/8 heads, d128, on the H200):
        # BM64-BN32-w4-s3 16.2 ms, BM128-BN64-w8-s2 18.8, BM128-BN32-w4-s2 19.9, BM64-BN64-w4-s2 21.1. Once blocks
        # past T5's max_distance read one bias (the mods' clamped gathers), K and V by TMA: on an H100 BM64-BN32-s3
        # took 3.60 ms with TMA, and 4.79 without in runs taking turns with Flex (BM128-BN128-w8-s2 with TMA 3.77,
        # BM128-BN64-w8-s2 4.00).
        return [(256, Config(64, 32, 4, 2)), (None, Config(64, 32, 4, 3, int(has_tma(device))))]
    # TMA from 512 keys on: on the H200 it matched or beat pointer loads at every shape tried (d128
    # causal 1k 348 against 298 TFLOP/s, 16k 499 against 478). Up to 256 keys it was never measured;
    # small calls keep pointers in the launcher anyway (TMA_MIN_WORK), as descriptors cost host time.
    tma = int(has_tma(device))
    if dim <= 64:
        rule = [(256, Config(64, 64, 4, 3)), (1024, Config(64, 64, 4, 3, tma)), (None, Config(128, 64, 8, 3, tma))]
        if _defaults_to_wgmma(spec, device):
            # On the H200 (bf16, 32 heads, 16k tokens, TFLOP/s): three consumers led two from 8k causal
            # (16k: 436-440 against 427) and from 2k full (8k: 484 against 447, both with ping-pong). Two led
            # the Triton rows causal at 2k-4k, with ping-pong (4k: 399 against 394 without; 2k, with block 0
            # in the loops: 366 against 361), and full at 512-1k without it (1k: 414 against 386 with it, 512:
            # 370 against 334 for the Triton row). Causal 1k too, since two consumers run one loop (316 against
            # 291 for the Triton row). At 512 causal, once the two consumers ran one loop, ping-pong led (GQA 32/8,
            # 32 x 512: 260 against 253 without it, 226 for the tuned Triton row, cuDNN 263).
            if spec.mask == "causal":
                rule[1:] = [(512, _WS_PINGPONG), (1024, _WARP_SPECIALIZED), (4096, _WS_PINGPONG), (None, _WS_THREE)]
            elif spec.mask == "window":
                # A window's work a tile is its width, not the length: on an H100 (bf16, GQA 32/8, 16k tokens) two
                # consumers with 128-key blocks read 350-423 TFLOP/s at windows of 1024 and 4096 keys, against
                # 268-445 for the full rule's three consumers with ping-pong (BENCHMARKS.md).
                rule[1:] = [(None, _WARP_SPECIALIZED)]
            else:
                rule[1:] = [(1024, _WARP_SPECIALIZED), (None, _WS_THREE_PINGPONG)]
        return rule
    if dim <= 128:
        # Up to 1k keys BM64-BN64 with TMA: the best of all 60 configs at d128 1k, causal (359 TFLOP/s) and
        # full (466, against 413 for BN32).
        rule = [(256, Config(64, 32, 4, 3)), (1024, Config(64, 64, 4, 3, tma)), (None, Config(128, 128, 8, 3, tma))]
        if _defaults_to_wgmma(spec, device):
            # The warp-specialized Gluon kernel led at d128 on the H200 (bf16, 32 heads, 16k tokens): with two
            # K/V slots, against the one-partition kernel at BM128-BN128-s3, 1.07-1.17x from 1k to 16k, causal
            # and full, MHA and GQA 32/8 (causal 16k 603 against 528 TFLOP/s), and against the Triton rows
            # from 512 keys on (full 512: 513 against 377); causal up to 1k with three slots of 64 keys, where
            # a causal tile has few blocks and half of its diagonal one is masked (1k: 422 against 375 for
            # BN128, 359 for the Triton row).
            # A window keeps 128-key blocks: on an H100 (bf16, GQA 32/8, 16k tokens) they led 64-key ones by 6-11% at
            # windows of 1024 and 4096 keys, and lost by 25% at 128 (BENCHMARKS.md).
            causal = [(1024, _WS_SHORT_CAUSAL)] if spec.mask == "causal" else []
            # A score mod adds CUDA-core work to every block: the consumers taking turns hide it under the other's
            # products (ALiBi, bf16, 4 x 4096, 32/8 heads, full: ping-pong 542 TFLOP/s, without 509, one partition
            # 447, the Triton row 446).
            rule[1:] = causal + [(None, _WS_PINGPONG if spec.score_mod is not None else _WARP_SPECIALIZED)]
        return rule
    if _defaults_to_wgmma(spec, device):
        # Head dims 136 ... 256 fit the warp-specialized kernel with 64-key blocks and two slots (three at a QK of 192
        # above a narrower V). On the H200
        # (bf16, GQA 32/8, 16k tokens, TFLOP/s) it read 0.93-1.13 of cuDNN at d256 from 512 to 16k keys, causal and
        # full (the Triton row BM64-BN32 0.59-0.63: causal 4k 644 against 360, cuDNN 605), and 0.80-0.89 at d192
        # (read into 256 columns); ping-pong was level or slower (causal 1k 492 against 557). DeepSeek's 192/128
        # (MHA): 0.91-1.02 of cuDNN, against about 0.5 for the Triton row; with QK read into 192 columns in three
        # parts, on an H100 1.01-1.12 of cuDNN but at full 16k (0.94), two slots level with or ahead of three
        # (BENCHMARKS.md).
        return [(None, _WS_WIDE)]
    if spec.softcap and has_tma(device):
        # A softcap keeps the Triton kernel (its Gluon paths were slower at d128), but in wider tiles: on the H200
        # (bf16, d256, causal, 16k tokens, TFLOP/s) BM128-BN64 with TMA read 286-393 against 240-302 for BM64-BN32
        # at 1k and 4k keys, GQA 16/8 and 32/8 (16/8 4k: 379 against 292; Flex 164), and led the warp-specialized
        # kernel but at 32/8 4k (393 against 399).
        return [(None, Config(128, 64, 8, 2, tma=1))]
    return [(None, Config(64, 32, 4, 2))]
