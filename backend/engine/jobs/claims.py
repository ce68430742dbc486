"""Claiming a job: its token, the row lock, and the refusals a job's calls end with."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket

from sqlalchemy import update
from sqlmodel import Session, col

from agents.tree.status import NodeStatus
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Node, Study, now
from backend.core.states import SEALED_KINDS, JobKind, JobStatus
from backend.services.records import add_event, transition


class Superseded(RuntimeError):
    """This job's token is no longer current; another run owns it."""


class Unreachable(RuntimeError):
    """The records could not be reached (the API is down or failed): the job is tried again later."""


class Refused(ValueError):
    """A call named a node of another study, or a ref outside the study's namespace."""


def token_hash(token: str) -> str:
    """Return what the database keeps of a job's token: its SHA-256, in hex (a copy of the rows holds no token)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def same_token(held: str, given: str) -> bool:
    """Return whether a presented token is the one whose hash the job keeps (compared in constant time; never an empty one)."""
    return bool(held) and bool(given) and secrets.compare_digest(held, token_hash(given))


def locked_job(s: Session, job_id: int | None) -> Job | None:
    """Return a job's row read under its write lock, so that a check of it holds until the commit.

    pysqlite reads outside a transaction until the first write, and PostgreSQL reads the last
    committed row: a cancellation committed between a check and the write after it would be
    overwritten. PostgreSQL locks the row as it reads it (`FOR UPDATE`); SQLite has no row locks,
    so a no-op update first takes the database's write lock.
    """
    if job_id is None:
        return None
    if s.get_bind().dialect.name == "sqlite":
        s.connection().execute(update(Job).where(col(Job.id) == job_id).values(status=Job.status))
        return s.get(Job, job_id, populate_existing=True)
    return s.get(Job, job_id, populate_existing=True, with_for_update=True)


def claim_experiment(
    settings: Settings, job_id: int, token: str, host: str, pid: int
) -> tuple[Job, Node, Study]:
    """Mark an experiment job running (its node too) and return its rows; raise Superseded if not ours."""
    with db.session(settings.db_url) as s:
        job = locked_job(s, job_id)
        if (
            job is None
            or job.kind != JobKind.EXPERIMENT
            or not same_token(job.token, token)
            or job.status not in (JobStatus.QUEUED, JobStatus.RUNNING)
        ):
            raise Superseded(f"job {job_id} is not ours to run")
        node = s.get(Node, job.node_id)
        study = s.get(Study, job.study_id)
        assert node is not None and study is not None
        job.status, job.started_at, job.pid = "running", now(), pid
        s.add(job)
        add_event(
            s, job.study_id, "job.started", job.node_id, job_id=job_id, attempt=job.attempt, pid=pid, host=host
        )  # fmt: skip
        if node.status == NodeStatus.QUEUED:
            transition(s, node, NodeStatus.RUNNING, job_id=job_id, attempt=job.attempt)
        s.flush()
        for row in (job, node, study):
            s.refresh(row)
            s.expunge(row)
        return job, node, study


def claim_sealed(settings: Settings, job_id: int, token: str) -> Job | None:
    """Mark a sealed job running and count the try; None if it is not ours to run."""
    with db.session(settings.db_url) as s:
        job = locked_job(s, job_id)
        if (
            job is None
            or job.kind not in SEALED_KINDS
            or not same_token(job.token, token)
            or job.status not in (JobStatus.QUEUED, JobStatus.RUNNING)
        ):
            return None
        tries = int(job.outcome.get("tries", 0)) + 1
        job.status, job.started_at, job.outcome = "running", now(), {**job.outcome, "tries": tries}
        s.add(job)
        s.flush()
        s.refresh(job)
        s.expunge(job)
        return job


def job_of(settings: Settings, job_id: int, token: str) -> Job | None:
    """Return a job while this token is current and the job is running (a remote worker's right to call)."""
    with db.session(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is None or not same_token(job.token, token) or job.status != JobStatus.RUNNING:
            return None
        s.expunge(job)
        return job


def host() -> tuple[str, int]:
    """Return this process's host name and pid, as a claim records them."""
    return socket.gethostname(), os.getpid()
