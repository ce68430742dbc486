"""trunk_claim: which job runs trunk's extra dev seeds on a commit, so siblings do not run them again

Two sibling experiments whose gains are unclear at the same moment both need trunk's next seeds:
the first to claim (study, commit, upto) runs them; the other waits for the values.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06 03:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "trunk_claim",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("commit", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("upto", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["study_id"], ["study.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("study_id", "commit", "upto"),
    )
    op.create_index("ix_trunk_claim_study_id", "trunk_claim", ["study_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_trunk_claim_study_id", table_name="trunk_claim")
    op.drop_table("trunk_claim")
