"""The hypothesis tree: read it, inspect a node, steer it (human hypotheses, pruning)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from fastapi import Path as PathParam
from fastapi.responses import PlainTextResponse, Response
from sqlmodel import Session, col, select

from agents.tree.status import STUDY_ENDED, TERMINAL, NodeStatus, StudyStatus
from backend.api import schemas, serializers
from backend.api.deps import MAX_ID, CeleryDep, NodeId, Operator, Reader, SessionDep, SettingsDep, StudyId
from backend.api.routes.studies import get_study
from backend.core import gitops
from backend.core.config import Settings
from backend.core.models import Event, InsightVersion, Node, ReceiptRow
from backend.core.states import RunKind
from backend.engine import evaluation
from backend.services import fates, proposals, treebody
from backend.services.storage import prune_subtree
from backend.worker.dispatch import nudge

router = APIRouter(prefix="/studies/{study_id}", tags=["tree"])


def get_node(s: Session, study_id: int, node_id: int) -> Node:
    """Return a node of the study or answer 404."""
    node = s.get(Node, node_id)
    if node is None or node.study_id != study_id:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"study {study_id} has no node {node_id}")
    return node


@router.get("/tree", response_model=schemas.Tree)
def tree(study_id: StudyId, s: SessionDep, settings: SettingsDep, who: Reader) -> Response:
    """Return every node of the study's tree."""
    st = get_study(s, study_id)
    fields = [f for f in schemas.NodeSummary.model_fields if f not in ("fate", "rejection", "candidate")]
    # Written as JSON directly from the database's tuples, not built into 5,000 models and validated
    # again; kept per node and rebuilt only where a node changed (`services/treebody.py`).
    return Response(treebody.tree_body(s, settings.db_url, st, fields), media_type="application/json")


@router.get("/nodes/{node_id}", response_model=schemas.NodeDetail)
def node_detail(study_id: StudyId, node_id: NodeId, s: SessionDep, who: Reader) -> schemas.NodeDetail:
    """Return a node with its evidence, diff, receipts, verification, insight history and cost."""
    st = get_study(s, study_id)
    n = get_node(s, study_id, node_id)
    diff = ""
    if n.commit and n.base_commit and n.commit != n.base_commit:
        try:
            diff = gitops.Repo(Path(st.repo_path)).diff(n.base_commit, n.commit)[:200_000]
        except gitops.GitError:
            diff = ""
    receipts = s.exec(
        select(ReceiptRow).where(ReceiptRow.node_id == node_id).order_by(col(ReceiptRow.id))
    ).all()
    insights = s.exec(
        select(InsightVersion).where(InsightVersion.node_id == node_id).order_by(col(InsightVersion.version))
    ).all()
    children = s.exec(
        select(Node.id, Node.number).where(Node.parent_id == node_id).order_by(col(Node.id))
    ).all()
    parent = s.get(Node, n.parent_id) if n.parent_id is not None else None
    cited = {c for i in insights for c in i.cites}
    number = dict(s.exec(select(Node.id, Node.number).where(col(Node.id).in_(cited))).all()) if cited else {}
    history = s.exec(select(Event).where(Event.node_id == node_id).order_by(col(Event.id))).all()
    return schemas.NodeDetail(
        **serializers.node_summary(n, fates.told_of(s, n)).model_dump(),
        hypothesis=n.hypothesis,
        edits=n.edits,
        base_commit=n.base_commit,
        branch=n.branch,
        commit=n.commit,
        diff_stats=n.diff_stats,
        diff=diff,
        dev_values=n.dev_values,
        dev_std=n.dev_std,
        constraints=n.constraints,
        verification=n.verification,
        summary=n.summary,
        failure=n.failure,
        reflection=n.reflection,
        heldout_values=n.heldout_values,
        heldout_lcb=n.heldout_lcb,
        heldout_level=n.heldout_level,
        gate_reason=n.gate_reason,
        refined_as=fates.refined_as(s, n),
        cost=n.cost,
        receipts=[schemas.ReceiptPublic.model_validate(r, from_attributes=True) for r in receipts],
        insights=[
            schemas.InsightPublic(
                version=i.version,
                text=i.text,
                cites=i.cites,
                cited=[number[c] for c in i.cites if c in number],
                created_at=i.created_at,
            )
            for i in insights
        ],
        children=[schemas.NodeRef(id=c or 0, number=k) for c, k in children],
        parent_number=parent.number if parent else None,
        history=[serializers.event_public(e) for e in history],
    )


@router.post(
    "/nodes/{node_id}/hypotheses", status_code=status.HTTP_201_CREATED, response_model=schemas.NodeSummary
)
def add_hypothesis(
    study_id: StudyId,
    node_id: NodeId,
    body: schemas.HypothesisCreate,
    s: SessionDep,
    celery: CeleryDep,
    who: Operator,
) -> schemas.NodeSummary:
    """Add a human hypothesis as a child of a node; it runs before the policy's own proposals."""
    st = get_study(s, study_id)
    parent = get_node(s, study_id, node_id)
    if st.status == StudyStatus.STOPPING or st.status in STUDY_ENDED:
        raise HTTPException(status.HTTP_409_CONFLICT, f"study is {st.status}")
    hypothesis = {"mechanism": body.mechanism, "hypothesis": body.hypothesis, "observable": body.observable,
                  "risks": body.risks}  # fmt: skip
    try:
        node = proposals.human(s, st, parent, body.title, hypothesis, dict(body.edits), by=who.name)
    except proposals.ProposalRefused as exc:
        error = {"key": exc.key, "message": exc.detail}
        raise HTTPException(422, {"message": str(exc), "errors": [error]}) from None
    out = serializers.node_summary(node, fates.told_of(s, node))
    s.commit()
    nudge(celery, study_id)
    return out


@router.post("/nodes/{node_id}/prune", response_model=schemas.Message)
def prune(
    study_id: StudyId,
    node_id: NodeId,
    body: schemas.Reason,
    s: SessionDep,
    celery: CeleryDep,
    who: Operator,
) -> schemas.Message:
    """Prune a node and its subtree (running experiments finish; their results are kept)."""
    n = get_node(s, study_id, node_id)
    if n.parent_id is None:
        raise HTTPException(status.HTTP_409_CONFLICT, "the root cannot be pruned")
    if n.status in TERMINAL:
        raise HTTPException(status.HTTP_409_CONFLICT, f"n{n.number} is {n.status}")
    reason = body.reason or "no reason given"
    prune_subtree(s, study_id, node_id, reason, n.summary or n.title, by=who.name)
    s.commit()
    nudge(celery, study_id)
    return schemas.Message(message=f"pruned n{n.number}")


LIVE_TAIL = 20_000


@router.get("/nodes/{node_id}/live", response_model=schemas.LiveOutput)
def live_output(
    study_id: StudyId,
    node_id: NodeId,
    s: SessionDep,
    settings: SettingsDep,
    who: Reader,
    stream: Annotated[str, Query(pattern="^(stdout|stderr)$")] = "stdout",
) -> schemas.LiveOutput:
    """Return the tail of the newest output of the node's current attempt (its dev runs and executor commands)."""
    st = get_study(s, study_id)
    n = get_node(s, study_id, node_id)
    base = (settings.data_dir / "outputs" / st.name).resolve()
    folder = (base / f"n{node_id}-a{max(n.attempts, 1)}").resolve()
    files = [
        p
        for p in [*folder.glob(f"*.{stream}"), *folder.glob(f"tools/*.{stream}")]
        if p.is_file() and not p.is_symlink() and p.resolve().is_relative_to(base)
    ]
    if not files:
        note = (
            "no output yet: the node has not run"
            if n.status in (NodeStatus.PROPOSED, NodeStatus.QUEUED)
            else "no output here: it ran on a worker on another machine (its output arrives when each run ends)"
            if n.status == NodeStatus.RUNNING
            else "no stored output for this attempt"
        )
        return schemas.LiveOutput(
            node_id=node_id, status=n.status, run="", tail="", updated_at=None, note=note
        )
    newest = max(files, key=lambda p: p.stat().st_mtime)
    with open(newest, "rb") as fh:
        size = fh.seek(0, 2)
        fh.seek(max(0, size - LIVE_TAIL))
        tail = fh.read().decode("utf-8", "replace")
    changed = datetime.fromtimestamp(newest.stat().st_mtime, UTC).replace(tzinfo=None)
    return schemas.LiveOutput(
        node_id=node_id,
        status=n.status,
        run=str(newest.relative_to(folder)),
        tail=tail,
        updated_at=changed,
        note="",
    )


def stored_output(settings: Settings, study_name: str, recorded: str) -> Path | None:
    """Return a run's stored output file if it still lies in the study's outputs folder, else None."""
    path = Path(recorded).resolve()
    outputs = (settings.data_dir / "outputs" / study_name).resolve()
    return path if recorded and path.is_relative_to(outputs) and path.is_file() else None


@router.get("/nodes/{node_id}/curves", response_model=schemas.Curves)
def node_curves(
    study_id: StudyId, node_id: NodeId, s: SessionDep, settings: SettingsDep, who: Reader
) -> schemas.Curves:
    """Return the per-step records (JSON lines with an integer `step`) each dev run of the node printed."""
    study = get_study(s, study_id)
    get_node(s, study_id, node_id)
    rows = s.exec(
        select(ReceiptRow)
        .where(ReceiptRow.node_id == node_id, ReceiptRow.kind == RunKind.DEV)
        .order_by(col(ReceiptRow.id))
    ).all()
    curves = []
    for r in rows:
        path = stored_output(settings, study.name, r.stdout_path)
        if path is None:
            continue
        records = evaluation.step_records(path.read_text("utf-8", "replace"))
        if records:
            curves.append(schemas.Curve(receipt_id=r.id or 0, seed=r.seed, records=records))
    keys = sorted({k for c in curves for rec in c.records for k in rec} - {"step"})
    return schemas.Curves(keys=keys, curves=curves)


@router.get("/receipts/{receipt_id}/output", response_class=PlainTextResponse)
def receipt_output(
    study_id: StudyId,
    receipt_id: Annotated[int, PathParam(ge=1, le=MAX_ID)],
    s: SessionDep,
    settings: SettingsDep,
    who: Reader,
    stream: Annotated[str, Query(pattern="^(stdout|stderr)$")] = "stdout",
) -> str:
    """Return the full stored output of an evaluation run (capped at the configured size)."""
    r = s.get(ReceiptRow, receipt_id)
    if r is None or r.study_id != study_id:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"study {study_id} has no receipt {receipt_id}")
    study = get_study(s, study_id)
    path = stored_output(settings, study.name, r.stdout_path if stream == "stdout" else r.stderr_path)
    if path is None:
        raise HTTPException(status.HTTP_410_GONE, f"the stored {stream} of receipt {receipt_id} is gone")
    return path.read_text("utf-8", "replace")
