"""The worker data plane of learning jobs: claim, progress, end, and the study's records.

Every route needs a token with the `worker` role and the learning job's own token (sent with its
task): a worker touches only the learning job it runs, and reads a study's executor records only
through a running job of that study.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, status
from pydantic import BaseModel, Field, field_validator

from backend.api.deps import MAX_ID, SettingsDep, Worker
from backend.engine import learning
from backend.engine.jobstore import Superseded
from backend.services.trajectories import export_records

router = APIRouter(prefix="/worker/learning", tags=["worker"])
JobId = Annotated[int, Path(ge=1, le=MAX_ID, description="a learning job id")]
PAYLOAD_BYTES = 16_000  # what one progress event may carry
RESULT_BYTES = 256_000  # what a job's result may hold


def _bounded(value: dict[str, Any], limit: int) -> dict[str, Any]:
    if len(json.dumps(value)) > limit:
        raise ValueError(f"more than {limit} bytes as JSON")
    return value


class Held(BaseModel):
    token: str = Field(min_length=1, max_length=200)


class LearningClaim(Held):
    host: str = Field(default="", max_length=255)
    pid: int = Field(default=0, ge=0)


class Progress(Held):
    fraction: float = Field(ge=0.0, le=1.0)
    payload: dict[str, Any] = {}

    @field_validator("payload")
    @classmethod
    def _small(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _bounded(v, PAYLOAD_BYTES)


class Failure(Held):
    reason: str = Field(max_length=4000)


class Finish(Held):
    result: dict[str, Any]
    artifact: str = Field(max_length=4096)

    @field_validator("result")
    @classmethod
    def _small(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _bounded(v, RESULT_BYTES)


def _not_held(job_id: int) -> HTTPException:
    return HTTPException(status.HTTP_409_CONFLICT, f"learning job {job_id} is not running under this token")


def _through(job_id: int, write: Callable[[], None]) -> dict[str, bool]:
    """Make a write that holds only while the job runs under the caller's token; 409 once it does not."""
    try:
        write()
    except Superseded:
        raise _not_held(job_id) from None
    return {"ok": True}


@router.post("/{job_id}/claim")
def claim(job_id: JobId, body: LearningClaim, settings: SettingsDep, who: Worker) -> dict[str, Any]:
    """Mark a learning job running on this worker's machine and return it (an ended job as it is)."""
    job = learning.claim(settings, job_id, body.host, body.pid, token=body.token)
    if job is None:
        raise _not_held(job_id)
    return {"job": job.model_dump(mode="json", exclude={"token"})}


@router.post("/{job_id}/progress")
def progress(job_id: JobId, body: Progress, settings: SettingsDep, who: Worker) -> dict[str, bool]:
    """Record how far the job is."""
    return _through(
        job_id, lambda: learning.progress(settings, job_id, body.fraction, body.payload, body.token)
    )


@router.post("/{job_id}/fail")
def fail(job_id: JobId, body: Failure, settings: SettingsDep, who: Worker) -> dict[str, bool]:
    """End the job as failed with the reason."""
    return _through(job_id, lambda: learning.fail(settings, job_id, body.reason, body.token))


@router.post("/{job_id}/finish")
def finish(job_id: JobId, body: Finish, settings: SettingsDep, who: Worker) -> dict[str, bool]:
    """End the job as done with its result and its artifact's folder on the worker's machine."""
    return _through(job_id, lambda: learning.finish(settings, job_id, body.result, body.artifact, body.token))


@router.post("/{job_id}/records")
def records(job_id: JobId, body: Held, settings: SettingsDep, who: Worker) -> list[dict[str, Any]]:
    """Return the executor records of the running job's study (none for a job without one)."""
    job = learning.held(settings, job_id, body.token)
    if job is None:
        raise _not_held(job_id)
    return export_records(settings, job.study_id) if job.study_id is not None else []
