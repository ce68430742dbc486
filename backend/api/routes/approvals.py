"""Approvals: list gate-passed nodes waiting for a human; approve or reject them."""

from __future__ import annotations

from typing import Annotated

from celery import Celery
from fastapi import APIRouter, HTTPException, Query, status
from sqlmodel import Session, col, select

from backend.api import schemas, serializers
from backend.api.deps import MAX_ID, Approver, CeleryDep, NodeId, Reader, SessionDep, StudyId
from backend.api.routes.tree import get_node
from backend.core.models import Approval
from backend.services.approvals import decide_approval
from backend.worker.dispatch import nudge

router = APIRouter(tags=["approvals"])


@router.get("/approvals", response_model=schemas.Page[schemas.ApprovalPublic])
def pending(
    s: SessionDep,
    who: Reader,
    study_id: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None,
    state: Annotated[str, Query(pattern="^(pending|approved|rejected|all)$")] = "pending",
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
) -> schemas.Page[schemas.ApprovalPublic]:
    """List approvals (pending by default), oldest first."""
    q = select(Approval)
    if study_id is not None:
        q = q.where(Approval.study_id == study_id)
    if state != "all":
        q = q.where(Approval.status == state)
    rows = list(s.exec(q.order_by(col(Approval.id))))
    return schemas.Page(
        data=[serializers.approval_public(s, a) for a in rows[offset : offset + limit]], count=len(rows)
    )


def _decide(
    study_id: int,
    node_id: int,
    approved: bool,
    reason: str,
    s: Session,
    celery: Celery,
    by: str,
) -> schemas.ApprovalPublic:
    node = get_node(s, study_id, node_id)
    appr = s.exec(select(Approval).where(Approval.node_id == node_id)).first()
    if appr is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"n{node.number} has no approval")
    if not decide_approval(s, node_id, approved=approved, by=by, reason=reason):
        s.refresh(appr)  # what won: a decision or a withdrawal made meanwhile
        raise HTTPException(status.HTTP_409_CONFLICT, f"n{node.number} was already {appr.status}")
    s.commit()
    nudge(celery, study_id)
    return serializers.approval_public(s, appr)


@router.post("/studies/{study_id}/nodes/{node_id}/approve", response_model=schemas.ApprovalPublic)
def approve(
    study_id: StudyId, node_id: NodeId, s: SessionDep, celery: CeleryDep, who: Approver
) -> schemas.ApprovalPublic:
    """Approve a gate-passed node: the coordinator merges it into trunk."""
    return _decide(study_id, node_id, True, "", s, celery, who.name)


@router.post("/studies/{study_id}/nodes/{node_id}/reject", response_model=schemas.ApprovalPublic)
def reject(
    study_id: StudyId,
    node_id: NodeId,
    body: schemas.Reason,
    s: SessionDep,
    celery: CeleryDep,
    who: Approver,
) -> schemas.ApprovalPublic:
    """Reject a gate-passed node with a reason."""
    return _decide(study_id, node_id, False, body.reason or "rejected", s, celery, who.name)
