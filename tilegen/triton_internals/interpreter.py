"""Fixes for Triton's CPU interpreter, applied only when ``TRITON_INTERPRET=1`` and only where needed.

Two interpreter bugs matter to tilegen's kernels; Triton 3.6.0, 3.8.0 and 3.9.0 all have them:

- ``tl.dot`` hands bfloat16 operands, stored as raw uint16 bits, straight to ``np.matmul``,
  so every bf16 dot returns garbage;
- fp32 -> bf16 casts truncate where the GPU rounds to nearest even.

The generated kernels must stay the ones the GPU compiles, so the interpreter is mended
instead: bf16 dot operands are widened to fp32 (exact) and the cast rounds as the GPU
does. Each fix is applied only when a probe on the installed Triton shows its bug, so a
Triton that fixes one keeps its own code. The probes, not the version gate
(``tilegen.triton_internals.gate``), decide: a Triton whose launch path is not recognised
may still have these bugs, and its interpreter must then be mended as any other's; an
interpreter laid out otherwise (no ``InterpreterBuilder``, other method signatures) fails
its probes and is left alone.

``mend_interpreter`` imports nothing from tilegen: ``tilegen emit`` copies its source into the
modules it writes (``mend_on_import_source``), which must run right under the interpreter too.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["InterpreterSetupError", "check_interpreter", "mend_interpreter", "mend_on_import_source",
           "patch_interpreter"]


class InterpreterSetupError(RuntimeError):
    """``TRITON_INTERPRET=1`` was set after Triton was imported: its kernels cannot run."""


def check_interpreter() -> None:
    """Raise ``InterpreterSetupError`` when Triton was imported before ``TRITON_INTERPRET=1`` was set.

    Triton decides at import time whether its own library functions (``tl.max``, ``tl.sum``,
    ...) are compiled or interpreted; set afterwards, an interpreted kernel calls compiled
    ones and fails with "Cannot call @triton.jit'd outside of the scope of a kernel".
    """
    import triton.language as tl

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # an interpreter laid out otherwise: the check cannot tell, so it says nothing
        return
    if not isinstance(getattr(getattr(tl, "standard", None), "sum", None), InterpretedFunction):
        raise InterpreterSetupError(
            "TRITON_INTERPRET=1 was set after triton was imported (import tilegen imports it), so Triton "
            "cannot interpret kernels in this process. Set it before the first import: run "
            "`TRITON_INTERPRET=1 python ...`, or put os.environ[\"TRITON_INTERPRET\"] = \"1\" above `import tilegen`"
        )


@functools.cache
def patch_interpreter() -> tuple[str, ...]:
    """Check the interpreter can run kernels, then mend it; returns the fixes applied (once per process)."""
    check_interpreter()
    return mend_interpreter()


def mend_on_import_source() -> str:
    """Python source defining ``mend_interpreter`` and calling it when imported under the interpreter: what
    ``tilegen emit`` writes into a module that may run where tilegen is not there to mend Triton (the module
    imports ``os``)."""
    return ("# Under Triton's CPU interpreter (TRITON_INTERPRET=1) bf16 dots, fp32 -> bf16 casts and bf16 arithmetic\n"
            "# come out wrong (3.6.0 through 3.9.0 at least): mend_interpreter, tilegen's own fix, mends each bug that\n"
            "# the installed Triton shows when this module is imported.\n"
            + inspect.getsource(mend_interpreter)
            + '\n\nif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):\n    mend_interpreter()\n')


def mend_interpreter() -> tuple[str, ...]:
    """Apply each fix whose bug the installed Triton's interpreter shows; returns their names."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if builder is None or handle is None:
        return ()  # not the interpreter these fixes were written for: no probe can tell, none applies

    def widen(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        data = (np.asarray(t.data, np.uint16).astype(np.uint32) << 16).view(np.float32)
        return handle(data, tl.float32)

    def fp32_to_bf16_bits(x):
        # Round to nearest even on the bit pattern; the carry runs into the exponent
        # as it must. NaN stays a quiet NaN.
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)

    def dot_is_wrong() -> bool:
        one = handle(np.array([[0x3F80]], np.uint16), tl.bfloat16)  # bf16 1.0
        acc = handle(np.zeros((1, 1), np.float32), tl.float32)
        try:
            out = builder.create_dot(builder(), one, one, acc, None, None)
        except Exception:  # a changed signature: the probe cannot tell, so leave it alone
            return False
        return float(np.asarray(out.data, np.float32).reshape(-1)[0]) != 1.0

    def cast_is_wrong() -> bool:
        # 0x3F80FFFF lies nearer bf16 0x3F81 than 0x3F80; truncation gives 0x3F80.
        src = handle(np.array([0x3F80FFFF], np.uint32).view(np.float32), tl.float32)
        try:
            out = builder.cast_impl(builder(), src, tl.bfloat16)
        except Exception:
            return False
        return int(np.asarray(out.data).view(np.uint16)[0]) != 0x3F81

    def arithmetic_is_wrong() -> bool:
        # bf16 1.0 * bf16 2.0: numpy multiplies the uint16 bit patterns the interpreter holds bf16 in.
        one, two = (handle(np.array([bits], np.uint16), tl.bfloat16) for bits in (0x3F80, 0x4000))
        try:
            out = builder.create_fmul(builder(), one, two)
        except Exception:
            return False
        return int(np.asarray(out.data).view(np.uint16)[0]) != 0x4000

    def narrow(out, dtype):
        # An op on widened operands: back to bf16 bits where the op's type is bf16 (a comparison's bools stay).
        data = np.asarray(out.data)
        if dtype.scalar != tl.bfloat16 or data.dtype != np.float32:
            return out
        return handle(fp32_to_bf16_bits(data), tl.bfloat16)

    applied = []
    if not hasattr(builder, "get_bf16"):  # Triton 3.6's interpreter has no bf16 constants (y * 4 on a bf16 y)
        builder.get_bf16 = lambda self, value: handle(fp32_to_bf16_bits(np.array([value], np.float32)), tl.bfloat16)
        applied.append("bf16-constant")
    if arithmetic_is_wrong():
        original_binary, original_unary = builder.binary_op, builder.unary_op

        def binary_op(self, lhs, rhs, op):
            if lhs.dtype.scalar != tl.bfloat16 and rhs.dtype.scalar != tl.bfloat16:
                return original_binary(self, lhs, rhs, op)
            return narrow(original_binary(self, widen(lhs), widen(rhs), op), lhs.dtype)

        def unary_op(self, arg, op):
            if arg.dtype.scalar != tl.bfloat16:
                return original_unary(self, arg, op)
            return narrow(original_unary(self, widen(arg), op), arg.dtype)

        builder.binary_op, builder.unary_op = binary_op, unary_op
        applied.append("bf16-arithmetic")
    if dot_is_wrong():
        original_dot = builder.create_dot

        def create_dot(self, a, b, *rest, **kwargs):
            if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
                a, b = widen(a), widen(b)
            return original_dot(self, a, b, *rest, **kwargs)

        builder.create_dot = create_dot
        applied.append("bf16-dot")
    if cast_is_wrong():
        original_cast = builder.cast_impl

        def cast_impl(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                return handle(fp32_to_bf16_bits(np.asarray(src.data, np.float32)), tl.bfloat16)
            return original_cast(self, src, dst_type)

        builder.cast_impl = cast_impl
        applied.append("bf16-cast")
    return tuple(applied)
