"""Reading a spec from the command line: flags, inline JSON, a JSON file, or a preset name.

The spec options are declared once, here: ``@takes_spec`` adds them to a command and
hands the command one resolved ``spec`` argument in their place; ``@takes_specs`` hands it a
list, ``specs``, for a command that takes several variants at once (``--preset a,b``, or a
JSON list in ``--spec``).
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from tilegen.families import families
from tilegen.db.validate import safe_text
from tilegen.ir import Spec, SpecError
from tilegen.families import spec_from_json

__all__ = ["MOD_HELP", "mod_texts", "presets", "resolve_spec", "resolve_specs", "takes_spec", "takes_specs",
           "with_mods"]


def presets() -> dict[str, Spec]:
    """Named variants users tune most, from every registered family; ``default`` is the first family's."""
    found: dict[str, Spec] = {}
    for family in families():
        for name, spec in family.presets.items():
            found.setdefault(name, spec)
    return found


# The flags build a spec of the default preset's family; other families take --spec or --preset.
_OPTIONS: list[tuple[str, Any]] = [
    ("spec", Annotated[Optional[str], typer.Option(
        help="Spec as inline JSON or a path to a JSON file (tilegen tune: also a JSON list of specs).")]),
    ("preset", Annotated[Optional[str], typer.Option(
        help=f"A named preset: {', '.join(presets())} (default: default; tilegen tune: several, comma-separated).")]),
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
    return _with_spec_options(command, "spec", resolve_spec)


def takes_specs(command: Callable[..., Any]) -> Callable[..., Any]:
    """``takes_spec`` for a command of several variants: it receives ``specs: list[Spec]``."""
    return _with_spec_options(command, "specs", resolve_specs)


def _with_spec_options(command: Callable[..., Any], name: str, resolve: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(command, eval_str=True)
    rest = [p for param, p in signature.parameters.items() if param != name]
    options = [inspect.Parameter(option, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
               for option, annotation in _OPTIONS]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        flags = {option: kwargs.pop(option) for option, _ in _OPTIONS}
        try:
            resolved = resolve(**flags)
        except typer.BadParameter as e:
            typer.echo(f"error: {e.format_message()}", err=True)
            raise typer.Exit(2) from None
        return command(**{name: resolved}, **kwargs)

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
    _refuse_stray_flags(head_dim, flags)
    known = presets()
    try:
        if spec is not None:
            data = _spec_json(spec)
            if not isinstance(data, dict):
                raise SpecError("spec", f"expected a JSON object, got {type(data).__name__}")
            return spec_from_json(data)
        if head_dim is not None:
            fields = {"family": known["default"].family, "head_dim": head_dim}
            return spec_from_json({**fields, **{k: v for k, v in flags.items() if v is not None}})
        name = "default" if preset is None else preset  # an empty --preset names no preset, not the default
        if name not in known:
            raise typer.BadParameter(f"unknown preset {name!r}; known: {', '.join(known)}", param_hint="--preset")
        return known[name]
    except SpecError as e:
        source = "--spec" if spec is not None else "--" + e.field.replace("_", "-")
        raise typer.BadParameter(str(e), param_hint=source) from None


def _spec_json(spec: str) -> Any:
    """``--spec``'s JSON, inline or read from the file it names; what cannot be read or parsed raises
    ``typer.BadParameter`` naming --spec."""
    if not spec.strip():  # Path("") is the working folder
        raise typer.BadParameter("empty; expected a spec's JSON object or the path of a file holding it",
                                 param_hint="--spec")
    try:
        text = Path(spec).read_text() if not spec.lstrip().startswith(("{", "[")) else spec
        return json.loads(text)
    except RecursionError:
        raise typer.BadParameter("nested too deeply to be a spec", param_hint="--spec") from None
    except (ValueError, OSError) as e:  # not JSON, not UTF-8, an integer of thousands of digits; no such file
        raise typer.BadParameter(safe_text(e), param_hint="--spec") from None


def _refuse_stray_flags(head_dim: int | None, flags: dict[str, Any]) -> None:
    """The spec flags build a spec only with --head-dim: without it they would be silently dropped."""
    stray = [name for name, value in flags.items() if value is not None]
    if head_dim is None and stray:
        flag = "--" + {"return_lse": "lse"}.get(stray[0], stray[0]).replace("_", "-")
        raise typer.BadParameter("taken only with --head-dim (the flags build a spec of the default family); give "
                                 "--head-dim too, or set the field in --spec's JSON", param_hint=flag)


def resolve_specs(spec: str | None, preset: str | None, head_dim: int | None = None, **flags: Any) -> list[Spec]:
    """Several specs, in order and each once: ``--preset a,b``, or a JSON list of spec objects in
    ``--spec``; otherwise the one spec ``resolve_spec`` gives."""
    _refuse_stray_flags(head_dim, flags)
    if preset is not None and "," in preset:
        if spec is not None or head_dim is not None:
            resolve_spec(spec, preset, head_dim)  # raises: one source only
        names = [name.strip() for name in preset.split(",")]
        if "" in names:
            raise typer.BadParameter(f"expected comma-separated preset names, got {preset!r}", param_hint="--preset")
        return list(dict.fromkeys(resolve_spec(None, name) for name in names))
    if spec is not None and preset is None and head_dim is None:
        data = _spec_json(spec)
        if isinstance(data, list):
            if not data:
                raise typer.BadParameter("the list of specs is empty", param_hint="--spec")
            specs = []
            for index, item in enumerate(data):
                if not isinstance(item, dict):
                    raise typer.BadParameter(f"item {index}: expected a spec object, got {item!r}", param_hint="--spec")
                try:
                    specs.append(spec_from_json(item))
                except SpecError as e:
                    raise typer.BadParameter(f"item {index}: {e}", param_hint="--spec") from None
            return list(dict.fromkeys(specs))
    return [resolve_spec(spec, preset, head_dim, **flags)]


#: The help of ``--score-mod``/``--mask-mod`` (``{kind}``: which one), shared by the commands that take them.
MOD_HELP = (
    "A {kind} for the spec, named as pkg.module:attr (importable from the current folder or PYTHONPATH): the mod "
    "function itself, used as it is, or a factory, a callable without positional parameters that is called with "
    "the keywords batch, heads, n_q, n_k and device of each tuned problem and returns the mod built for that shape "
    "(so that captured tensors such as document ids fit every bucket; in the paged families both positions run "
    "over n_k). The spec holds the mod's canonical text, which keys its rows: a call with a mod that traces the "
    "same dispatches to them (docs/mods.md)."
)


def mod_texts(score_mod: str | None, mask_mod: str | None) -> dict[str, str]:
    """The canonical texts of the mods ``--score-mod``/``--mask-mod`` name, by spec field; a bad path ends the
    command in one line naming the option."""
    from tilegen.cli.app import fail
    from tilegen.mods.sources import canonical_text

    texts = {}
    for kind, path in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if path is not None:
            try:
                texts[kind] = canonical_text(path, kind)
            except ValueError as e:
                fail(str(e))
    return texts


def with_mods(specs: list[Spec], score_mod: str | None, mask_mod: str | None) -> list[Spec]:
    """``specs`` with the canonical texts of the mods ``--score-mod``/``--mask-mod`` name; a bad path or a
    family without mods ends the command in one line naming the option."""
    from tilegen.cli.app import fail

    texts = mod_texts(score_mod, mask_mod)
    if not texts:
        return specs
    options = {kind: "--" + kind.replace("_", "-") for kind in texts}
    from tilegen.mods.builtin import reduce_mods

    # A call runs such a mod as the built-in option it means (tilegen.mods.builtin): a spec holding it is never used.
    reduced = reduce_mods(texts.get("score_mod"), texts.get("mask_mod"), None, None, None, 0, 0)
    if "mask_mod" in texts and reduced.mask_mod is None:
        left, right = reduced.window
        fail(f"--mask-mod: {mask_mod} keeps a band of diagonals, which calls run as the built-in window ({left}, "
             f"{right}) (None: unbounded); tune a preset or --mask of that built-in instead")
    if "score_mod" in texts and reduced.score_mod is None:
        what = f"the built-in softcap {reduced.softcap:g}" if reduced.softcap is not None else "no mod at all"
        fail(f"--score-mod: {score_mod} is {what}, which calls run as such; tune a preset of that built-in instead")
    option, modded = next(iter(options.values())), []
    for spec in specs:
        if not all(hasattr(spec, kind) for kind in texts):
            fail(f"{option}: {spec.family} specs take no mods; the attention families' do (attention_fwd, "
                 "attention_varlen, attention_decode, attention_bwd)")
        try:
            modded.append(spec.replace(**texts))
        except SpecError as e:
            fail(f"{options.get(e.field, option)}: {e}")
    return modded
