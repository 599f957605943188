"""Initial schema: GPUs, variants, tuned configs and trials.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tg_gpus",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("capability", sa.String(16), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("memory_bytes", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key"),
    )
    op.create_table(
        "tg_variants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("template_hash", sa.String(64), nullable=False),
        sa.Column("family", sa.String(64), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("spec_hash", "template_hash", name="uq_tg_variants_spec_template"),
    )
    op.create_table(
        "tg_tuned_configs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("variant_id", sa.Integer(), nullable=False),
        sa.Column("gpu_id", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("torch_version", sa.String(64), nullable=False),
        sa.Column("tilegen_version", sa.String(64), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("time_ms", sa.Float(), nullable=False),
        sa.Column("tflops", sa.Float(), nullable=True),
        sa.Column("gbps", sa.Float(), nullable=True),
        sa.Column("max_error", sa.Float(), nullable=False),
        sa.Column("trials", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["variant_id"], ["tg_variants.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["gpu_id"], ["tg_gpus.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("variant_id", "gpu_id", "bucket", "triton_version", name="uq_tg_tuned_configs_key"),
    )
    op.create_table(
        "tg_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("variant_id", sa.Integer(), nullable=False),
        sa.Column("gpu_id", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("study_name", sa.String(255), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("time_ms", sa.Float(), nullable=True),
        sa.Column("max_error", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint(
            "status IN ('ok', 'wrong', 'compile_error', 'fault', 'infeasible', 'timeout')",
            name="ck_tg_trials_status",
        ),
        sa.ForeignKeyConstraint(["variant_id"], ["tg_variants.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["gpu_id"], ["tg_gpus.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("study_name", "trial_number", name="uq_tg_trials_study_number"),
    )
    op.create_index("ix_tg_trials_variant", "tg_trials", ["variant_id"])


def downgrade() -> None:
    op.drop_index("ix_tg_trials_variant", table_name="tg_trials")
    for table in ("tg_trials", "tg_tuned_configs", "tg_variants", "tg_gpus"):
        op.drop_table(table)
