"""llm_hold: the worst-case cost of each model call in flight, held against the study's budget

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 13:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "llm_hold",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("study_id", sa.Integer(), sa.ForeignKey("study.id"), nullable=False),
        sa.Column("usd", sa.Float(), nullable=False, server_default="0"),
        sa.Column("tokens", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    )
    op.create_index("ix_llm_hold_study_id", "llm_hold", ["study_id"])


def downgrade() -> None:
    op.drop_index("ix_llm_hold_study_id", table_name="llm_hold")
    op.drop_table("llm_hold")
