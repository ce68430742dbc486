"""Indexes for reading what changed in a study since a time: nodes by updated_at, the rest by created_at

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 01:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = (
    ("ix_node_study_updated", "node", "updated_at"),
    ("ix_job_study_created", "job", "created_at"),
    ("ix_receipt_study_created", "receipt", "created_at"),
    ("ix_insightversion_study_created", "insightversion", "created_at"),
    ("ix_trajectory_study_created", "trajectory", "created_at"),
)


def upgrade() -> None:
    for name, table, column in INDEXES:
        op.create_index(name, table, ["study_id", column])


def downgrade() -> None:
    for name, table, _ in INDEXES:
        op.drop_index(name, table_name=table)
