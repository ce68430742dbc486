"""Human decisions on gate-passed nodes: the one module that records an approval or a rejection."""

from __future__ import annotations

from typing import Any

from sqlmodel import Session, select

from backend.core.models import Approval


def decide_approval(s: Session, node_id: int, *, approved: bool, by: str, reason: str = "") -> bool:
    """Record a human decision on a pending approval; return False if it was already decided."""
    appr = s.exec(select(Approval).where(Approval.node_id == node_id)).first()
    if appr is None or appr.status != "pending" or appr.decided_by:
        return False
    appr.decided_by, appr.reason = by, reason
    appr.status = "approving" if approved else "rejecting"
    s.add(appr)
    return True


def answer_of(s: Session, node_id: int) -> dict[str, Any] | None:
    """Return the human decision recorded on a node's approval, or None while it is open."""
    appr = s.exec(select(Approval).where(Approval.node_id == node_id)).first()
    if appr is None or not appr.decided_by:
        return None
    return {
        "approved": appr.status in ("approving", "approved"),
        "by": appr.decided_by,
        "reason": appr.reason,
    }
