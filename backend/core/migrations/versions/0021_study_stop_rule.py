"""study.stop_rule: the rule that ended a study, or the step a failed one failed on, as a field

Studies that ended before this revision take the rule or step their `stop_reason` named (the
words the dashboard matched to say what fixes a failure).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07 23:55:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# How each rule's `stop_reason` began before this revision.
WORDS = {"experiments": "experiment budget spent%", "time": "time budget spent%", "plateau": "plateau:%",
         "frontier": "frontier exhausted%", "ideation": "ideation failed:%", "user": "stopped by user"}  # fmt: skip
FAILED = {"baseline_dev": "%dev evaluation fails on the unchanged repository%",
          "baseline_test": "%sealed test evaluation fails%", "setup": "%environment setup%", "clone": "%clone%"}  # fmt: skip


def upgrade() -> None:
    op.add_column("study", sa.Column("stop_rule", sa.String(), nullable=False, server_default=""))
    study = sa.table("study", sa.column("status", sa.String()), sa.column("stop_reason", sa.Text()),
                     sa.column("stop_rule", sa.String()))  # fmt: skip
    for status, rules in (("finished", WORDS), ("failed", FAILED)):
        for rule, words in rules.items():
            op.execute(
                study.update()
                .where(study.c.status == status, study.c.stop_rule == "", study.c.stop_reason.like(words))
                .values(stop_rule=rule)
            )


def downgrade() -> None:
    op.drop_column("study", "stop_rule")  # SQLite 3.35+ drops a column in place
