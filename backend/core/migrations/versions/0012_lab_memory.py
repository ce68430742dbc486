"""memory_entry: what finished studies learned, keyed by repository and objective; study.repository_key

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01 13:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("study", sa.Column("repository_key", sa.String(), nullable=False, server_default=""))
    op.create_table(
        "memory_entry",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("repository", sa.String(), nullable=False),
        sa.Column("objective", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False, server_default=""),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=True),
        sa.Column("study_name", sa.String(), nullable=False, server_default=""),
        sa.Column("node_numbers", sa.JSON(), nullable=False),
        sa.Column("dev_effect", sa.Float(), nullable=True),
        sa.Column("diff", sa.String(), nullable=False, server_default=""),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    )
    op.create_index("ix_memory_entry_repository", "memory_entry", ["repository"])
    op.create_index("ix_memory_entry_name", "memory_entry", ["name"])


def downgrade() -> None:
    op.drop_index("ix_memory_entry_name", table_name="memory_entry")
    op.drop_index("ix_memory_entry_repository", table_name="memory_entry")
    op.drop_table("memory_entry")
    op.execute("ALTER TABLE study DROP COLUMN repository_key")  # a plain ALTER: no rebuild of `study`
