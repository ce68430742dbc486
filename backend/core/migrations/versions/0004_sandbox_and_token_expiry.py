"""sandbox mode on studies, token expiry

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 14:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("study") as batch:
        batch.add_column(
            # Studies from before the sandbox ran unboxed, as far as anyone can tell.
            sa.Column("sandbox", sqlmodel.sql.sqltypes.AutoString(), nullable=False, server_default="unknown")
        )
    with op.batch_alter_table("api_token") as batch:
        batch.add_column(sa.Column("expires_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_token") as batch:
        batch.drop_column("expires_at")
    with op.batch_alter_table("study") as batch:
        batch.drop_column("sandbox")
