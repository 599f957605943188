"""The entry point ``tilegen emit --tuned`` appends to an attention-forward module.

The emitted module runs with torch and triton alone. It inlines the source of the
bucket rule and of ``launch_window``, so it picks configs and window bounds exactly as
tilegen's own dispatch does.
"""

from __future__ import annotations

import inspect
import string

from tilegen.device import DeviceInfo
from tilegen.dtypes import TORCH_DTYPES
from tilegen.families.attention_fwd.config import Config
from tilegen.families.attention_fwd.masks import launch_window
from tilegen.families.attention_fwd.spec import AttentionSpec
from tilegen.families.base import Family
from tilegen.triton_internals.interpreter import mend_on_import_source

__all__ = ["entry_point"]


def entry_point(
    family: Family, spec: AttentionSpec, tuned: dict[int, tuple[Config, str]], device: DeviceInfo, *,
    template_hash: str, triton_version: str,
) -> str:
    """The family's ``standalone``: what ``tilegen emit --tuned`` appends to the generated module."""
    if spec.score_mod is not None or spec.mask_mod is not None:
        raise NotImplementedError("score_mod/mask_mod: emit --tuned writes an entry point without the mods' "
                                  "captured tensors; emit the module alone (its launch takes mod_tensors)")
    defaults, buckets = family.fitted_default_rule(spec, device), family.buckets
    # Everything below that comes from a database or the machine is rendered from a checked Python value:
    # ints through int(), configs through the family's type, text as a repr or a comment with no line break.
    table = "".join(f"\n    {int(b)}: {_knobs(config)!r},  # {_comment(source)}"
                    for b, (config, source) in sorted(tuned.items()))
    return _STANDALONE.substitute(
        device=_comment(device.key),
        template_hash=_comment(template_hash),
        triton_version=_comment(triton_version),
        tuned="{" + table + ("\n}" if tuned else "}"),
        defaults=repr([(None if largest is None else int(largest), _knobs(config)) for largest, config in defaults]),
        bucket_rule=buckets.source(),
        launch_window=inspect.getsource(launch_window),
        mend_on_import=mend_on_import_source(),
        mask=repr(spec.mask),
        dtype=str(TORCH_DTYPES[spec.dtype]),
        spec_name=spec.name,
        softcap_code=_SOFTCAP_CODE[spec.softcap],
        window_check=_WINDOW_CHECK[spec.mask],
        lse_doc=" and the natural-log LSE, fp32 [batch, heads, n_q]" if spec.return_lse else "",
        lse_alloc=_LSE_ALLOC if spec.return_lse else "",
        lse_arg="lse" if spec.return_lse else "out",  # the kernel ignores the pointer when it writes no LSE
        returns="(out, lse)" if spec.return_lse else "out",
    )


def _knobs(config: Config) -> dict[str, int]:
    """The knobs of a config of this family, as plain ints (what ``Config.from_dict`` accepted)."""
    if not isinstance(config, Config):
        raise TypeError(f"tuned: expected {Config.__name__} values, got {type(config).__name__}")
    return {str(name): int(value) for name, value in Config.from_dict(config.to_dict()).to_dict().items()}


def _comment(text: object) -> str:
    """Text for the rest of a comment line: printable ASCII only, so no line break ends the comment."""
    return "".join(c if " " <= c <= "~" else "?" for c in str(text))[:200]


_LSE_ALLOC = "    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)\n"

# Checks per spec, decided here so the emitted code carries only its own case.
_SOFTCAP_CODE = {
    True: """\
    if softcap is None:
        raise ValueError("softcap: this kernel was generated with logit softcapping; pass softcap=")
    softcap = float(softcap)
    if not 0 < softcap < math.inf:
        raise ValueError("softcap: expected a finite positive number, got %r" % softcap)""",
    False: """\
    if softcap is not None:
        raise ValueError("softcap: this kernel was generated without logit softcapping")
    softcap = 0.0""",
}
_WINDOW_CHECK = {
    "none": """\
    if window_left is not None or window_right is not None:
        raise ValueError("window_left, window_right: this kernel was generated without a mask")
""",
    "causal": """\
    if window_left is not None or window_right not in (None, 0):
        raise ValueError("window_left, window_right: this kernel was generated causal (left unbounded, right 0)")
""",
    "window": """\
    # A negative or fractional side would reach the kernel's integer bounds as a band no call means.
    for name, side in (("window_left", window_left), ("window_right", window_right)):
        if side is not None and (isinstance(side, bool) or not isinstance(side, numbers.Integral) or side < 0):
            raise ValueError("%s: expected an int >= 0 or None (unbounded), got %r" % (name, side))
    window_left, window_right = (None if side is None else int(side) for side in (window_left, window_right))
""",
}

_STANDALONE = string.Template('''

# ---- Standalone entry point, written by `tilegen emit --tuned` ---------------------------
# Tuned configs for $device (template $template_hash, Triton $triton_version).
# A call is bucketed by max(n_q, n_k) (bucket_of). It runs the config of that bucket when
# tuned, else of the tuned bucket nearest to it (nearest_bucket), else the heuristic default
# of DEFAULTS, a list of (largest bucket, config) ending in None: the rules and the code of
# tilegen's own dispatch.
import math
import numbers
import os

import torch

TUNED = $tuned
DEFAULTS = $defaults
MASK = $mask
DTYPE = $dtype


$bucket_rule


$launch_window


$mend_on_import


def config_for(n):
    """The launch config for a call whose longer sequence has ``n`` tokens."""
    bucket = bucket_of(n)
    if not TUNED:
        return next(config for largest, config in DEFAULTS if largest is None or bucket <= largest)
    return TUNED[nearest_bucket(bucket, TUNED)]


def attention(q, k, v, *, scale=None, softcap=None, window_left=None, window_right=None):
    """$spec_name on [batch, heads, seq, dim] tensors: returns out$lse_doc.

    ``window_left``/``window_right`` bound the keys around the bottom-right aligned
    diagonal (None: unbounded); ``scale`` defaults to 1/sqrt(head_dim).
    """
    # The kernel reads k and v with q's batch and k's heads and length: a mismatch would read past them.
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError("%s: expected 4 dims [batch, heads, seq, head_dim], got %r"
                             % (name, tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__))
        if t.dtype != DTYPE:
            raise TypeError("%s: expected %s, got %s" % (name, DTYPE, t.dtype))
        if t.device != q.device:
            raise ValueError("%s: on %s while q is on %s; all inputs must share a device" % (name, t.device, q.device))
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError("k, v: batch sizes %d, %d differ from q's %d" % (k.shape[0], v.shape[0], batch))
    if k.shape[3] != dim:
        raise ValueError("k: head dim %d differs from q's %d" % (k.shape[3], dim))
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError("v: heads and seq %s differ from k's %s" % (tuple(v.shape[1:3]), tuple(k.shape[1:3])))
    if dim != HEAD_DIM or v.shape[3] != HEAD_DIM_V or heads != k.shape[1] * Q_PER_KV:
        raise ValueError(
            "q, k, v: expected head dims %d/%d and %d query heads per KV head, got shapes %s, %s, %s"
            % (HEAD_DIM, HEAD_DIM_V, Q_PER_KV, tuple(q.shape), tuple(k.shape), tuple(v.shape))
        )
    scale = 1.0 / math.sqrt(int(HEAD_DIM)) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError("scale: expected a finite number, got %r" % scale)
$softcap_code
$window_check    left, right = launch_window(MASK, window_left, window_right, n_q, n_k)
    out = q.new_empty(batch, heads, n_q, int(HEAD_DIM_V))  # int(): the kernel's globals are tl.constexpr
$lse_alloc    if out.numel():
        launch(
            q, k, v, out, $lse_arg, scale=scale, softcap=softcap, window_left=left, window_right=right,
            **config_for(max(n_q, n_k)),
        )
    return $returns
''')
