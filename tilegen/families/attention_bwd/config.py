"""The attention-backward config, its search space, what the kernels can run, and the heuristic default.

Two kernels with their own tiles: ``_dkdv`` (BLOCK_N1 keys on chip, BLOCK_M1 query rows streamed)
and ``_dq`` (BLOCK_M2 query rows on chip, BLOCK_N2 keys streamed), or, with ``atomic_dq``, no
``_dq`` at all: the dK/dV kernel adds each block's dQ into an fp32 buffer with atomics.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from types import MappingProxyType

import triton

from tilegen.device import DeviceInfo
from tilegen.families import base
from tilegen.families.attention_bwd.spec import AttentionBwdSpec
from tilegen.families.attention_fwd.config import has_tma, has_wgmma
from tilegen.mods.lower import gathers_per_score

__all__ = ["Config", "search_space", "feasible", "default_rule", "deterministic", "wgmma_unsupported"]

# Per-thread fp32 registers past which a kernel spills for sure (accumulators plus two score-sized tiles).
_MAX_FP32_REGS_PER_THREAD = 192


@dataclass(frozen=True, order=True)
class Config(base.Config):
    """Launch parameters of the attention backward's kernels."""

    block_m1: int
    block_n1: int
    num_warps1: int
    num_stages1: int
    block_m2: int
    block_n2: int
    num_warps2: int
    num_stages2: int
    # 1: dQ accumulated by atomics in the dK/dV kernel (one pass over the scores, not two; the order of
    # the adds varies, so dQ is not bit-reproducible); 0: a separate dQ kernel.
    atomic_dq: int = 0
    # 1: Q and dO (dK/dV kernel), K and V (dQ kernel) stream through TMA tensor descriptors (Hopper and later)
    # where the tensors allow one; else through pointers. A ragged batch's are viewed as [1, heads, total, dim].
    tma: int = 0
    # Gluon kernels (Hopper wgmma, their pipelines written out, attention_bwd/attention_bwd_wgmma) on TMA
    # descriptors, where the call allows them: 1 the dK/dV kernel, 2 the dQ kernel too, 3 the dK/dV kernel
    # warp-specialized (a loader warp, two consumer warpgroups); 0 the Triton kernels.
    wgmma: int = 0

    switches = frozenset({"atomic_dq", "tma"})
    choices = MappingProxyType({"wgmma": (0, 1, 2, 3)})

    def __str__(self) -> str:
        dkdv = f"M{self.block_m1}-N{self.block_n1}-w{self.num_warps1}-s{self.num_stages1}"
        suffix = ("-tma" if self.tma else "") + ("", "-wgmma-dkdv", "-wgmma", "-wgmma-ws")[self.wgmma]
        if self.atomic_dq:
            return dkdv + "-atomic" + suffix
        return dkdv + f"/M{self.block_m2}-N{self.block_n2}-w{self.num_warps2}-s{self.num_stages2}" + suffix


# Remembered: a call with mods maps its row's config at every backward, and the search takes ~0.5 ms.
@functools.cache
def deterministic(config: Config, spec: AttentionBwdSpec, device: DeviceInfo) -> Config:
    """``config`` with a separate dQ kernel (no atomics): the same bits on every run. Its dQ tiles are the
    transpose of the dK/dV kernel's, else, where ``feasible`` refuses them for ``spec`` (4 warps over a d256
    M64-N64 tile spill), the nearest dQ knobs of the search space that it takes."""
    if not config.atomic_dq:
        return config
    dq = _DQ_FOR_ATOMIC.get((config.block_m1, config.block_n1), (64, 32, 4, 2))
    mapped = Config(config.block_m1, config.block_n1, config.num_warps1, config.num_stages1, *dq, atomic_dq=0,
                    tma=config.tma, wgmma=config.wgmma)
    if feasible(spec, mapped, device) is None:
        return mapped
    space = search_space(spec, device)
    options = (dataclasses.replace(mapped, block_m2=m, block_n2=n, num_warps2=w, num_stages2=st)
               for m, n, w, st in itertools.product(space["block_m2"], space["block_n2"], space["num_warps2"],
                                                     space["num_stages2"]))
    return base.nearest(mapped, (c for c in options if feasible(spec, c, device) is None))


# The dQ kernel's tiles a deterministic call takes in place of atomics: its query tile as the dK/dV
# kernel's key tile, the keys it streams as that kernel's query blocks.
_DQ_FOR_ATOMIC = {(m, n): (n, m, 4 if n * m <= 64 * 64 else 8, 2) for m in (16, 32, 64, 128) for n in (16, 32, 64, 128)}


def search_space(spec: AttentionBwdSpec, device: DeviceInfo) -> dict[str, list[int]]:
    if device.is_interpreter:
        # The interpreter ignores warps and stages; small tiles keep a CPU tune quick.
        tiles = {"block_m1": [16, 32], "block_n1": [16, 32], "num_warps1": [4], "num_stages1": [1],
                 "block_m2": [16, 32], "block_n2": [16, 32], "num_warps2": [4], "num_stages2": [1]}
        # The TMA path runs under the interpreter too, but a CPU tune need not try it: tests do.
        return {**tiles, "atomic_dq": [0, 1], "tma": [0], "wgmma": [0]}
    # Narrowed by a sweep on the H200 (bf16, 16k tokens, d64/d128, causal and full, BENCHMARKS.md): a key tile of
    # 128 rows for dK/dV or query blocks of 128 rows for it lost by 1.3-3x, as did one stage.
    space = {"block_m1": [32, 64], "block_n1": [64, 128], "num_warps1": [4, 8], "num_stages1": [2, 3, 4],
             "block_m2": [64, 128], "block_n2": [32, 64, 128], "num_warps2": [4, 8], "num_stages2": [2, 3, 4],
             "atomic_dq": [0, 1], "tma": [0, 1] if has_tma(device) else [0],
             "wgmma": _wgmma_choices(spec) if has_wgmma(device) and wgmma_unsupported(spec) is None else [0]}
    return base.with_smaller(space, device, block_m1=(16,), block_n1=(16, 32), block_m2=(16, 32),
                             block_n2=(16,), num_stages1=(1,), num_stages2=(1,))


def _gluon_untimed(spec: AttentionBwdSpec) -> bool:
    """A window's Gluon dK/dV kernels were timed on dense batches (BENCHMARKS.md, "Score and mask mods"); on ragged
    batches they pass their GPU tests but have not been timed against the Triton kernels: a forced config runs them
    there, neither the search nor the default rule takes them."""
    return spec.mask == "window" and spec.layout != "dense"


def _wgmma_choices(spec: AttentionBwdSpec) -> list[int]:
    if _gluon_untimed(spec):
        return [0]
    # A ragged batch has the warp-specialized dK/dV kernel only (its descriptors find each sequence's rows).
    return [0, 3] if spec.layout == "ragged" else list(Config.choices["wgmma"])


def wgmma_unsupported(spec: AttentionBwdSpec) -> str | None:
    """Why the Gluon kernels do not implement ``spec``, or ``None`` when they do (for a ragged batch: the
    warp-specialized dK/dV kernel, ``wgmma=3``)."""
    if spec.layout not in ("dense", "ragged"):
        return f"layout={spec.layout!r}: the Gluon kernels read TMA descriptors of dense or ragged batches"
    if spec.mask_mod is not None and (spec.layout != "dense" or spec.mask != "none" or spec.score_mod is not None):
        # Its block table replaces the built-in masks' closed-form ranges in the warp-specialized dK/dV kernel.
        return "mask_mod: the Gluon kernels take a mask mod on dense batches, as the only mask and without a score mod"
    if spec.score_mod is not None and spec.layout != "dense":
        return "score_mod: the Gluon kernels take a score mod on dense batches only"
    for kind in ("score_mod", "mask_mod"):
        if gathers_per_score(getattr(spec, kind)):
            # Such a gather stages a score tile through shared memory, which the Gluon kernels' rings of Q and dO fill.
            return f"{kind}: a gather by both positions (staged through shared memory) is the Triton kernels'"
    if spec.softcap:
        return "softcap: the Gluon kernels have none"
    if not 64 <= spec.head_dim <= 128 or spec.dv != spec.head_dim:
        # One between 64 and 128 is read into 128 columns, which TMA fills with zeros past the tensor's.
        return f"head dims {spec.head_dim}/{spec.dv}: the Gluon kernels take equal ones from 64 to 128"
    if spec.dtype not in ("bf16", "fp16"):
        return f"dtype={spec.dtype}: the Gluon kernels take bf16 or fp16"
    return None


def _wgmma_infeasible(spec: AttentionBwdSpec, config: Config, device: DeviceInfo) -> str | None:
    knob = f"wgmma={config.wgmma}"
    if not has_wgmma(device):
        return f"{knob}: the Gluon kernels need an sm90 GPU and Triton 3.6"
    reason = wgmma_unsupported(spec)
    if reason is not None:
        return f"{knob}: {reason}"
    if not config.tma or config.atomic_dq and (config.wgmma != 3 or spec.layout != "dense"):
        # dQ by register atomics in the one-partition Gluon dK/dV kernel ran at 0.67-0.89x the Triton kernels on
        # the H200 (BENCHMARKS.md): the atomics stall the partition. The warp-specialized kernel adds dQ by TMA
        # reductions from shared memory instead, in dense batches: in a ragged one (the reductions addressed by
        # each sequence's first row) it read 320 TFLOP/s without a mask, where the dQ kernel reads 365.
        return f"{knob}: the Gluon kernels read TMA descriptors (tma=1) and write dQ by a kernel (atomic_dq=0), " \
               "but the warp-specialized dK/dV kernel of a dense batch (wgmma=3), which may add it (atomic_dq=1)"
    if spec.layout == "ragged" and config.wgmma != 3:
        return f"{knob}: a ragged batch runs the warp-specialized Gluon dK/dV kernel only (wgmma=3)"
    if spec.mask == "window" and config.wgmma == 2:
        return f"{knob}: a window has no Gluon dQ kernel (wgmma 1 or 3 run its Gluon dK/dV kernels)"
    if spec.mask_mod is not None and config.wgmma != 3:
        return f"{knob}: a mask mod runs the warp-specialized Gluon dK/dV kernel only (wgmma=3)"
    if spec.mask_mod is not None and config.atomic_dq:
        # On an H100 it stopped on an illegal memory access (2 stages; 3 asked for 239216 bytes of shared memory,
        # 232448 there): not run until that is found.
        return f"{knob}: a mask mod's warp-specialized kernel writes dQ by the Triton kernel (atomic_dq=0), not by " \
               "reductions"
    if config.wgmma == 3 and (config.block_n1, config.num_warps1) != (128, 8):
        return f"{knob}: the warp-specialized Gluon dK/dV kernel holds 128 keys in two warpgroups (block_n1=128, " \
               f"num_warps1=8), not block_n1={config.block_n1}, num_warps1={config.num_warps1}"
    # One warpgroup per 64 rows of each kernel's held tile; the streamed tile is the instruction's N.
    kernels = [("dK/dV", "block_n1", "num_warps1", config.block_n1, config.num_warps1, config.block_m1)]
    if config.wgmma == 2:
        kernels.append(("dQ", "block_m2", "num_warps2", config.block_m2, config.num_warps2, config.block_n2))
    for kernel, held_name, warps_name, held, warps, streamed in kernels:
        if held not in (64, 128) or warps != held // 16:
            return f"{knob}: the Gluon {kernel} kernel holds 64 or 128 rows with a warp per 16 ({held_name}={held}, " \
                   f"{warps_name}={warps})"
        if streamed not in (32, 64, 128):
            return f"{knob}: the Gluon {kernel} kernel streams blocks of 32, 64 or 128 rows, not {streamed}"
    return None


def feasible(spec: AttentionBwdSpec, config: Config, device: DeviceInfo) -> str | None:
    for name in ("block_m1", "block_n1", "block_m2", "block_n2"):
        value = getattr(config, name)
        if value % 16 or value & (value - 1):
            return f"{name}={value}: the template asserts a power of two and a multiple of 16"
    if config.atomic_dq not in (0, 1):
        return f"atomic_dq={config.atomic_dq}: expected 0 or 1"
    if config.tma not in (0, 1):
        return f"tma={config.tma}: expected 0 or 1"
    if config.tma and not has_tma(device):
        return f"tma=1: {device.name} (sm{device.capability[0]}{device.capability[1]}) has no TMA; it needs sm90"
    if config.wgmma not in Config.choices["wgmma"]:
        return f"wgmma={config.wgmma}: expected one of {', '.join(map(str, Config.choices['wgmma']))}"
    if config.wgmma:
        reason = _wgmma_infeasible(spec, config, device)
        if reason is not None:
            return reason
    if config.atomic_dq and (config.block_m2, config.block_n2, config.num_warps2, config.num_stages2) != (
            config.block_m1, config.block_n1, config.num_warps1, config.num_stages1):
        # One row per kernel: the dQ kernel does not run, so its knobs repeat the dK/dV kernel's.
        return "atomic_dq=1 runs no dQ kernel: its knobs (block_m2 ...) repeat the dK/dV kernel's"
    if device.is_interpreter:
        return None
    dims = triton.next_power_of_2(spec.head_dim) + triton.next_power_of_2(spec.dv)
    elt = 4 if spec.dtype == "fp32" else 2
    # dK/dV holds BLOCK_N1 keys and streams BLOCK_M1 query rows; dQ the transpose.
    # A mod's gather indexed by both positions (T5's relative bias) is staged through shared memory a score tile
    # at a time, in the recomputed scores and again in their derivative: under Triton 3.6 at d128, dK/dV over
    # M64-N128-s3 asked for 290 KiB, about this formula's 128 plus five fp32 score tiles.
    tiles = 5 * 4 if _gathers(spec) else 0
    kernels = [("dK/dV", config.block_n1, config.block_m1, config.num_warps1, config.num_stages1)]
    if not config.atomic_dq:
        kernels.append(("dQ", config.block_m2, config.block_n2, config.num_warps2, config.num_stages2))
    for i, (kernel, held, streamed, warps, stages) in enumerate(kernels):
        regs = (held * dims + 2 * held * streamed) / (32 * warps)
        if regs > _MAX_FP32_REGS_PER_THREAD:
            return f"~{regs:.0f} fp32 registers per thread in the {kernel} kernel: spills"
        # The Gluon kernels' rings hold all their stages; Triton's pipeliner keeps one fewer in shared memory.
        ring = stages if (config.wgmma > 0, config.wgmma == 2)[i] else max(stages - 1, 1)
        smem = (held * dims + ring * streamed * dims) * elt + tiles * held * streamed
        if smem > device.smem_bytes:
            return f"~{smem} bytes of shared memory in the {kernel} kernel against the device's {device.smem_bytes}"
    return None


def default_rule(spec: AttentionBwdSpec, device: DeviceInfo) -> list[tuple[int | None, Config]]:
    """From a sweep on the H200 (bf16, 32 query heads, 4k, BENCHMARKS.md), TFLOP/s of the backward alone: at d128
    dK/dV over M64-N128 with 8 warps and 3 stages, dQ over M128-N64 (causal 346, GQA full 391); at d64 M64-N64
    with 4 warps for dK/dV, and dQ M64-N64 causal (307) or M128-N64 with 8 warps full (352). Larger head dims and
    fp32 take small tiles that fit in registers."""
    if device.is_interpreter:
        return [(None, Config(16, 32, 4, 1, 32, 16, 4, 1))]
    dim = max(spec.head_dim, spec.dv)
    if dim > 128:
        # Past d128 the Triton kernels (bf16, 4 x 4096, 32/8 heads, an H100, backward alone): M64-N64 with 8 warps,
        # 2 stages and TMA 203 TFLOP/s causal at d256 and 158 at d192, against 154 and 111 for M32-N32 with 4
        # warps and 96 and 72 for M32-N64 with 4 warps (its dK/dV held more than the registers: spills). Three
        # stages or 128-row blocks ran out of shared memory (264 KiB asked), and two stages ask for about 200 KiB:
        # fp32, and GPUs with less shared memory than Hopper's, take the smaller tiles.
        if spec.dtype == "fp32" or device.smem_bytes < 224 * 1024:
            return [(None, Config(32, 32, 4, 2, 32, 32, 4, 2))]
        return [(None, Config(64, 64, 8, 2, 64, 64, 8, 2, tma=int(has_tma(device))))]
    if spec.dtype == "fp32":
        return [(None, Config(32, 64, 4, 2, 64, 32, 4, 2))]
    # TMA for the streamed blocks lifted every cell of the grid on the H200, by 5-8% (d128 causal 16k
    # 383 -> 415, d64 causal 1k 225 -> 238 TFLOP/s).
    tma = int(has_tma(device))
    gluon = has_wgmma(device) and wgmma_unsupported(spec) is None and not _gluon_untimed(spec)
    if _gathers(spec):
        # T5's relative bias (bf16, 4 x 4096, 32/8 heads, d128, the H200): M32-N64 dK/dV and M64-N32 dQ with 4 warps
        # and 2 stages 31.5 ms; M64-N32/M32-N64 44.9; M64-N64 54.5; the mod-free default ran out of shared memory.
        return [(None, Config(32, 64, 4, 2, 64, 32, 4, 2, tma=tma))]
    if dim <= 64:
        # The Triton kernels, but on Hopper for dense batches without a score mod: with GQA at every length,
        # multi-head past 2k (below).
        triton_kernels = (Config(64, 64, 4, 3, 128, 64, 8, 3, tma=tma) if spec.mask == "none"
                          else Config(64, 64, 4, 3, 64, 64, 4, 3, tma=tma))
        if spec.layout == "dense" and spec.score_mod is None and gluon:
            # d64 (bf16, 32/8 heads, 4k and 16k, an H100, backward alone): the warp-specialized Gluon dK/dV kernel
            # over 128 query rows a block, 2 stages, ran 325 / 384 TFLOP/s causal and 415 / 428 full, against 305 / 344
            # and 374 / 378 for the Triton kernels (64-row blocks and 3 stages: 296 / 344, 383 / 398; cuDNN 355 /
            # 431, 419 / 451). At 1k the Triton kernels led the Gluon one with dQ by reductions by 14-31% on the H200,
            # and the 128-row one was not measured there. Measured at 1k and 2k (an H100, backward alone, 16k tokens):
            # with GQA 32/8 it led the Triton kernels there too (causal 238 / 292 against 233 / 276, full 367 / 395
            # against 332 / 356), with 32/32 it trailed them at 1k (causal 210 against 235, full 322 against 330) and
            # drew at 2k: so multi-head calls keep the Triton kernels up to 2k (BENCHMARKS.md).
            ws = Config(128, 128, 8, 2, 128, 64, 8, 3, tma=1, wgmma=3)
            if spec.mask == "window":
                # A window of 1024 (4 x 4096, 32/8 heads, an H100): 64-row blocks with 3 stages 290 TFLOP/s, 128-row
                # ones 277, the Triton kernels 264. A document mask: 249 on 128-row blocks, 236 on 64-row ones, 242.
                ws = Config(64, 128, 8, 3, 128, 64, 8, 3, tma=1, wgmma=3)
            if spec.q_per_kv > 1:
                return [(None, ws)]
            return [(2048, triton_kernels), (None, ws)]
        return [(None, triton_kernels)]
    if dim > 64 and gluon and spec.score_mod is not None:
        # A score mod (ALiBi, bf16, 4 x 4096, 32/8 heads, the H200, backward alone): without a mask the
        # warp-specialized kernel adding dQ by TMA reductions 6.25 ms against 7.05 for it with the dQ kernel and 6.53
        # for the Triton kernels' default; causal the warp-specialized kernel 3.90 ms against 4.76 (BENCHMARKS.md).
        # A call wanting a gradient for a captured tensor runs the Triton kernels whatever the config says.
        if spec.mask == "none":
            return [(None, Config(64, 128, 8, 3, 64, 128, 8, 3, atomic_dq=1, tma=1, wgmma=3))]
        return [(None, Config(64, 128, 8, 2, 128, 64, 8, 3, tma=1, wgmma=3))]
    if dim > 64 and gluon:
        # The warp-specialized Gluon dK/dV kernel (bf16, 16k tokens, on the H200): d128 causal 1k 259 TFLOP/s
        # against 250 for the Triton kernels, causal 16k 433 against 419, GQA 32/8 full 4k 423 against 416;
        # three stages 0.5-2% ahead of two; at d64 its 64-row form lost, the 128-row one above leads (BENCHMARKS.md).
        # Head dims 72 ... 120, read into 128 columns, take d128's configs: on an H100 d96 ran 5-22% faster than on
        # the Triton kernels.
        if spec.mask == "none" and spec.layout == "dense" and spec.mask_mod is None:
            # Without a mask it also adds dQ by TMA reductions, five products a block pair where the dQ kernel made
            # it seven: 32/8 full 4k 465 against 425, 32/32 full 16k 473 against 453. Causal it lost (16k 366
            # against 438: BENCHMARKS.md).
            return [(None, Config(64, 128, 8, 3, 64, 128, 8, 3, atomic_dq=1, tma=1, wgmma=3))]
        # A window or a mask mod (bf16, 4 x 4096, 32/8 heads, d128, an H100, backward alone) with the dQ kernel:
        # window 1024 357 TFLOP/s against 268 for the Triton kernels (337 with dQ by reductions), a document mask
        # 337 against 275, prefix-LM 426 against 361, a window with 64 global tokens 283 against 215.
        return [(None, Config(64, 128, 8, 3, 128, 64, 8, 3, tma=1, wgmma=3))]
    if spec.mask == "causal" and spec.score_mod is not None:
        # ALiBi, causal (bf16, 4 x 4096, 32/8 heads, d128, the H200): 2 stages 4.59 ms against 5.32 for 3. Without
        # the mod 3 stages stay ahead (4.13 against 4.30), and so they do for ALiBi without the mask (6.86 / 7.99).
        return [(None, Config(64, 128, 8, 2, 128, 64, 8, 2, tma=tma))]
    return [(None, Config(64, 128, 8, 3, 128, 64, 8, 3, tma=tma))]


def _gathers(spec: AttentionBwdSpec) -> bool:
    return gathers_per_score(spec.score_mod) or gathers_per_score(spec.mask_mod)
