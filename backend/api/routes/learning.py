"""Learning-module jobs on the `gpu` queue: submit, list, inspect."""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, status
from sqlmodel import col, func, select

from backend.api import schemas
from backend.api.deps import MAX_ID, CeleryDep, Operator, Reader, SessionDep, SettingsDep
from backend.core.models import LearningJob, Study
from backend.engine import learning
from backend.worker.dispatch import BROKER_AWAY

router = APIRouter(prefix="/learning/jobs", tags=["learning"])
JobId = Annotated[int, Path(ge=1, le=MAX_ID, description="a learning job id")]


def _public(job: LearningJob, events: list[Any] | None = None) -> schemas.LearningJobPublic:
    return schemas.LearningJobPublic(
        id=job.id or 0, study_id=job.study_id, kind=job.kind, params=job.params, status=job.status,
        progress=job.progress, device=job.device, host=job.host, artifact=job.artifact, result=job.result, error=job.error,
        created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
        events=[schemas.LearningEventPublic(type=e.type, payload=e.payload, time=e.time) for e in events or []],
    )  # fmt: skip


@router.post("", status_code=status.HTTP_201_CREATED, response_model=schemas.LearningJobPublic)
def create(
    body: schemas.LearningJobCreate, s: SessionDep, settings: SettingsDep, celery: CeleryDep, who: Operator
) -> schemas.LearningJobPublic:
    """Queue a distillation job or a sparse-attention evaluation on the gpu queue."""
    if body.study_id is not None and s.get(Study, body.study_id) is None:
        raise HTTPException(422, {"message": f"study_id: no study with id {body.study_id}", "errors": []})
    token = secrets.token_hex(16)  # sent with the task; the job keeps its hash
    try:
        job = learning.submit(s, body.kind, body.params, body.study_id, settings=settings, token=token)
    except learning.LearningJobError as exc:
        raise HTTPException(
            422, {"message": str(exc), "errors": [{"key": exc.key, "message": str(exc)}]}
        ) from None
    s.commit()
    try:
        celery.send_task("gpu.learn", args=[job.id, token], task_id=f"learning-{job.id}")
    except BROKER_AWAY as exc:  # nothing would ever send it: the job ends now, with the reason
        learning.fail(settings, job.id or 0, f"the task queue was unreachable: {exc}")
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the task queue is unreachable") from None
    return _public(job)


@router.get("", response_model=schemas.Page[schemas.LearningJobPublic])
def list_jobs(
    s: SessionDep,
    who: Reader,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
) -> schemas.Page[schemas.LearningJobPublic]:
    """List learning jobs, newest first."""
    count = s.exec(select(func.count()).select_from(LearningJob)).one()
    rows = s.exec(select(LearningJob).order_by(col(LearningJob.id).desc()).offset(offset).limit(limit)).all()
    return schemas.Page(data=[_public(j) for j in rows], count=count)


@router.get("/{job_id}", response_model=schemas.LearningJobPublic)
def read(job_id: JobId, s: SessionDep, who: Reader) -> schemas.LearningJobPublic:
    """Return a learning job with its events and result."""
    job = s.get(LearningJob, job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no learning job with id {job_id}")
    return _public(job, learning.events(s, job_id))
