"""Inputs, tolerances and the reference check shared by the attention tests.

Tolerances. ``out`` is compared with ``tilegen.reference.attention_reference`` run in
float64 on the same (already rounded) inputs, by the relative Frobenius error
``||out - ref|| / ||ref||``: below 1e-2 for fp16/bf16 (one rounding of P to the input
dtype before the PV product and one of the output: a few 1e-3 for bf16) and below
1e-4 for fp32 (fp32 accumulation and IEEE dots: about 1e-7 seen). A max-abs bound on
top catches a few wrong rows that a norm over many rows would dilute.

The LSE is always computed in fp32 from products of the rounded inputs, which are
exact in fp32, so its error is only fp32 summation and exp2/log2 error (about 1e-6
seen, whatever the input dtype): 1e-4 for fp16/bf16 inputs leaves room for the GPU's
approximate exp2 and long rows, 1e-5 for fp32. Rows that see no key must give an
LSE of exactly -inf and an output row of exactly zero.
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

import tilegen
from tilegen.families.attention_fwd.reference import attention_reference

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

OUT_REL_TOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-4}
OUT_ABS_TOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 1e-4}
LSE_ABS_TOL = {torch.float16: 1e-4, torch.bfloat16: 1e-4, torch.float32: 1e-5}

#: Layouts of a [batch, heads, seq, dim] input that are not contiguous.
LAYOUTS = (
    "contiguous",
    "bnhd",  # allocated [batch, seq, heads, dim] and transposed, as most models hold it
    "dim-slice",  # a slice along the head dim of a wider tensor (row stride > dim)
    "seq-stride2",  # every second row of a longer sequence
    "dim-strided",  # allocated [batch, heads, dim, seq] and transposed: the head dim is not unit-stride
)


def checkout_pythonpath() -> str:
    """``PYTHONPATH`` for a subprocess: the checkout first, then this process's own, so that it imports the torch and
    Triton this process does (a suite run with another Triton on ``PYTHONPATH``: rows it tunes would be another
    Triton's to the parent)."""
    return os.pathsep.join(filter(None, (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH"))))


def sizeable_weights(module: torch.nn.Module) -> None:
    """Norm weights near 1 and projections of unit gain, in place: a decoder layer whose every weight's gradient is
    sizeable, and whose output is not small beside bf16's rounding of its input (nn.Linear's init makes it so)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else p.shape[1] ** -0.5) + (p.dim() == 1))


def make_tensor(shape, dtype, device, gen: torch.Generator, layout: str = "contiguous") -> torch.Tensor:
    """Fresh standard-normal values (never zeros) in the given layout; ``shape`` is [b, h, n, d]."""
    b, h, n, d = shape

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    if layout == "contiguous":
        t = randn(b, h, n, d)
    elif layout == "bnhd":
        t = randn(b, n, h, d).transpose(1, 2)
    elif layout == "dim-slice":
        t = randn(b, h, n, d + 24)[..., 8 : 8 + d]
    elif layout == "seq-stride2":
        t = randn(b, h, 2 * n, d)[:, :, ::2]
    elif layout == "dim-strided":
        t = randn(b, h, d, n).transpose(2, 3)
    else:
        raise ValueError(layout)
    assert t.shape == (b, h, n, d)
    return t


@dataclass(frozen=True)
class Case:
    """One attention call: shapes, dtype and mask arguments."""

    n_q: int
    n_k: int | None = None  # None: same as n_q
    head_dim: int = 64
    head_dim_v: int | None = None  # None: same as head_dim
    batch: int = 1
    heads_q: int = 2
    heads_kv: int = 2
    dtype: str = "fp16"
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    scale: float | None = None
    layout: str = "contiguous"
    seed: int = 0
    tags: tuple[str, ...] = field(default=(), compare=False)

    @property
    def nk(self) -> int:
        return self.n_q if self.n_k is None else self.n_k

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def mask_kwargs(self) -> dict:
        return {"causal": self.causal, "window": self.window, "softcap": self.softcap, "scale": self.scale}

    def inputs(self, device):
        gen = torch.Generator().manual_seed(self.seed)
        dt = self.torch_dtype
        q = make_tensor((self.batch, self.heads_q, self.n_q, self.head_dim), dt, device, gen, self.layout)
        k = make_tensor((self.batch, self.heads_kv, self.nk, self.head_dim), dt, device, gen, self.layout)
        v = make_tensor((self.batch, self.heads_kv, self.nk, self.dv), dt, device, gen, self.layout)
        return q, k, v

    @property
    def id(self) -> str:
        parts = [self.dtype, f"b{self.batch}", f"h{self.heads_q}kv{self.heads_kv}"]
        parts.append(f"n{self.n_q}" if self.n_k is None else f"nq{self.n_q}-nk{self.n_k}")
        parts.append(f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v is not None else ""))
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"win{self.window[0]}-{self.window[1]}".replace("None", "inf"))
        if self.softcap is not None:
            parts.append(f"softcap{self.softcap:g}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        return "-".join(parts + list(self.tags))


def param(case: Case, *marks) -> object:
    return pytest.param(case, id=case.id, marks=marks)


def effective_mask(causal: bool, window) -> str:
    """The spec's mask kind for these arguments (as ``tilegen.ops.attention`` canonicalizes them)."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    if left is None and right is None:
        return "none"
    if left is None and right == 0:
        return "causal"
    return "window"


def chosen_config(q, k, v, **kwargs):
    """The config the public op will run these arguments with."""
    return tilegen.explain(q, k, v, **kwargs).config


def run_public(request, case: Case, device, *, return_lse=True):
    """Call ``tilegen.attention`` for a case."""
    q, k, v = case.inputs(device)
    kwargs = case.mask_kwargs()
    result = tilegen.attention(q, k, v, return_lse=return_lse, **kwargs)
    return (q, k, v), result


def check_against_reference(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window=None,
    softcap: float | None = None,
    scale: float | None = None,
) -> None:
    """Assert ``out`` (and ``lse``) match the float64 reference within the dtype's bounds."""
    dtype = q.dtype
    batch, heads_q, n_q, _ = q.shape
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale)

    assert out.shape == (batch, heads_q, n_q, v.shape[3])
    assert out.dtype == dtype
    assert out.device == q.device
    # NaN compares false with everything, so it is checked on its own and never passes.
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} non-finite output elements"

    out64 = out.double()
    sees_keys = torch.isfinite(ref_lse)  # [b, h, n_q]: rows with at least one allowed key
    empty_rows = out64[~sees_keys]
    assert (empty_rows == 0).all(), "rows that see no key must be exactly zero"

    ref_norm = ref_out.norm().item()
    err = (out64 - ref_out).norm().item()
    if ref_norm == 0.0:
        assert err == 0.0
    else:
        rel = err / ref_norm
        assert rel < OUT_REL_TOL[dtype], f"relative error {rel:.3e} >= {OUT_REL_TOL[dtype]:.0e}"
    max_abs = (out64 - ref_out).abs().max().item() if out.numel() else 0.0
    assert max_abs < OUT_ABS_TOL[dtype], f"max abs error {max_abs:.3e} >= {OUT_ABS_TOL[dtype]:.0e}"

    if lse is None:
        return
    assert lse.shape == (batch, heads_q, n_q)
    assert lse.dtype == torch.float32
    assert not torch.isnan(lse).any(), "NaN in lse"
    assert not torch.isposinf(lse).any(), "+inf in lse"
    assert torch.equal(torch.isneginf(lse), ~sees_keys), "lse must be -inf exactly on rows that see no key"
    if sees_keys.any():
        lse_err = (lse.double() - ref_lse)[sees_keys].abs().max().item()
        assert lse_err < LSE_ABS_TOL[dtype], f"lse max abs error {lse_err:.3e} >= {LSE_ABS_TOL[dtype]:.0e}"


def tuned_row_in_a_fresh_db(tmp_path, monkeypatch, family, spec, size: int):
    """``(default, tuned)``: a config other than the family's default rule's for ``size``'s bucket, filed as the
    tuned row of ``spec`` on this device in a new database that dispatch then reads (``TILEGEN_DB``)."""
    import triton

    from tilegen import dispatch
    from tilegen.codegen.render import template_hash
    from tilegen.db import TuningDB
    from tilegen.device import device_info

    bucket = family.buckets.of(size)
    default = family.default_config(spec, device_info(), bucket)
    tuned = next(c for c in family.candidates(spec, device_info()) if c != default)
    with TuningDB(tmp_path / "rows.sqlite") as db:
        db.record_best(spec=spec, device=device_info(), template_hash=template_hash(family),
                       triton_version=triton.__version__, bucket=bucket, config=tuned.to_dict(), time_ms=0.001,
                       max_error=0.0, trials=1)
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path / "rows.sqlite"))
    dispatch.reset()
    return default, tuned


def poisoned_like_out(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel leaves unwritten stays NaN."""
    batch, heads, n_q, _ = q.shape
    return torch.full((batch, heads, n_q, v.shape[3]), math.nan, dtype=q.dtype, device=q.device)


_empty_like = torch.empty_like


def nan_outputs(patch) -> None:
    """New outputs allocated by ``torch.empty_like`` (as the ops allocate them) start as NaN, through ``patch`` (a
    ``pytest.MonkeyPatch``): an element the kernel leaves unwritten stays NaN."""
    patch.setattr(torch, "empty_like", lambda t, **kw: _empty_like(t, **kw).fill_(math.nan))


def inside(t: torch.Tensor, pad: int, fill: float | int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` copied into the middle of a buffer ``pad`` rows longer on each side (dimension 0)
    and filled with ``fill`` there: ``(the view, the buffer)``. NaN around an input shows a read
    outside it in the output; a pattern around an output shows a write outside it
    (``assert_guard_bands``)."""
    buffer = torch.full((t.shape[0] + 2 * pad, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    view = buffer[pad : pad + t.shape[0]]
    view.copy_(t)
    return view, buffer


def assert_guard_bands(buffer: torch.Tensor, pad: int, fill: float | int) -> None:
    """The ``pad`` rows each side of ``inside``'s view still hold ``fill``, bit for bit (NaN included)."""
    for band in (buffer[:pad], buffer[buffer.shape[0] - pad :]):
        expected = torch.full_like(band, fill)
        assert torch.equal(band.contiguous().view(torch.uint8), expected.view(torch.uint8)), \
            "a kernel wrote outside its output tensor"


def kernel_globals_are_constexpr(source: str) -> list[str]:
    """Assert no ``@triton.jit`` function of ``source`` reads a plain module-level name (the GPU
    compiler rejects that, the interpreter does not); return the kernels' names."""
    tree = ast.parse(source)
    plain = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and not ast.unparse(node.value).startswith("tl.constexpr(")
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    kernels = [n for n in tree.body if isinstance(n, ast.FunctionDef)
               and any(ast.unparse(d).startswith("triton.jit") for d in n.decorator_list)]
    assert kernels, "no @triton.jit function in the generated module"
    for fn in kernels:
        used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        assert not (used & plain), f"{fn.name} reads non-constexpr globals {sorted(used & plain)}"
    return [fn.name for fn in kernels]


@st.composite
def attention_calls(draw):
    """A random attention call: sizes off every block multiple, GQA, masks, fp32 and fp16."""
    mask = draw(st.sampled_from(["none", "causal", "window"]))
    window = None
    if mask == "window":
        side = st.one_of(st.none(), st.integers(0, 90))
        window = (draw(side), draw(side))
    return Case(
        n_q=draw(st.integers(1, 80)),
        n_k=draw(st.integers(1, 80)),
        head_dim=draw(st.sampled_from([16, 32, 40, 64])),
        batch=draw(st.integers(1, 2)),
        heads_kv=(heads_kv := draw(st.integers(1, 2))),
        heads_q=heads_kv * draw(st.integers(1, 4)),
        dtype=draw(st.sampled_from(["fp32", "fp16"])),
        causal=mask == "causal",
        window=window,
        seed=draw(st.integers(0, 2**16)),
    )


def gluon_descriptor(rows: int, head_dim: int, dtype: str) -> str:
    """The signature type of a Gluon TMA descriptor of [1, 1, rows, head_dim] blocks, as an sm90 compile
    request (``compile_for_sm90``) names a kernel argument."""
    from triton.experimental.gluon import language as gl

    element = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], element)
    return f"tensordesc<{dtype}[1, 1, {rows}, {head_dim}],{layout!r}>"


class OnGpu(torch.Tensor):
    """A CPU tensor a generated launcher takes for one on CUDA device 0: its Gluon branch runs up to the launch."""

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return 0


def compile_for_sm90(request: dict, tmp_path, *, kernels: int | None = None) -> str:
    """Compile a generated module's kernels for sm90 in a fresh process without the interpreter
    (``tests/sm90_compile.py``, which takes ``request``); asserts it succeeded, and compiled ``kernels``
    cubins when given, and returns its output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TILEGEN_CACHE_DIR"] = str(tmp_path)
    # This checkout's tilegen, whichever one is installed.
    env["PYTHONPATH"] = os.pathsep.join([str(Path(tilegen.__file__).parent.parent), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run([sys.executable, str(script), json.dumps(request)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    if kernels is not None:
        assert done.stdout.count("cubin bytes") == kernels, done.stdout
    return done.stdout
