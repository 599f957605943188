"""Tables of the tuning database, as SQLAlchemy 2 typed models.

Every table is prefixed ``tg_`` so that Optuna's own tables (``studies``, ``trials``,
...) can live in the same SQLite file without a clash. The schema is owned by the
Alembic revisions in ``tilegen/db/migrations``; a change here needs a new revision
there (``tests/test_db.py`` checks that the two agree).
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "Base", "Gpu", "Variant", "TunedConfig", "Trial", "PROVENANCES", "TRIAL_STATUSES", "VERSION_TABLE", "utcnow",
]

from tilegen.db.sqlite import VERSION_TABLE  # noqa: E402  (defined with the SQLAlchemy-free core)

#: Outcomes of one tuning trial: ran and matched the reference, ran with a wrong
#: result, failed to compile, crashed at run time, rejected before compiling, or too slow.
TRIAL_STATUSES = ("ok", "wrong", "compile_error", "fault", "infeasible", "timeout")

#: Where a tuned row or trial came from: measured by ``tilegen tune`` into this database, merged
#: in by ``tilegen db import``, or copied from a server by ``tilegen db pull`` (both measured
#: elsewhere; ``tilegen db verify`` re-runs such a row here).
PROVENANCES = ("tuned", "imported", "pulled")


def utcnow() -> datetime:
    """Naive UTC timestamp: SQLite keeps no zone, so every stored time is UTC by convention."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Gpu(Base):
    """A device identity; ``key`` is ``DeviceInfo.key`` (model and compute capability)."""

    __tablename__ = "tg_gpus"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    name: Mapped[str] = mapped_column(String(255))
    capability: Mapped[str] = mapped_column(String(16))  # "9.0"
    sm_count: Mapped[int] = mapped_column(Integer)
    # 64 bits: a GPU's memory passes 2**31 bytes. SQLite's INTEGER is 64 bits already, and
    # revision 0003 widens the column on other servers only.
    memory_bytes: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"))


class Variant(Base):
    """A spec rendered by one template version: a template edit makes a new variant."""

    __tablename__ = "tg_variants"
    __table_args__ = (UniqueConstraint("spec_hash", "template_hash", name="uq_tg_variants_spec_template"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(64))
    template_hash: Mapped[str] = mapped_column(String(64))
    family: Mapped[str] = mapped_column(String(64))
    # Kept so listings stay readable even when a later IR version cannot parse spec_json.
    name: Mapped[str] = mapped_column(String(255))
    spec_json: Mapped[str] = mapped_column(Text)  # canonical form, AttentionSpec.to_json()


class TunedConfig(Base):
    """The winning config of one variant on one GPU for one sequence-length bucket."""

    __tablename__ = "tg_tuned_configs"
    __table_args__ = (
        UniqueConstraint("variant_id", "gpu_id", "bucket", "triton_version", name="uq_tg_tuned_configs_key"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    variant_id: Mapped[int] = mapped_column(ForeignKey("tg_variants.id", ondelete="CASCADE"))
    gpu_id: Mapped[int] = mapped_column(ForeignKey("tg_gpus.id", ondelete="CASCADE"))
    bucket: Mapped[int] = mapped_column(Integer)
    triton_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    tilegen_version: Mapped[str] = mapped_column(String(64))
    config_json: Mapped[str] = mapped_column(Text)
    time_ms: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float | None] = mapped_column(Float)
    gbps: Mapped[float | None] = mapped_column(Float)
    max_error: Mapped[float] = mapped_column(Float)
    trials: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    provenance: Mapped[str] = mapped_column(String(16), server_default="tuned")


class Trial(Base):
    """One tuning trial's outcome, kept so a later reader can see why a config won."""

    __tablename__ = "tg_trials"
    __table_args__ = (
        UniqueConstraint("study_name", "trial_number", name="uq_tg_trials_study_number"),
        CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in TRIAL_STATUSES) + ")", name="ck_tg_trials_status"
        ),
        Index("ix_tg_trials_variant", "variant_id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    variant_id: Mapped[int] = mapped_column(ForeignKey("tg_variants.id", ondelete="CASCADE"))
    gpu_id: Mapped[int] = mapped_column(ForeignKey("tg_gpus.id", ondelete="CASCADE"))
    bucket: Mapped[int] = mapped_column(Integer)
    triton_version: Mapped[str] = mapped_column(String(64))
    study_name: Mapped[str] = mapped_column(String(255))
    trial_number: Mapped[int] = mapped_column(Integer)
    config_json: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    time_ms: Mapped[float | None] = mapped_column(Float)
    max_error: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    provenance: Mapped[str] = mapped_column(String(16), server_default="tuned")
