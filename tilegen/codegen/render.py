"""Jinja rendering: a template plus plain values from a lowering gives Python source."""

from __future__ import annotations

import functools
import hashlib

import jinja2

from tilegen import env

__all__ = ["render", "template_hash"]


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(env.template_dir())),
        undefined=jinja2.StrictUndefined,  # a missing value is a bug in the lowering, not an empty string
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


@functools.cache
def template_hash(name: str) -> str:
    """Hash of the template text: a template edit re-keys caches, studies and tuned rows."""
    text = (env.template_dir() / name).read_bytes()
    return hashlib.sha256(text).hexdigest()[:16]


def render(name: str, context: dict) -> str:
    template = _environment().get_template(name)
    return template.render(template_name=name, template_hash=template_hash(name), **context)
