"""A job's store: its ids, its token, and the checks every write makes first."""

from __future__ import annotations

from sqlmodel import Session

from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Node, Study
from backend.core.states import JobStatus
from backend.engine.jobs.claims import (
    Refused,
    Superseded,
    locked_job,
    same_token,
)


class StoreBase:
    """A job's store: its ids, its token, and the checks every write makes first."""

    def __init__(
        self,
        settings: Settings,
        study_id: int,
        node_id: int | None,
        job_id: int | None = None,
        token: str = "",
    ) -> None:
        self.settings, self.study_id, self.node_id = settings, study_id, node_id
        self.job_id, self.token = job_id, token

    def study(self) -> Study:
        """Return the study as it is now."""
        with db.session(self.settings.db_url) as s:
            st = s.get(Study, self.study_id)
            assert st is not None
            s.expunge(st)
            return st

    def node(self, node_id: int) -> Node:
        """Return one of the study's nodes as it is now."""
        with db.session(self.settings.db_url) as s:
            node = self._node(s, node_id)
            s.expunge(node)
            return node

    def _node(self, s: Session, node_id: int | None) -> Node:
        node = s.get(Node, node_id) if node_id is not None else None
        if node is None or node.study_id != self.study_id:
            raise Refused(f"node {node_id} is not a node of study {self.study_id}")
        return node

    def _job(self, s: Session) -> Job:
        job = locked_job(s, self.job_id)
        if job is None or not same_token(job.token, self.token) or job.status != JobStatus.RUNNING:
            raise Superseded(f"job {self.job_id} was taken over")
        return job

    def _current(self, s: Session) -> None:
        """Refuse a job's write once the job is no longer running under this token (cancelled, taken over).

        A store without a job (the single-process gatekeeper) writes for the coordinator itself.
        """
        if self.job_id is not None:
            self._job(s)
