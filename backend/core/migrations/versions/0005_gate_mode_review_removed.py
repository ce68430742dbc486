"""gate mode 'review' removed: stored specs that named it read 'approve', which is what they did

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 18:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import tomlkit
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, spec_toml FROM study WHERE spec_toml LIKE '%review%'")).all()
    for study_id, text in rows:
        try:
            doc = tomlkit.parse(text)
        except Exception:  # a spec that never parsed stays as it was
            continue
        gate = doc.get("gate")
        if isinstance(gate, dict) and gate.get("mode") == "review":
            gate["mode"] = "approve"
            conn.execute(
                sa.text("UPDATE study SET spec_toml = :t WHERE id = :i"),
                {"t": tomlkit.dumps(doc), "i": study_id},
            )


def downgrade() -> None:
    pass  # 'approve' is what those studies did all along
