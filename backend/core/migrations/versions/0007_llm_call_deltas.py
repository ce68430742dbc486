"""llm_call.base_id, base_len: a call stores only the messages its conversation's previous call did not

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("llm_call") as batch:
        batch.add_column(sa.Column("base_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("base_len", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("llm_call") as batch:
        batch.drop_column("base_len")
        batch.drop_column("base_id")
