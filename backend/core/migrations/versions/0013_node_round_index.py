"""node: an index on (study_id, round_no), so an ideation round's insert does not scan the study

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01 23:55:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_node_study_round", "node", ["study_id", "round_no"])


def downgrade() -> None:
    op.drop_index("ix_node_study_round", table_name="node")
