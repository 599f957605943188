"""``tilegen emit``: print or write the generated source for a spec."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tilegen.cli import app
from tilegen.cli.spec_args import resolve_spec
from tilegen.codegen import source_for


@app.command()
def emit(
    spec: Optional[str] = typer.Option(None, help="Spec as inline JSON or a path to a JSON file."),
    preset: Optional[str] = typer.Option(None, help="A named preset (see `tilegen tune --help`)."),
    head_dim: Optional[int] = typer.Option(None, help="Build the spec from flags: head dim."),
    head_dim_v: Optional[int] = typer.Option(None, help="Value head dim (default: head dim)."),
    q_per_kv: Optional[int] = typer.Option(None, help="Query heads per KV head."),
    mask: Optional[str] = typer.Option(None, help="none, causal or window."),
    softcap: Optional[bool] = typer.Option(None, "--softcap/--no-softcap", help="Logit softcapping."),
    dtype: Optional[str] = typer.Option(None, help="fp16, bf16 or fp32."),
    return_lse: Optional[bool] = typer.Option(None, "--lse/--no-lse", help="Also write the log-sum-exp."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write here instead of stdout."),
) -> None:
    """Print the Triton kernel and launcher generated for a spec."""
    chosen = resolve_spec(
        spec, preset, head_dim,
        head_dim_v=head_dim_v, q_per_kv=q_per_kv, mask=mask, softcap=softcap, dtype=dtype, return_lse=return_lse,
    )
    try:
        text = source_for(chosen)
    except NotImplementedError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
        typer.echo(f"wrote {output} ({chosen.name}, spec {chosen.hash})", err=True)
