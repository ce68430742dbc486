"""Sending work to Celery: the coordinator's `Dispatcher` port, `enqueue_advance` and `nudge`."""

from __future__ import annotations

import logging
import secrets

from celery import Celery
from kombu.exceptions import OperationalError

from agents.executor.tools import RUN_TIMEOUT
from agents.spec import Spec
from backend.core import db, locks
from backend.core.config import Settings
from backend.core.models import Job, Study
from backend.core.states import JobKind, JobStatus
from backend.engine import jobstore
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


TOKEN_KEY = "grove:job-token:{}"  # a job's task id and token while its task may be in flight (Redis)


def job_token(settings: Settings, job: Job) -> tuple[str, str]:
    """Return the task id and the token to send a job's attempt with: those it was sent with, or new ones.

    The task id (`job-<id>-a<attempt>-<nonce>`) names the attempt in Celery, its logs and revocations,
    and is no secret. The token is one (128 random bits): a remote worker presents it to the API, and
    the database keeps only its hash. A re-send keeps both, so that the copy already queued still
    runs (a fresh token would leave it useless at the back of the queue), from the broker's Redis,
    which carries them in the task's message anyway; where they are gone, the attempt gets new ones.
    """
    kept = locks.client(settings.redis_url).get(TOKEN_KEY.format(job.id))
    raw = kept.decode("ascii", "replace") if isinstance(kept, bytes) else str(kept or "")
    task_id, _, token = raw.partition(" ")
    if task_id.startswith(f"job-{job.id}-a{job.attempt}-") and jobstore.same_token(job.token, token):
        return task_id, token
    return f"job-{job.id}-a{job.attempt}-{secrets.token_hex(8)}", secrets.token_hex(16)


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
            job = jobstore.locked_job(s, job_id)  # two sends of one job at once agree on its token
            if job is None or job.status not in (JobStatus.QUEUED, JobStatus.RUNNING):
                return
            study = s.get(Study, job.study_id)
            assert study is not None
            spec = spec_of(study)
            task_id, token = job_token(self.settings, job)
            job.task_id, job.token = task_id, jobstore.token_hash(token)
            s.add(job)
            kind, study_id = job.kind, job.study_id
            locks.client(self.settings.redis_url).set(
                TOKEN_KEY.format(job_id), f"{task_id} {token}", ex=2 * self.settings.visibility_timeout
            )
        queue = "gpu" if spec.resources.gpu else "cpu"
        hard = job_seconds(spec, kind) + self.settings.task_margin_seconds
        soft = hard - min(30, self.settings.task_margin_seconds // 2)
        self.app.send_task(
            f"{queue}.{'experiment' if kind == JobKind.EXPERIMENT else 'sealed'}",
            args=[job_id, token, study_id],
            task_id=task_id,
            time_limit=min(hard, self.settings.visibility_timeout - 60),
            soft_time_limit=min(soft, self.settings.visibility_timeout - 90),
        )


def job_seconds(spec: Spec, kind: str) -> int:
    """Return the longest a job of `kind` may need by its spec, before the margin."""
    if (
        kind != JobKind.EXPERIMENT
    ):  # baseline: dev and test runs; gate: up to 3x the test seeds, 2x more on trunk
        return int(spec.evaluate.timeout * (spec.evaluate.repeats + 5 * spec.gate.test_repeats))
    seconds = spec.evaluate.timeout * spec.evaluate.repeats  # the dev runs after the change
    if spec.capabilities.calls_model:
        # The executor's minutes; one tool call (a command or a dev evaluation) and one model call
        # (all its retries) begun at their end; and the reflection call after a failed attempt.
        seconds += (
            spec.policy.executor_minutes * 60 + max(spec.evaluate.timeout, RUN_TIMEOUT) + 2 * MODEL_CALL
        )
    return int(seconds)
