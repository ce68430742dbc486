"""A local process pool that runs experiment jobs as child processes (the `Dispatcher` port)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable

from sqlmodel import col, select

from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, now
from backend.core.states import JobKind, JobStatus
from backend.engine.jobstore import same_token, token_hash
from backend.engine.site import LocalSite


class LocalPool:
    """Runs each job in `python -m backend.engine.experiment`; children die with this process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.procs: dict[int, tuple[subprocess.Popen[bytes], str]] = {}

    def submit(self, job_id: int) -> None:
        """Start a job unless it is already running here or finished."""
        if job_id in self.procs and self.procs[job_id][0].poll() is None:
            return
        token = uuid.uuid4().hex
        with db.session(self.settings.db_url) as s:
            job = s.get(Job, job_id)
            if job is None or job.status in (JobStatus.DONE, JobStatus.FAILED):
                return
            job.token = token_hash(token)
            job.status = "queued"
            s.add(job)
        env_settings = {
            "GROVE_DATA_DIR": str(self.settings.data_dir.resolve()),
            "GROVE_WORKTREES_DIR": str(self.settings.worktrees_dir.resolve()),
        }
        if self.settings.database_url:
            env_settings["GROVE_DATABASE_URL"] = self.settings.database_url
        import os

        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.engine.experiment", str(job_id), token],
            env={**os.environ, **env_settings},
            stdin=subprocess.DEVNULL,
        )
        self.procs[job_id] = (proc, token)

    def reconcile(self, study_id: int) -> list[int]:
        """Restart jobs left queued or running by a process that is gone."""
        with db.session(self.settings.db_url) as s:
            left = [
                j
                for j in s.exec(
                    select(Job).where(Job.study_id == study_id, col(Job.status).in_(["queued", "running"]))
                )
                if j.id is not None and j.id not in self.procs
            ]
            for j in left:
                if j.kind != JobKind.EXPERIMENT:  # a sealed job of the service: this process gates inline
                    j.status, j.finished_at = "failed", now()
                    j.outcome = {"reason": "resumed in one process, which runs sealed evaluations inline"}
                    s.add(j)
            stale = [j.id for j in left if j.kind == JobKind.EXPERIMENT and j.id is not None]
        for job_id in stale:
            self.submit(job_id)
        return stale

    def _reap(self) -> None:
        for job_id, (proc, token) in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.procs[job_id]
            with db.session(self.settings.db_url) as s:
                job = s.get(Job, job_id)
                unfinished = (
                    job is not None
                    and same_token(job.token, token)
                    and job.status in (JobStatus.QUEUED, JobStatus.RUNNING)
                )
            if unfinished:
                LocalSite(self.settings).crash(job_id, token, f"executor process exited with code {code}")

    def finished(self, job_ids: list[int]) -> list[int]:
        """Return which of the jobs have finished (done or failed)."""
        self._reap()
        if not job_ids:
            return []
        with db.session(self.settings.db_url) as s:
            rows = s.exec(
                select(Job).where(col(Job.id).in_(job_ids), col(Job.status).in_(["done", "failed"]))
            )
            return sorted(j.id for j in rows if j.id is not None)

    def wait_any(
        self,
        job_ids: list[int],
        tick: Callable[[], None] | None = None,
        interrupted: Callable[[], bool] | None = None,
        poll: float = 0.25,
    ) -> list[int]:
        """Block until one of the jobs has finished (return those that have) or `interrupted()` holds."""
        while True:
            done = self.finished(job_ids)
            if done or (interrupted and interrupted()):
                return done
            if tick:
                tick()
            time.sleep(poll)

    def shutdown(self) -> None:
        """Terminate running children."""
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc, _ in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()
