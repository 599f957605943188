"""The dtype map, defined once: spec names <-> torch dtypes."""

from __future__ import annotations

import torch

__all__ = ["TORCH_DTYPES", "SPEC_DTYPES"]

#: Spec dtype name -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
#: torch dtype -> spec dtype name.
SPEC_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
