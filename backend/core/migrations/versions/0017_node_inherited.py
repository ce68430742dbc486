"""node.inherited: what a child starts from besides trunk (its parent's change), and what its executor is told

A child of a node whose change is not in trunk starts from the merge of trunk and its parent's
commit (the `llm` policy's nodes build on their parent's code): the column keeps that start
commit, the parent's number, title, diff and measured effect, and a conflict with trunk if there
was one. Empty for nodes that start from trunk.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05 13:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain ADD COLUMN (SQLite has one): a batch would copy the table, which rows of other tables name.
    op.add_column("node", sa.Column("inherited", sa.JSON(), nullable=False, server_default="{}"))


def downgrade() -> None:
    op.drop_column("node", "inherited")  # SQLite 3.35+ drops a column in place
