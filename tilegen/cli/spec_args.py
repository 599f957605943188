"""Reading a spec from the command line: flags, inline JSON, a JSON file, or a preset name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from tilegen.ir import AttentionSpec, SpecError, spec_from_json

__all__ = ["PRESETS", "resolve_spec", "SpecOpt", "PresetOpt", "HeadDimOpt", "HeadDimVOpt", "QPerKvOpt",
           "MaskOpt", "SoftcapOpt", "DtypeOpt", "LseOpt"]

#: Named variants users tune most; ``tilegen tune`` with no spec uses "default".
PRESETS: dict[str, AttentionSpec] = {
    "default": AttentionSpec(head_dim=64, mask="causal", dtype="bf16"),
    "llama-prefill": AttentionSpec(head_dim=128, q_per_kv=4, mask="causal", dtype="bf16"),
    "mha-d128-causal": AttentionSpec(head_dim=128, mask="causal", dtype="bf16"),
    "mha-d128": AttentionSpec(head_dim=128, mask="none", dtype="bf16"),
    "mha-d64-causal": AttentionSpec(head_dim=64, mask="causal", dtype="bf16"),
    "gemma-softcap": AttentionSpec(head_dim=256, q_per_kv=2, mask="window", softcap=True, dtype="bf16"),
}


# The spec options every command that takes a spec shares, declared once.
SpecOpt = Annotated[Optional[str], typer.Option(help="Spec as inline JSON or a path to a JSON file.")]
PresetOpt = Annotated[
    Optional[str], typer.Option(help=f"A named preset: {', '.join(PRESETS)} (default: default).")
]
HeadDimOpt = Annotated[Optional[int], typer.Option(help="Build the spec from flags: head dim.")]
HeadDimVOpt = Annotated[Optional[int], typer.Option(help="Value head dim (default: head dim).")]
QPerKvOpt = Annotated[Optional[int], typer.Option(help="Query heads per KV head.")]
MaskOpt = Annotated[Optional[str], typer.Option(help="none, causal or window.")]
SoftcapOpt = Annotated[Optional[bool], typer.Option("--softcap/--no-softcap", help="Logit softcapping.")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="fp16, bf16 or fp32.")]
LseOpt = Annotated[Optional[bool], typer.Option("--lse/--no-lse", help="Also write the log-sum-exp.")]


def resolve_spec(
    spec: str | None,
    preset: str | None,
    head_dim: int | None = None,
    **flags,
) -> AttentionSpec:
    """One spec from exactly one source; a bad one exits with a message naming the field."""
    given = [name for name, value in (("--spec", spec), ("--preset", preset), ("--head-dim", head_dim)) if value is not None]
    if len(given) > 1:
        raise typer.BadParameter(f"give one of --spec, --preset or --head-dim, not {' and '.join(given)}")
    try:
        if spec is not None:
            text = Path(spec).read_text() if not spec.lstrip().startswith("{") else spec
            return spec_from_json(text)
        if head_dim is not None:
            return AttentionSpec(head_dim=head_dim, **{k: v for k, v in flags.items() if v is not None})
        name = preset or "default"
        if name not in PRESETS:
            raise typer.BadParameter(f"unknown preset {name!r}; known: {', '.join(PRESETS)}", param_hint="--preset")
        return PRESETS[name]
    except (SpecError, json.JSONDecodeError, OSError) as e:
        source = "--spec" if spec is not None else "--" + getattr(e, "field", "spec").replace("_", "-")
        raise typer.BadParameter(str(e), param_hint=source) from None
