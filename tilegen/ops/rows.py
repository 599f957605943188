"""Pieces shared by the ops over ``[tokens, heads, head_dim]`` rows (``merge_states``, ``apply_rope``):
the device check, the dispatch table on a tensor's device, and writing through a view."""

from __future__ import annotations

import torch

from tilegen import dispatch
from tilegen.device import device_info
from tilegen.env import interpreting

__all__ = ["check_device", "table_on", "writable"]


def check_device(name: str, device: torch.device) -> None:
    """Raise, naming ``name``, unless tilegen's kernels can run on ``device`` in this process."""
    if device.type == "cpu" and not interpreting():
        raise ValueError(f"{name}: tensors are on the CPU; tilegen kernels run on CUDA, or on the CPU under "
                         "TRITON_INTERPRET=1")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {device} is not supported; expected cuda")


def table_on(spec, device: torch.device) -> dispatch.Table:
    """The spec's dispatch table for the GPU (or the interpreter) that ``device`` names."""
    return dispatch.table_for(spec, device_info(device.index if device.type == "cuda" else None))


def writable(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``t`` viewed as ``shape`` without a copy, or None when its strides do not allow one."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None
