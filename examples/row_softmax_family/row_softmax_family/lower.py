"""The row-softmax family's lowering: everything the template does not decide itself."""

from __future__ import annotations

from row_softmax_family.spec import RowSoftmaxSpec


def lower(spec: RowSoftmaxSpec) -> dict:
    return {"kernel_name": f"_{spec.name}_kernel", "log": spec.log}
