"""Reading a spec from the command line: flags, inline JSON, a JSON file, or a preset name.

The spec options are declared once, here: ``@takes_spec`` adds them to a command and
hands the command one resolved ``spec`` argument in their place.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from tilegen.families import families
from tilegen.ir import Spec, SpecError, spec_from_json

__all__ = ["presets", "resolve_spec", "takes_spec"]


def presets() -> dict[str, Spec]:
    """Named variants users tune most, from every registered family; ``default`` is the first family's."""
    found: dict[str, Spec] = {}
    for family in families():
        for name, spec in family.presets.items():
            found.setdefault(name, spec)
    return found


# The flags build a spec of the default preset's family; other families take --spec or --preset.
_OPTIONS: list[tuple[str, Any]] = [
    ("spec", Annotated[Optional[str], typer.Option(help="Spec as inline JSON or a path to a JSON file.")]),
    ("preset", Annotated[Optional[str], typer.Option(
        help=f"A named preset: {', '.join(presets())} (default: default).")]),
    ("head_dim", Annotated[Optional[int], typer.Option(help="Build the spec from flags: head dim.")]),
    ("head_dim_v", Annotated[Optional[int], typer.Option(help="Value head dim (default: head dim).")]),
    ("q_per_kv", Annotated[Optional[int], typer.Option(help="Query heads per KV head.")]),
    ("mask", Annotated[Optional[str], typer.Option(help="none, causal or window.")]),
    ("softcap", Annotated[Optional[bool], typer.Option("--softcap/--no-softcap", help="Logit softcapping.")]),
    ("dtype", Annotated[Optional[str], typer.Option(help="fp16, bf16 or fp32.")]),
    ("return_lse", Annotated[Optional[bool], typer.Option("--lse/--no-lse", help="Also write the log-sum-exp.")]),
]


def takes_spec(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give a typer command the spec options; it receives ``spec: Spec`` (resolved) instead.

    A bad spec ends in one line, ``error: ...`` naming the option or field, and exit code 2.
    """
    signature = inspect.signature(command, eval_str=True)
    rest = [p for name, p in signature.parameters.items() if name != "spec"]
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
               for name, annotation in _OPTIONS]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        flags = {name: kwargs.pop(name) for name, _ in _OPTIONS}
        try:
            spec = resolve_spec(**flags)
        except typer.BadParameter as e:
            typer.echo(f"error: {e.format_message()}", err=True)
            raise typer.Exit(2) from None
        return command(spec=spec, **kwargs)

    keywords = [p.replace(kind=p.KEYWORD_ONLY) for p in rest]
    wrapper.__signature__ = signature.replace(parameters=[*options, *keywords])
    wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}
    del wrapper.__wrapped__  # typer must read the new signature, not the command's
    return wrapper


def resolve_spec(spec: str | None, preset: str | None, head_dim: int | None = None, **flags: Any) -> Spec:
    """One spec from exactly one source; a bad one raises ``typer.BadParameter`` naming the field."""
    given = [name for name, value in (("--spec", spec), ("--preset", preset), ("--head-dim", head_dim)) if value is not None]
    if len(given) > 1:
        raise typer.BadParameter(f"give one of --spec, --preset or --head-dim, not {' and '.join(given)}")
    known = presets()
    try:
        if spec is not None:
            text = Path(spec).read_text() if not spec.lstrip().startswith("{") else spec
            return spec_from_json(text)
        if head_dim is not None:
            fields = {"family": known["default"].family, "head_dim": head_dim}
            return spec_from_json({**fields, **{k: v for k, v in flags.items() if v is not None}})
        name = preset or "default"
        if name not in known:
            raise typer.BadParameter(f"unknown preset {name!r}; known: {', '.join(known)}", param_hint="--preset")
        return known[name]
    except (SpecError, json.JSONDecodeError, OSError) as e:
        source = "--spec" if spec is not None else "--" + getattr(e, "field", "spec").replace("_", "-")
        raise typer.BadParameter(str(e), param_hint=source) from None
