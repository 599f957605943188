"""The family's op, dispatched like tilegen's own: tuned table in memory, plan per call signature."""

from __future__ import annotations

import torch

from row_softmax_family.spec import RowSoftmaxSpec
from tilegen import dispatch
from tilegen.device import device_info
from tilegen.dtypes import SPEC_DTYPES

_plans = dispatch.plan_cache()


def row_softmax(x: torch.Tensor, *, log: bool = False) -> torch.Tensor:
    key = (x.shape, x.dtype, x.device, log)
    plan = _plans.get(key)
    if plan is None:
        if x.dim() != 2 or x.dtype not in SPEC_DTYPES or x.stride(-1) != 1:
            raise ValueError(f"x: expected a [rows, cols] float tensor with unit-stride rows, got {tuple(x.shape)}")
        table = dispatch.table_for(RowSoftmaxSpec(dtype=SPEC_DTYPES[x.dtype], log=log), device_info())
        plan = (table.launch, table.choose(x.shape[1]).config.to_dict())
        _plans.put(key, plan)
    launch, config = plan
    return launch(x, torch.empty_like(x), **config)
