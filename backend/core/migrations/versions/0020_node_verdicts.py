"""node.gate_passed, node.blame, node.lesson: the gate's verdict, a failure's meaning, a pruned lesson

All three were read back out of sentences: a pass from a gate reason that began "passed", a
failure that is no evidence against its idea from the exception name its reason began with, and
the top of a pruned branch from an insight that began "PRUNED (". Rows written before this
revision take what their sentences said.

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

# The exceptions whose names began a failure that said nothing about its idea (before `agents.failures`).
MACHINERY = ("AnswerFormatError", "ModelError", "ContextTooLong", "ToolsUnsupported", "SandboxUnavailable",
             "GitError", "OSError", "PermissionError", "FileNotFoundError", "ConnectionError", "TimeoutError")  # fmt: skip


def upgrade() -> None:
    # Plain ADD COLUMNs (SQLite has them): a batch would copy the table, which rows of other tables name.
    op.add_column("node", sa.Column("gate_passed", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.add_column("node", sa.Column("blame", sa.String(), nullable=False, server_default="idea"))
    op.add_column("node", sa.Column("lesson", sa.Text(), nullable=False, server_default=""))
    node = sa.table("node", sa.column("gated", sa.Boolean()), sa.column("gate_reason", sa.String()),
                    sa.column("gate_passed", sa.Boolean()), sa.column("failure", sa.Text()),
                    sa.column("blame", sa.String()))  # fmt: skip
    op.execute(
        node.update()
        .where(node.c.gated == sa.true(), node.c.gate_reason.like("passed%"))
        .values(gate_passed=sa.true())
    )
    spent = node.c.failure.like("BudgetExhausted:%")
    op.execute(node.update().where(spent).values(blame="tokens"))
    op.execute(
        node.update()
        .where(spent, node.c.failure.like("BudgetExhausted: LLM budget spent: $%"))
        .values(blame="usd")
    )
    machinery = sa.or_(*(node.c.failure.like(f"{name}:%") for name in MACHINERY))
    op.execute(node.update().where(machinery).values(blame="machinery"))
    # A pruned branch's top: a pruned node whose insight (its latest version) is its lesson.
    insight = sa.table("insightversion", sa.column("node_id", sa.Integer()), sa.column("version", sa.Integer()),
                       sa.column("text", sa.Text()))  # fmt: skip
    status = sa.table("node", sa.column("id", sa.Integer()), sa.column("status", sa.String()))
    latest = (
        sa.select(insight.c.text)
        .where(insight.c.node_id == status.c.id)
        .order_by(insight.c.version.desc())
        .limit(1)
        .scalar_subquery()
    )
    tops = sa.select(status.c.id, latest.label("text")).where(status.c.status == "pruned")
    conn = op.get_bind()
    for node_id, text in conn.execute(tops).all():
        if text and text.startswith("PRUNED ("):
            conn.execute(
                sa.text("UPDATE node SET lesson = :text WHERE id = :id"), {"text": text, "id": node_id}
            )


def downgrade() -> None:
    op.drop_column("node", "lesson")  # SQLite 3.35+ drops a column in place
    op.drop_column("node", "blame")
    op.drop_column("node", "gate_passed")
