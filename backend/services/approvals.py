"""Human decisions on gate-passed nodes: the one module that records an approval or a rejection."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from backend.core.models import Approval, now
from backend.core.states import ApprovalStatus


def _open(node_id: int) -> Any:
    """Return an UPDATE of the node's approval that applies only while it is pending and undecided."""
    return update(Approval).where(
        col(Approval.node_id) == node_id, col(Approval.status) == "pending", col(Approval.decided_by) == ""
    )


def _won(s: Session, statement: Any) -> bool:
    """Run a conditional update; return whether it changed the row (it won any race)."""
    result = s.execute(statement)
    s.expire_all()  # rows loaded before the update read it afresh
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def decide_approval(s: Session, node_id: int, *, approved: bool, by: str, reason: str = "") -> bool:
    """Record a human decision on a pending approval; return False if it was already decided (or withdrawn).

    One conditional update: of two decisions racing (or a decision and a withdrawal), one wins.
    """
    status = "approving" if approved else "rejecting"
    return _won(s, _open(node_id).values(decided_by=by, reason=reason, status=status))


def withdraw_approval(s: Session, node_id: int, reason: str) -> bool:
    """Close a pending, undecided approval without a decision; return False if a decision came first."""
    return _won(s, _open(node_id).values(status="withdrawn", reason=reason, decided_at=now()))


def answer_of(s: Session, node_id: int) -> dict[str, Any] | None:
    """Return the human decision recorded on a node's approval, or None while it is open."""
    appr = s.exec(select(Approval).where(Approval.node_id == node_id)).first()
    if appr is None or not appr.decided_by:
        return None
    return {
        "approved": appr.status in (ApprovalStatus.APPROVING, ApprovalStatus.APPROVED),
        "by": appr.decided_by,
        "reason": appr.reason,
    }
