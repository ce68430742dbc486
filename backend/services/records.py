"""Records every part of Grove writes: events, node status changes, insight versions; the parsed spec.

A row change and its event are always written in the same transaction (the caller's session).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from sqlmodel import Session, col, select

from agents.spec import Spec, parse_spec
from agents.tree.status import NodeStatus, check_transition
from backend.core import db
from backend.core.models import Event, InsightVersion, Node, Study, now


def add_event(s: Session, study_id: int, type_: str, node_id: int | None = None, **payload: Any) -> Event:
    """Append an event row in the caller's transaction."""
    ev = Event(study_id=study_id, node_id=node_id, type=type_, payload=payload)
    s.add(ev)
    s.info.setdefault(db.EVENT_STUDIES, set()).add(study_id)
    return ev


def transition(s: Session, node: Node, new: NodeStatus | str, **payload: Any) -> None:
    """Move a node to a new status (checked) and record the event in the same transaction."""
    assert node.id is not None
    status = check_transition(node.id, node.status, new)
    node.status = str(status)
    node.status_reason = str(payload.get("reason") or "")[:2000]
    node.status_by = str(payload.get("by") or "")[:200]
    node.updated_at = now()
    s.add(node)
    add_event(s, node.study_id, f"node.{status}", node.id, **payload)


def latest_insight(s: Session, node_id: int) -> str:
    """Return the text of a node's newest insight version."""
    row = s.exec(
        select(InsightVersion)
        .where(InsightVersion.node_id == node_id)
        .order_by(col(InsightVersion.version).desc())
    ).first()
    return row.text if row else ""


def add_insight(s: Session, study_id: int, node_id: int, text: str, cites: list[int]) -> None:
    """Append a new insight version to a node."""
    last = s.exec(
        select(InsightVersion)
        .where(InsightVersion.node_id == node_id)
        .order_by(col(InsightVersion.version).desc())
    ).first()
    version = (last.version if last else 0) + 1
    s.add(InsightVersion(study_id=study_id, node_id=node_id, version=version, text=text, cites=cites))
    add_event(s, study_id, "insight.updated", node_id, version=version, cites=cites)


def spec_of(study: Study) -> Spec:
    """Return a study's parsed spec (parsed once per text: a coordinator step asks many times)."""
    return _parsed(study.spec_toml)


@lru_cache(maxsize=1024)  # a listing of 200 studies reads 200 specs
def _parsed(text: str) -> Spec:
    return parse_spec(text)


def mark_unsandboxed(s: Session, study_id: int) -> None:
    """Record, once, that a study's code ran without the sandbox (GROVE_SANDBOX=none)."""
    study = s.get(Study, study_id)
    if study is not None and study.sandbox != "none":
        study.sandbox = "none"
        s.add(study)
        add_event(s, study_id, "study.unsandboxed", reason="GROVE_SANDBOX=none on the machine that ran it")
