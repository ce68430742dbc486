"""job.extra_runs: adaptive repeats charged to the experiment budget

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 19:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("extra_runs", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("extra_runs")
