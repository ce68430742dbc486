"""node.status_reason, status_by: why and by whom a node last changed status (its fate's words)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 04:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node") as batch:
        batch.add_column(sa.Column("status_reason", sa.Text(), nullable=False, server_default=""))
        batch.add_column(sa.Column("status_by", sa.String(), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("node") as batch:
        batch.drop_column("status_by")
        batch.drop_column("status_reason")
