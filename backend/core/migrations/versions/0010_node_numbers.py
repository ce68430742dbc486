"""node.number: a node's place in its study (n1 is each study's root); study.nodes_numbered counts them

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 09:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("study") as batch:
        batch.add_column(sa.Column("nodes_numbered", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("node") as batch:
        batch.add_column(sa.Column("number", sa.Integer(), nullable=False, server_default="0"))
    # Existing nodes are numbered in the order they were made, study by study.
    op.execute(
        "UPDATE node SET number = (SELECT COUNT(*) FROM node AS o WHERE o.study_id = node.study_id AND o.id <= node.id)"
    )
    op.execute("UPDATE study SET nodes_numbered = (SELECT COUNT(*) FROM node WHERE node.study_id = study.id)")
    with op.batch_alter_table("node") as batch:
        batch.create_unique_constraint("uq_node_study_number", ["study_id", "number"])


def downgrade() -> None:
    with op.batch_alter_table("node") as batch:
        batch.drop_constraint("uq_node_study_number", type_="unique")
        batch.drop_column("number")
    with op.batch_alter_table("study") as batch:
        batch.drop_column("nodes_numbered")
