"""Executor trajectories as distillation records: the prompt, the rollout and its textual feedback."""

from __future__ import annotations

from typing import Any

from sqlmodel import col, select

from agents.tree.status import NodeStatus
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Node, Trajectory


def export_records(settings: Settings, study_id: int) -> list[dict[str, Any]]:
    """Return one record per executor attempt, oldest first."""
    out = []
    with db.session(settings.db_url) as s:
        for t in s.exec(
            select(Trajectory).where(Trajectory.study_id == study_id).order_by(col(Trajectory.id))
        ):
            node = s.get(Node, t.node_id)
            job = s.get(Job, t.job_id)
            assert node is not None and job is not None
            outcome = job.outcome.get("status", job.status)
            result = f"outcome: {outcome}"
            if node.dev_values and outcome == NodeStatus.EVALUATED:
                result += f"; dev mean {node.dev_mean:.6g} over {node.dev_n} runs"
            if job.outcome.get("detail") or job.outcome.get("reason"):
                result += f"; {job.outcome.get('detail') or job.outcome['reason']}"
            out.append(
                {
                    "study_id": study_id,
                    "node_id": t.node_id,
                    "attempt": t.attempt,
                    "hypothesis": {"title": node.title, **node.hypothesis},
                    "prompt": t.messages[:2],
                    "rollout": t.messages[2:],
                    "report": t.report,
                    "feedback": "\n".join([*t.feedback, result]),
                    "outcome": outcome,
                }
            )
    return out
