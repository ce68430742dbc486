"""node.heldout_lcb and node.heldout_level: the gate's lower bound as numbers, not words

The dashboard read the bound and its confidence back out of the gate's reason; nodes gated before
this revision take the numbers their reason printed.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-08 00:05:00
"""

import re
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# How `agents.tree.gate.heldout_decision` worded the bound before this revision.
SAID = re.compile(r"([\d.]+)% lower bound ([+\-\u2212]?[\d.]+(?:e[+\-]?\d+)?)")


def upgrade() -> None:
    op.add_column("node", sa.Column("heldout_lcb", sa.Float(), nullable=True))
    op.add_column("node", sa.Column("heldout_level", sa.Float(), nullable=True))
    node = sa.table("node", sa.column("id", sa.Integer()), sa.column("gated", sa.Boolean()),
                    sa.column("gate_reason", sa.String()), sa.column("heldout_lcb", sa.Float()),
                    sa.column("heldout_level", sa.Float()))  # fmt: skip
    conn = op.get_bind()
    gated = conn.execute(sa.select(node.c.id, node.c.gate_reason).where(node.c.gated == sa.true())).all()
    for node_id, reason in gated:
        m = SAID.search(reason or "")
        if m:
            lcb, level = float(m.group(2).replace("\u2212", "-")), float(m.group(1)) / 100
            conn.execute(
                node.update().where(node.c.id == node_id).values(heldout_lcb=lcb, heldout_level=level)
            )


def downgrade() -> None:
    op.drop_column("node", "heldout_level")  # SQLite 3.35+ drops a column in place
    op.drop_column("node", "heldout_lcb")
