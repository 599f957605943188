"""The float64 reference of the row-softmax family."""

from __future__ import annotations

import torch


def softmax_reference(x: torch.Tensor, *, log: bool) -> torch.Tensor:
    x64 = x.to(torch.float64)
    return torch.log_softmax(x64, dim=-1) if log else torch.softmax(x64, dim=-1)
