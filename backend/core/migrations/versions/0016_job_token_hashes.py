"""job.task_id, and jobs' and learning jobs' tokens kept as their SHA-256 only

A job's task id was its token; now the task id (not a secret) has a column of its own, to revoke
the task by, and the token column holds the SHA-256 (hex) of the token a worker presents. Existing
tokens are hashed, so that a job running across the upgrade still accepts its worker. Its task id
is left empty rather than kept: it was the token itself (such a task is not revoked, only refused).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05 11:00:00
"""

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _hash_tokens(table: str) -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.text(f"SELECT id, token FROM {table} WHERE token != ''")).all()
    for row_id, token in rows:
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        conn.execute(sa.text(f"UPDATE {table} SET token = :t WHERE id = :i"), {"t": digest, "i": row_id})


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":  # freed space (old tokens' bytes) is zeroed
        op.execute("PRAGMA secure_delete = ON")
    # A plain ADD COLUMN (SQLite has one): a batch would copy the table, which rows of other tables name.
    op.add_column("job", sa.Column("task_id", sa.String(), nullable=False, server_default=""))
    _hash_tokens("job")
    _hash_tokens("learning_job")


def downgrade() -> None:
    # A hash cannot be turned back into its token: a job in flight then refuses its worker, and the
    # older reconciler sends it again under a new token (one that does not start with its task prefix).
    with op.batch_alter_table("job") as batch:
        batch.drop_column("task_id")
