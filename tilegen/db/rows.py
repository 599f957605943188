"""Plain, frozen views of stored rows, detached from any session."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

__all__ = ["VariantRow", "TunedRow", "TrialRow"]


@dataclass(frozen=True)
class VariantRow:
    spec_hash: str
    template_hash: str
    family: str
    name: str
    spec_json: str


@dataclass(frozen=True)
class TunedRow:
    """A winning config; ``config`` is the knob dict (``Config.to_dict()``), ``created_at`` is UTC."""

    spec_hash: str
    template_hash: str
    family: str
    variant_name: str
    gpu_key: str
    bucket: int
    triton_version: str
    torch_version: str
    tilegen_version: str
    config: dict[str, Any]
    time_ms: float
    tflops: float | None
    gbps: float | None
    max_error: float
    trials: int
    created_at: datetime
    provenance: str = "tuned"  # or "imported"


@dataclass(frozen=True)
class TrialRow:
    """One trial's outcome; ``time_ms`` and ``max_error`` are ``None`` when it never ran to the end."""

    spec_hash: str
    template_hash: str
    family: str
    gpu_key: str
    bucket: int
    triton_version: str
    study_name: str
    trial_number: int
    config: dict[str, Any]
    status: str
    time_ms: float | None
    max_error: float | None
    reason: str | None
    created_at: datetime
    provenance: str = "tuned"  # or "imported"
