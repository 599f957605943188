"""The family's op, dispatched like tilegen's own: tuned table in memory, plan per call signature,
the launcher's replay (``tilegen.dispatch.planned``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from row_softmax_family.spec import RowSoftmaxSpec
from tilegen import dispatch
from tilegen.device import device_info
from tilegen.dtypes import SPEC_DTYPES
from tilegen.ops.tensors import check_device

_plans = dispatch.plan_cache()


@dataclass(frozen=True)
class _Plan:
    launch: Callable[..., None]  # launch(key, x, out)


def row_softmax(x: torch.Tensor, *, log: bool = False) -> torch.Tensor:
    key = (x.shape, x.dtype, x.device, log)
    plan = _plans.get(key)
    if plan is None:
        if x.dim() != 2 or x.dtype not in SPEC_DTYPES or x.stride(-1) != 1:
            raise ValueError(f"x: expected a [rows, cols] float tensor with unit-stride rows, got {tuple(x.shape)}")
        check_device("x", x.device)  # a CPU tensor on a GPU host: named here, not Triton's pointer error
        spec = RowSoftmaxSpec(dtype=SPEC_DTYPES[x.dtype], log=log)
        launcher = dispatch.launcher_for(spec)
        plan = dispatch.planned(dispatch.table_for(spec, device_info()), x.shape[1],
                                lambda choice: _Plan(launcher.replay(choice.config.to_dict())))
        _plans.put(key, plan)
    out = torch.empty_like(x)
    # The plan fixes the shapes the launcher reads; the strides complete the key its launches replay under.
    plan.launch((x.stride(), out.stride()), x, out)
    return out
