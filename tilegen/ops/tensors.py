"""What several ops do with the tensors they are handed: check that the kernels can run on
their device, and write through a view of them."""

from __future__ import annotations

import torch

from tilegen.env import interpreting

__all__ = ["check_device", "writable"]


def check_device(name: str, device: torch.device) -> None:
    """Raise, naming ``name``, unless tilegen's kernels can run on ``device`` in this process."""
    if device.type == "cpu" and not interpreting():
        raise ValueError(f"{name}: tensors are on the CPU; tilegen kernels run on CUDA, or on the CPU under "
                         "TRITON_INTERPRET=1")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {device} is not supported; expected cuda")


def writable(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``t`` viewed as ``shape`` without a copy, or None when its strides do not allow one."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None
