"""The dtype map, defined once: spec names <-> torch dtypes."""

from __future__ import annotations

import torch

__all__ = ["TORCH_DTYPES", "SPEC_DTYPES", "KV_DTYPES", "SPEC_KV_DTYPES", "FP8_MAX", "TRITON_KV_DTYPES"]

#: Spec dtype name -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
#: torch dtype -> spec dtype name.
SPEC_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

#: Quantized KV page dtypes (a spec's ``kv_dtype``) -> torch dtype: FP8 as vLLM, FlashInfer and
#: FlashAttention-3 store it, dequantized as value * scale.
KV_DTYPES: dict[str, torch.dtype] = {"fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}
#: torch dtype -> ``kv_dtype`` name.
SPEC_KV_DTYPES: dict[torch.dtype, str] = {v: k for k, v in KV_DTYPES.items()}
#: The largest finite value of each FP8 format: quantizing saturates there.
FP8_MAX: dict[str, float] = {"fp8e4m3": 448.0, "fp8e5m2": 57344.0}
#: ``kv_dtype`` name -> the name of Triton's type (``tl.float8e4nv`` is e4m3fn, ``tl.float8e5`` e5m2).
TRITON_KV_DTYPES: dict[str, str] = {"fp8e4m3": "tl.float8e4nv", "fp8e5m2": "tl.float8e5"}
