"""study.dev_deterministic: the dev evaluation gives the same values on every seed

A study whose unchanged repository gave identical dev values (objective and constraint metrics)
on every seed runs each node on one seed: more seeds would only repeat the same number.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06 05:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain ADD COLUMN (SQLite has one): a batch would copy the table, which rows of other tables name.
    op.add_column(
        "study", sa.Column("dev_deterministic", sa.Boolean(), nullable=False, server_default=sa.false())
    )


def downgrade() -> None:
    op.drop_column("study", "dev_deterministic")  # SQLite 3.35+ drops a column in place
