"""GPU memory in 64 bits: an H200's 141 GiB overflows PostgreSQL's 32-bit integer.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # SQLite's INTEGER already holds 64 bits; rebuilding its table would change nothing.
    if op.get_bind().dialect.name != "sqlite":
        op.alter_column("tg_gpus", "memory_bytes", type_=sa.BigInteger(), existing_type=sa.Integer(),
                        existing_nullable=False)


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.alter_column("tg_gpus", "memory_bytes", type_=sa.Integer(), existing_type=sa.BigInteger(),
                        existing_nullable=False)
