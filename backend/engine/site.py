"""Where a job runs: its records (a `JobStore`) and its repository.

`LocalSite` is a machine with the database and Grove's clones (the single-process runner, or a
worker beside the API); `backend.worker.remote.RemoteSite` is a worker that reaches both through
the API.
"""

from __future__ import annotations

from typing import Protocol

from backend.core import db
from backend.core.config import Settings
from backend.core.gitops import Repo
from backend.core.models import Job, Node, Study
from backend.engine import jobstore
from backend.engine.jobstore import DbStore, JobStore


class Site(Protocol):
    """A machine a job can run on."""

    settings: Settings

    def claim_experiment(self, job_id: int, token: str) -> tuple[Job, Node, Study, JobStore]:
        """Mark an experiment running and return its rows and store; raise Superseded if not ours."""
        ...

    def claim_sealed(self, job_id: int, token: str) -> tuple[Job, JobStore] | None:
        """Mark a sealed job running (one more try) and return it with its store; None if not ours."""
        ...

    def repo(self, study: Study, job_id: int, token: str, sealed: bool = False) -> Repo:
        """Return a repository holding every commit of the study's trunk and nodes (and for `sealed`, its base)."""
        ...

    def crash(self, job_id: int, token: str, reason: str) -> None:
        """Fail an experiment whose run ended without finishing (killed, out of time)."""
        ...


class LocalSite:
    """Runs jobs against the database and Grove's own clones."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def claim_experiment(self, job_id: int, token: str) -> tuple[Job, Node, Study, JobStore]:
        """Mark an experiment running and return its rows and store; raise Superseded if not ours."""
        name, pid = jobstore.host()
        job, node, study = jobstore.claim_experiment(self.settings, job_id, token, name, pid)
        return job, node, study, DbStore(self.settings, job.study_id, job.node_id, job.id, token)

    def claim_sealed(self, job_id: int, token: str) -> tuple[Job, JobStore] | None:
        """Mark a sealed job running (one more try) and return it with its store; None if not ours."""
        job = jobstore.claim_sealed(self.settings, job_id, token)
        if job is None:
            return None
        return job, DbStore(self.settings, job.study_id, job.node_id, job.id, token)

    def repo(self, study: Study, job_id: int, token: str, sealed: bool = False) -> Repo:
        """Return Grove's clone of the study's repository."""
        return jobstore.local_repo(study)

    def crash(self, job_id: int, token: str, reason: str) -> None:
        """Fail an experiment whose run ended without finishing (killed, out of time)."""
        with db.session(self.settings.db_url) as s:
            job = s.get(Job, job_id)
            if job is None:
                return
            study_id, node_id = job.study_id, job.node_id
        DbStore(self.settings, study_id, node_id, job_id, token).crash(reason)
