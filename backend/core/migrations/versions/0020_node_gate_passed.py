"""node.gate_passed: the gate's verdict as a flag, not read back from its reason

Nodes gated before this revision take the verdict their reason recorded (it began "passed").

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07 23:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain ADD COLUMN (SQLite has one): a batch would copy the table, which rows of other tables name.
    op.add_column("node", sa.Column("gate_passed", sa.Boolean(), nullable=False, server_default=sa.false()))
    node = sa.table("node", sa.column("gated", sa.Boolean()), sa.column("gate_reason", sa.String()),
                    sa.column("gate_passed", sa.Boolean()))  # fmt: skip
    op.execute(
        node.update()
        .where(node.c.gated == sa.true(), node.c.gate_reason.like("passed%"))
        .values(gate_passed=sa.true())
    )


def downgrade() -> None:
    op.drop_column("node", "gate_passed")  # SQLite 3.35+ drops a column in place
