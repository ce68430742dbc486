"""Study status changes: the one module that writes a study's status.

Each change is checked against the study life cycle (`agents.tree.status.STUDY_TRANSITIONS`) and
writes the row and its `study.<event>` event in the caller's transaction; the session pings the
event fan-out when it commits. API routes, CLI commands, the driver and the gate all come here.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from agents.tree.status import StopRule, StudyStatus, check_study_transition
from backend.core.config import Settings
from backend.core.models import (
    Approval,
    Event,
    InsightVersion,
    Job,
    LearningJob,
    LlmCall,
    LlmHold,
    Node,
    ReceiptRow,
    Study,
    Trajectory,
    now,
)
from backend.core.states import JobStatus
from backend.services import memory
from backend.services.records import add_event


class StudyNotFound(LookupError):
    """No study has this id or name."""


def load(s: Session, study_id: int) -> Study:
    """Return a study row, or raise `StudyNotFound`."""
    st = s.get(Study, study_id)
    if st is None:
        raise StudyNotFound(f"no study with id {study_id}")
    return st


def change(s: Session, study_id: int, new: StudyStatus, event: str | None = None, **payload: Any) -> Study:
    """Move a study to `new` (checked) and record `study.<event>`; raise `IllegalStudyTransition`."""
    st = load(s, study_id)
    status = check_study_transition(st.name, st.status, new)
    st.status = str(status)
    if status == StudyStatus.RUNNING and st.started_at is None:
        st.started_at = now()
    if status in (StudyStatus.FINISHED, StudyStatus.FAILED):
        st.stop_reason, st.finished_at = str(payload.get("reason", "")), now()
        st.stop_rule = str(payload.get("rule", ""))
    s.add(st)
    add_event(s, study_id, f"study.{event or status}", None, **payload)
    return st


def start(s: Session, study_id: int) -> bool:
    """Mark a created study running once its baseline is being measured; return whether it changed.

    One conditional update: a pause or stop that came in since the study was read wins over it.
    """
    st = load(s, study_id)
    if st.status != StudyStatus.CREATED:
        return False
    won = s.execute(
        update(Study)
        .where(col(Study.id) == study_id, col(Study.status) == StudyStatus.CREATED)
        .values(status=str(StudyStatus.RUNNING), started_at=now())
    )
    s.expire(st)
    if not won.rowcount:  # type: ignore[attr-defined]
        return False
    add_event(s, study_id, "study.started", None)
    return True


def pause(s: Session, study_id: int, *, by: str = "", reason: str = "", budget: str = "") -> Study:
    """Pause a study: running experiments finish, nothing new starts (`budget`: the LLM budget spent)."""
    payload = {k: v for k, v in (("by", by), ("reason", reason), ("budget", str(budget))) if v}
    return change(s, study_id, StudyStatus.PAUSED, **payload)


def resume(s: Session, study_id: int, *, by: str) -> Study:
    """Resume a paused study."""
    return change(s, study_id, StudyStatus.RUNNING, "resumed", by=by)


def stop(s: Session, study_id: int, *, by: str) -> list[str]:
    """Ask a study to stop; return the task ids of its queued jobs, which the caller may revoke.

    A study still cloning has nothing running: it ends at once, as failed.
    """
    if load(s, study_id).status == StudyStatus.CLONING:
        change(
            s, study_id, StudyStatus.FAILED, reason=f"stopped by {by or 'someone'} before its clone finished"
        )
        return []
    change(s, study_id, StudyStatus.STOPPING, "stopping", by=by)
    jobs = s.exec(select(Job).where(Job.study_id == study_id, Job.status == JobStatus.QUEUED))
    return [j.task_id for j in jobs if j.task_id]


def fail(s: Session, study_id: int, reason: str, step: StopRule | None = None) -> None:
    """End a study as failed (idempotent), naming the step it failed on where one is known."""
    if load(s, study_id).status != StudyStatus.FAILED:
        change(s, study_id, StudyStatus.FAILED, reason=reason[:2000], **({"rule": str(step)} if step else {}))


def finish(s: Session, study_id: int, reason: str, rule: StopRule | None = None) -> None:
    """End a study as finished (idempotent), by the rule that ended it."""
    if load(s, study_id).status != StudyStatus.FINISHED:
        change(s, study_id, StudyStatus.FINISHED, reason=reason, **({"rule": str(rule)} if rule else {}))
        memory.remember(s, load(s, study_id))


def discard(s: Session, settings: Settings, study_id: int, thread_id: str) -> None:
    """Delete a study with its rows, its coordinator checkpoints, Grove's clone and its worktrees."""
    study = load(s, study_id)
    for model in (Approval, Event, InsightVersion, ReceiptRow, Trajectory, LlmCall, LlmHold, Job):
        for row in s.exec(select(model).where(col(model.study_id) == study_id)):
            s.delete(row)
    s.flush()
    for n in s.exec(select(Node).where(Node.study_id == study_id).order_by(col(Node.id).desc())):
        s.delete(n)
        s.flush()
    for lj in s.exec(select(LearningJob).where(LearningJob.study_id == study_id)):
        lj.study_id = None
        s.add(lj)
    s.delete(study)
    s.flush()
    if not settings.is_postgres and settings.checkpoint_path.exists():
        with contextlib.closing(sqlite3.connect(settings.checkpoint_path)) as conn, conn:
            for table in ("checkpoints", "writes"):
                with contextlib.suppress(sqlite3.OperationalError):
                    conn.execute(f"DELETE FROM {table} WHERE thread_id = ?", (thread_id,))
    if study.repo_path:
        shutil.rmtree(study.repo_path, ignore_errors=True)
    shutil.rmtree(settings.worktrees_dir / study.name, ignore_errors=True)
