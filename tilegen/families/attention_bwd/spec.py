"""The spec of the attention-backward family: the gradients of an attention forward variant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tilegen.families.attention_fwd.spec import AttentionFields, check_mods, mod_name_parts
from tilegen.ir import Spec, SpecError, check_choice

__all__ = ["AttentionBwdSpec", "LAYOUTS"]

LAYOUTS = ("dense", "ragged")


@dataclass(frozen=True)
class AttentionBwdSpec(AttentionFields):
    """The backward of one attention variant: dQ, dK and dV from dO, Q, K, V, O and the forward's LSE.

    Attributes:
        head_dim, head_dim_v, q_per_kv, mask, softcap, dtype: the forward's (``AttentionSpec``);
            GQA's dK and dV are summed over each group's query heads inside the kernel.
        layout: ``"dense"`` ([batch, heads, seq, dim], ``tilegen.attention``) or ``"ragged"``
            (packed sequences, ``tilegen.varlen_attention``).
        return_lse: always False: the backward reads the LSE and takes its gradient at launch.
        score_mod, mask_mod: the forward's mods (``tilegen.mods``), canonical texts or ``None`` (left out of the
            JSON then, so specs without mods keep their hashes). The backward recomputes the scores through
            them and differentiates the score mod (``tilegen.mods.grad``).
    """

    family: ClassVar[str] = "attention_bwd"

    layout: str = "dense"
    score_mod: str | None = None
    mask_mod: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("layout", self.layout, LAYOUTS)
        check_mods(self)
        if self.return_lse:
            raise SpecError("return_lse", "the backward returns gradients; the LSE's own gradient is a launch argument")

    __hash__ = Spec.__hash__

    @property
    def name(self) -> str:
        parts = self.name_parts()
        if self.layout != "dense":
            parts.append(self.layout)
        return "_".join(parts + mod_name_parts(self))


def dense_rows(spec: AttentionBwdSpec) -> tuple:
    """The spec whose tuned rows serve a ragged ``spec`` (the tuner measures dense batches only: ``Family.rows_from``):
    the same kernels on a dense batch, each row where ``feasible`` takes its config for the ragged one. A row the
    ragged kernels do not run (the warp-specialized kernel adding dQ by reductions) is not served: where no bucket's
    is, the ragged spec takes its own default rule; else, as any untuned bucket, the nearest served row. Served
    anyway, the launch would run the Triton kernels with atomics (261 TFLOP/s against 385 on the warp-specialized
    kernel with the dQ kernel, d128 32/8 full, an H100)."""
    return (spec.replace(layout="dense"),) if spec.layout == "ragged" else ()
