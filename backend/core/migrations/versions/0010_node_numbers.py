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
    # Plain ALTERs and an index: nothing here rebuilds a table, which SQLite could not do for `node`
    # with foreign keys on (jobs, approvals and children point at it).
    op.add_column("study", sa.Column("nodes_numbered", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("node", sa.Column("number", sa.Integer(), nullable=False, server_default="0"))
    # Existing nodes are numbered in the order they were made, study by study. Texts written before
    # this revision (summaries, insights, the improvement state) keep the ids they were written with.
    op.execute(
        "UPDATE node SET number = r.n FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY study_id ORDER BY id) AS n "
        "FROM node) AS r WHERE node.id = r.id"
    )
    op.execute("UPDATE study SET nodes_numbered = (SELECT COUNT(*) FROM node WHERE node.study_id = study.id)")
    op.create_index("uq_node_study_number", "node", ["study_id", "number"], unique=True)


def downgrade() -> None:
    op.drop_index("uq_node_study_number", table_name="node")
    op.execute("ALTER TABLE node DROP COLUMN number")
    op.execute("ALTER TABLE study DROP COLUMN nodes_numbered")
