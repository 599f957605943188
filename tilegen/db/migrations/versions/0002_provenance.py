"""Provenance: whether a tuned row or trial was measured here or came in through an import.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TABLES = ("tg_tuned_configs", "tg_trials")


def upgrade() -> None:
    # Rows stored before this revision were all written by tilegen tune or by an import that
    # did not say so; "tuned" is the only value the old schema could have meant.
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("provenance", sa.String(16), nullable=False, server_default="tuned"))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("provenance")
