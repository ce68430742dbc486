"""Sending work to Celery: the coordinator's `Dispatcher` port, `enqueue_advance` and `nudge`."""

from __future__ import annotations

import logging
import secrets

from celery import Celery
from kombu.exceptions import OperationalError

from agents.executor.tools import RUN_TIMEOUT
from agents.spec import Spec
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Study
from backend.services.records import spec_of

# The longest one model call may take with the default timeout, retries and backoff ceiling.
MODEL_CALL = 120 * 6 + 60 * 5


def enqueue_advance(app: Celery, study_id: int, countdown: float | None = None) -> None:
    """Ask a coordinator worker to advance a study (after whatever made it ready was committed)."""
    app.send_task("coordinator.advance", args=[study_id], countdown=countdown)


BROKER_AWAY = (OperationalError, OSError)  # what publishing raises when the broker cannot be reached


def nudge(app: Celery, study_id: int) -> None:
    """Enqueue an advance after a committed change; if the broker is away, leave it to the reconciler.

    The reconciler advances running and stopping studies whose lease nobody holds, and created
    ones older than one reconcile period, so what the caller already committed is acted on once
    the broker is back; the caller's request does not fail for it.
    """
    try:
        enqueue_advance(app, study_id)
    except BROKER_AWAY as exc:
        logging.getLogger(__name__).warning(
            "study %s: the advance could not be queued (%s); the reconciler sends it", study_id, exc
        )


def job_token(job: Job) -> str:
    """Return the task id of a job's attempt: its id and attempt, then a secret part nobody can guess.

    The task id is also the job's token, which a remote worker presents to the API: sequential ids
    alone would let a worker token reach any study's jobs. A re-send of the same attempt keeps it.
    """
    prefix = f"job-{job.id}-a{job.attempt}-"
    return job.token if job.token.startswith(prefix) else prefix + secrets.token_hex(16)


class CeleryDispatcher:
    """Sends one task per job, on `cpu` or `gpu`, with the spec's time limits.

    Experiments go to `<queue>.experiment`; the sealed baseline and gate jobs to `<queue>.sealed`,
    so a GPU study's held-out test runs on a GPU worker.
    """

    def __init__(self, settings: Settings, app: Celery) -> None:
        self.settings, self.app = settings, app

    def submit(self, job_id: int) -> None:
        """Send the job's task (safe to repeat: an attempt keeps its task id, and the task is idempotent)."""
        with db.session(self.settings.db_url) as s:
            job = s.get(Job, job_id)
            if job is None or job.status not in ("queued", "running"):
                return
            study = s.get(Study, job.study_id)
            assert study is not None
            spec = spec_of(study)
            job.token = job_token(job)
            s.add(job)
            token = job.token
            kind, study_id = job.kind, job.study_id
        queue = "gpu" if spec.resources.gpu else "cpu"
        hard = job_seconds(spec, kind) + self.settings.task_margin_seconds
        soft = hard - min(30, self.settings.task_margin_seconds // 2)
        self.app.send_task(
            f"{queue}.{'experiment' if kind == 'experiment' else 'sealed'}",
            args=[job_id, token, study_id],
            task_id=token,
            time_limit=min(hard, self.settings.visibility_timeout - 60),
            soft_time_limit=min(soft, self.settings.visibility_timeout - 90),
        )


def job_seconds(spec: Spec, kind: str) -> int:
    """Return the longest a job of `kind` may need by its spec, before the margin."""
    if kind != "experiment":  # baseline: dev and test runs; gate: up to 3x the test seeds, 2x more on trunk
        return int(spec.evaluate.timeout * (spec.evaluate.repeats + 5 * spec.gate.test_repeats))
    seconds = spec.evaluate.timeout * spec.evaluate.repeats  # the dev runs after the change
    if spec.policy_kind == "llm":
        # The executor's minutes; one tool call (a command or a dev evaluation) and one model call
        # (all its retries) begun at their end; and the reflection call after a failed attempt.
        seconds += (
            spec.policy.executor_minutes * 60 + max(spec.evaluate.timeout, RUN_TIMEOUT) + 2 * MODEL_CALL
        )
    return int(seconds)
