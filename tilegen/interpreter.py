"""Fixes for Triton's CPU interpreter, applied only when ``TRITON_INTERPRET=1``.

Triton 3.6's interpreter stores bfloat16 as raw uint16 bits and hands those bits
straight to ``np.matmul`` in ``tl.dot``, so every bf16 dot returns garbage; and it
truncates fp32 -> bf16 casts where the GPU rounds to nearest even. The generated
kernels must stay the ones the GPU compiles, so the interpreter is mended instead:
bf16 dot operands are widened to fp32 (exact) and the cast rounds as the GPU does.
"""

from __future__ import annotations

import functools

__all__ = ["patch_interpreter"]


@functools.cache
def patch_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a = _widen(a)
            b = _widen(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    def _widen(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        data = (np.asarray(t.data, np.uint16).astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    original_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits(np.asarray(src.data, np.float32)), tl.bfloat16)
        return original_cast(self, src, dst_type)

    def _fp32_to_bf16_bits(x):
        # Round to nearest even on the bit pattern; the carry runs into the exponent
        # as it must (Triton's own converter drops it). NaN stays a quiet NaN.
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)

    interpreter.InterpreterBuilder.create_dot = create_dot
    interpreter.InterpreterBuilder.cast_impl = cast_impl
