"""Approvals of gate-passed nodes: the one module that writes an approval's row.

An approval opens when a node passes the held-out gate in approve mode (`open_for`), takes a human
decision (`decide_approval`), or is withdrawn without one; it closes when the gatekeeper has acted
on the decision (`close_approved`, `close_rejected`). Its states and their moves are
`backend.core.states.ApprovalStatus` and `APPROVAL_TRANSITIONS`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from backend.core.models import Approval, now
from backend.core.states import APPROVAL_SAID_YES, ApprovalStatus, may_become


def _open(node_id: int) -> Any:
    """Return an UPDATE of the node's approval that applies only while it is pending and undecided."""
    return update(Approval).where(
        col(Approval.node_id) == node_id,
        col(Approval.status) == ApprovalStatus.PENDING,
        col(Approval.decided_by) == "",
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
    status = ApprovalStatus.APPROVING if approved else ApprovalStatus.REJECTING
    return _won(s, _open(node_id).values(decided_by=by, reason=reason, status=status))


def withdraw_approval(s: Session, node_id: int, reason: str) -> bool:
    """Close a pending, undecided approval without a decision; return False if a decision came first."""
    return _won(s, _open(node_id).values(status=ApprovalStatus.WITHDRAWN, reason=reason, decided_at=now()))


def answer_of(s: Session, node_id: int) -> dict[str, Any] | None:
    """Return the human decision recorded on a node's approval, or None while it is open."""
    appr = s.exec(select(Approval).where(Approval.node_id == node_id)).first()
    if appr is None or not appr.decided_by:
        return None
    return {
        "approved": appr.status in APPROVAL_SAID_YES,
        "by": appr.decided_by,
        "reason": appr.reason,
    }


def open_for(s: Session, study_id: int, node_id: int) -> bool:
    """Open the approval of a node that passed the gate; return False if it has one already."""
    if s.exec(select(Approval).where(Approval.node_id == node_id)).first() is not None:
        return False
    s.add(Approval(study_id=study_id, node_id=node_id))
    return True


def close_approved(s: Session, node_id: int, by: str) -> None:
    """Close a node's approval once its change is merged (a merge in auto mode closes an open one too)."""
    appr = s.exec(select(Approval).where(Approval.node_id == node_id)).first()
    if appr is not None and may_become(appr.status, ApprovalStatus.APPROVED):
        appr.status, appr.decided_by, appr.decided_at = ApprovalStatus.APPROVED, appr.decided_by or by, now()
        s.add(appr)


def close_rejected(s: Session, node_id: int, by: str, reason: str) -> None:
    """Close a node's approval once the node is rejected."""
    appr = s.exec(select(Approval).where(Approval.node_id == node_id)).first()
    if appr is not None and may_become(appr.status, ApprovalStatus.REJECTED):
        appr.status, appr.decided_at = ApprovalStatus.REJECTED, now()
        appr.decided_by, appr.reason = appr.decided_by or by, appr.reason or reason
        s.add(appr)
