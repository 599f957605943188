"""Jinja rendering: a family's template plus its lowering's plain values gives Python source.

A template's hash covers the template and every piece it includes, transitively, so
editing a shared piece re-keys every family whose template pulls it in: its generated
modules, its Optuna studies and its tuned rows.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta

from tilegen import env
from tilegen.version import __version__
from tilegen.families import Family
from tilegen.ir import Spec

__all__ = ["context_for", "render", "render_spec", "template_hash", "template_closure"]


@functools.cache
def _environment(template_dir: Path | None) -> jinja2.Environment:
    # The family's own folder first, then tilegen's templates, where the shared pieces live.
    folders = [str(env.template_dir())] if template_dir is None else [str(template_dir), str(env.template_dir())]
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(folders),
        undefined=jinja2.StrictUndefined,  # a missing value is a bug in the lowering, not an empty string
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def template_closure(family: Family) -> dict[str, str]:
    """Every template the family's template pulls in, itself first: name -> source text."""
    environment = _environment(family.template_dir)
    found: dict[str, str] = {}
    pending = [family.template]
    while pending:
        name = pending.pop(0)
        if name in found:
            continue
        source = environment.loader.get_source(environment, name)[0]
        found[name] = source
        for referenced in jinja2.meta.find_referenced_templates(environment.parse(source)):
            if referenced is None:
                raise ValueError(f"{name}: includes a template by a computed name, which its hash could not cover")
            pending.append(referenced)
    return found


@functools.cache
def template_hash(family: Family) -> str:
    """Hash of the family's template and every piece it includes: a change to any re-keys its rows."""
    digest = hashlib.sha256()
    for name, source in sorted(template_closure(family).items()):
        digest.update(name.encode() + b"\0" + source.encode() + b"\0")
    return digest.hexdigest()[:16]


def render(family: Family, context: dict[str, Any]) -> str:
    template = _environment(family.template_dir).get_template(family.template)
    return template.render(template_name=family.template, template_hash=template_hash(family), **context)


def context_for(family: Family, spec: Spec) -> dict[str, Any]:
    """The template's values: the family's lowering plus what the header of every module shows."""
    return {
        "tilegen_version": __version__,
        "spec_json": spec.to_json(),
        "spec_json_literal": repr(spec.to_json()),
        "spec_hash": spec.hash,
        "spec_hash_literal": repr(spec.hash),
        "spec_name": spec.name,
        **family.lower(spec),
    }


def render_spec(family: Family, spec: Spec) -> str:
    """The generated source for ``spec``."""
    return render(family, context_for(family, spec))
