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
    with op.batch_alter_table("study") as batch:
        batch.add_column(sa.Column("sealed_commit", sa.String(), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("study") as batch:
        batch.drop_column("sealed_commit")
