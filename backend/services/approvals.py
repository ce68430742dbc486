"""Human decisions on gate-passed nodes: the one module that records an approval or a rejection."""

from __future__ import annotations

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
