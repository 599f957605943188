"""The tuning key, defined once: what a tuned config is valid for.

A tuned config holds for one spec on one GPU model, rendered from one template (with
every piece it includes) by one Triton, at one bucket of its family. Any of these
changing could change the best config, so each is part of the key: the Optuna study is
named after it and the database files its rows under it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton

from tilegen.codegen.render import template_hash
from tilegen.device import DeviceInfo
from tilegen.families import family_of
from tilegen.ir import Spec

__all__ = ["TuningKey"]


@dataclass(frozen=True)
class TuningKey:
    """Tuning writes rows under a key; dispatch reads a variant's rows (``bucket=None``) under it."""

    spec: Spec
    device: DeviceInfo
    template_hash: str
    triton_version: str
    bucket: int | None = None

    @classmethod
    def current(cls, spec: Spec, device: DeviceInfo, bucket: int | None = None) -> TuningKey:
        """The key under this process's template and Triton."""
        return cls(spec, device, template_hash(family_of(spec)), triton.__version__, bucket)

    @property
    def study_name(self) -> str:
        """Readable and unique: the spec spelled out plus its hash, then the rest of the key."""
        return (
            f"{self.spec.name}-{self.spec.hash}-{self.device.key}"
            f"-tpl{self.template_hash}-triton{self.triton_version}-n{self.bucket}"
        )

    def variant_fields(self) -> dict[str, Any]:
        """The key without the bucket: the arguments of ``TuningDB.best``."""
        return {
            "spec": self.spec,
            "device": self.device,
            "template_hash": self.template_hash,
            "triton_version": self.triton_version,
        }

    def fields(self) -> dict[str, Any]:
        """The whole key: the leading arguments of ``TuningDB.record_trial`` and ``record_best``."""
        return {**self.variant_fields(), "bucket": self.bucket}
