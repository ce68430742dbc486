"""learning_job: the token a worker claims it with, and the machine that ran it (which holds its artifact)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("learning_job") as batch:
        batch.add_column(sa.Column("token", sa.String(), nullable=False, server_default=""))
        batch.add_column(sa.Column("host", sa.String(), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("learning_job") as batch:
        batch.drop_column("host")
        batch.drop_column("token")
