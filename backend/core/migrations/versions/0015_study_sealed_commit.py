"""study.sealed_commit: the repository's base commit, which alone holds the sealed files

A study's trunk starts from a copy of its base without the sealed files (no parent), so that the
history workers fetch holds no sealed byte; sealed jobs overlay the files from this commit.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05 09:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain ADD COLUMN (SQLite has one): a batch would copy the table, which rows of other tables name.
    op.add_column("study", sa.Column("sealed_commit", sa.String(), nullable=False, server_default=""))


def downgrade() -> None:
    op.drop_column("study", "sealed_commit")  # SQLite 3.35+ drops a column in place
