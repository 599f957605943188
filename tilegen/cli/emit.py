"""``tilegen emit``: print or write the generated source for a spec.

With ``--tuned`` the module also carries this GPU's tuned configs and an ``attention``
entry point, so it runs with torch and triton alone, where tilegen is not installed.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Optional

import triton
import typer

from tilegen.cli import app
from tilegen.cli.spec_args import (
    DtypeOpt,
    HeadDimOpt,
    HeadDimVOpt,
    LseOpt,
    MaskOpt,
    PresetOpt,
    QPerKvOpt,
    SoftcapOpt,
    SpecOpt,
    resolve_spec,
)
from tilegen.codegen import attention_fwd, source_for
from tilegen.codegen.render import template_hash
from tilegen.db import DatabaseError, TuningDB, tuned_rows
from tilegen.device import device_info
from tilegen.ir import AttentionSpec


@app.command()
def emit(
    spec: SpecOpt = None,
    preset: PresetOpt = None,
    head_dim: HeadDimOpt = None,
    head_dim_v: HeadDimVOpt = None,
    q_per_kv: QPerKvOpt = None,
    mask: MaskOpt = None,
    softcap: SoftcapOpt = None,
    dtype: DtypeOpt = None,
    return_lse: LseOpt = None,
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write here instead of stdout."),
    tuned: bool = typer.Option(
        False, "--tuned", help="Append this GPU's tuned configs and an attention() entry point: "
        "a standalone module that needs only torch and triton.",
    ),
    db: Optional[Path] = typer.Option(
        None, "--db", help="With --tuned: the tuning database to read (default: $TILEGEN_DB, else the user's).",
    ),
) -> None:
    """Print the Triton kernel and launcher generated for a spec."""
    chosen = resolve_spec(
        spec, preset, head_dim,
        head_dim_v=head_dim_v, q_per_kv=q_per_kv, mask=mask, softcap=softcap, dtype=dtype, return_lse=return_lse,
    )
    if db is not None and not tuned:
        raise typer.BadParameter("--db is read only with --tuned", param_hint="--db")
    try:
        text = source_for(chosen)
        if tuned:
            text += standalone_entry_point(chosen, user_db=db)
    except NotImplementedError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except DatabaseError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
        typer.echo(f"wrote {output} ({chosen.name}, spec {chosen.hash})", err=True)


def standalone_entry_point(spec: AttentionSpec, *, user_db: Path | None = None) -> str:
    """Python source to append to ``source_for(spec)``: the tuned table of this device and ``attention``.

    Rows come from ``tuned_rows`` (``user_db`` over the shipped database) for
    ``device_info()``, this Triton and this template.
    """
    if user_db is not None:
        TuningDB(user_db, readonly=True).close()  # an explicit file must exist and be readable
    device = device_info()
    template = template_hash(attention_fwd.TEMPLATE)
    rows = tuned_rows(spec, device, template, triton.__version__, user_db=user_db)
    table = "".join(f"\n    {b}: {config.to_dict()!r},  # {source}" for b, (config, source) in sorted(rows.items()))
    return _STANDALONE.substitute(
        device=device.key,
        template_hash=template,
        triton_version=triton.__version__,
        tuned="{" + table + ("\n}" if rows else "}"),
        defaults=repr([(largest, config.to_dict()) for largest, config in attention_fwd.default_rule(spec, device)]),
        dtype=_TORCH_DTYPES[spec.dtype],
        spec_name=spec.name,
        softcap_code=_SOFTCAP_CODE[spec.softcap],
        window_code=_WINDOW_CODE[spec.mask],
        lse_doc=" and the natural-log LSE, fp32 [batch, heads, n_q]" if spec.return_lse else "",
        lse_alloc=_LSE_ALLOC if spec.return_lse else "",
        lse_arg="lse" if spec.return_lse else "out",  # the kernel ignores the pointer when it writes no LSE
        returns="(out, lse)" if spec.return_lse else "out",
    )


_LSE_ALLOC = "    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)\n"
_TORCH_DTYPES = {"fp16": "torch.float16", "bf16": "torch.bfloat16", "fp32": "torch.float32"}

# Checks and launch values per spec, decided here so the emitted code carries only its own
# case. Window bounds as tilegen.ops.attention.prepare_call sets them: an unbounded side is
# n_q + n_k (wide enough to reach every key), causal is right = 0.
_SOFTCAP_CODE = {
    True: """\
    if softcap is None:
        raise ValueError("softcap: this kernel was generated with logit softcapping; pass softcap=")
    softcap = float(softcap)""",
    False: """\
    if softcap is not None:
        raise ValueError("softcap: this kernel was generated without logit softcapping")
    softcap = 0.0""",
}
_WINDOW_CODE = {
    "none": """\
    if window_left is not None or window_right is not None:
        raise ValueError("window_left, window_right: this kernel was generated without a mask")
    left = right = n_q + n_k""",
    "causal": """\
    if window_left is not None or window_right not in (None, 0):
        raise ValueError("window_left, window_right: this kernel was generated causal (left unbounded, right 0)")
    left, right = n_q + n_k, 0""",
    "window": """\
    left = n_q + n_k if window_left is None else int(window_left)
    right = n_q + n_k if window_right is None else int(window_right)""",
}

_STANDALONE = string.Template('''

# ---- Standalone entry point, written by `tilegen emit --tuned` ---------------------------
# Tuned configs for $device (template $template_hash, Triton $triton_version).
# A call is bucketed by max(n_q, n_k) rounded up to a power of two (at least 16). It runs
# the config of that bucket when tuned, else of the tuned bucket nearest in log2 distance
# (the larger on a tie), else the heuristic default of DEFAULTS, a list of (largest
# bucket, config) ending in None: the rules tilegen's own dispatch follows.
# Under Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) bf16 dots come out wrong; tilegen
# mends the interpreter at run time, this module does not, so interpret fp16 or fp32 only.
import math

import torch

TUNED = $tuned
DEFAULTS = $defaults
MIN_BUCKET = 16
DTYPE = $dtype


def config_for(n):
    """The launch config for a call whose longer sequence has ``n`` tokens."""
    bucket = MIN_BUCKET
    while bucket < n:
        bucket *= 2
    if not TUNED:
        return next(config for largest, config in DEFAULTS if largest is None or bucket <= largest)
    nearest = min(TUNED, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))
    return TUNED[nearest]


def attention(q, k, v, *, scale=None, softcap=None, window_left=None, window_right=None):
    """$spec_name on [batch, heads, seq, dim] tensors: returns out$lse_doc.

    ``window_left``/``window_right`` bound the keys around the bottom-right aligned
    diagonal (None: unbounded); ``scale`` defaults to 1/sqrt(head_dim).
    """
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != DTYPE:
            raise TypeError("%s: expected %s, got %s" % (name, DTYPE, t.dtype))
    if dim != HEAD_DIM or v.shape[3] != HEAD_DIM_V or heads != k.shape[1] * Q_PER_KV:
        raise ValueError(
            "q, k, v: expected head dims %d/%d and %d query heads per KV head, got shapes %s, %s, %s"
            % (HEAD_DIM, HEAD_DIM_V, Q_PER_KV, tuple(q.shape), tuple(k.shape), tuple(v.shape))
        )
    scale = 1.0 / math.sqrt(int(HEAD_DIM)) if scale is None else float(scale)
$softcap_code
$window_code
    out = q.new_empty(batch, heads, n_q, int(HEAD_DIM_V))  # int(): the kernel's globals are tl.constexpr
$lse_alloc    if out.numel():
        launch(
            q, k, v, out, $lse_arg, scale=scale, softcap=softcap, window_left=left, window_right=right,
            **config_for(max(n_q, n_k)),
        )
    return $returns
''')
