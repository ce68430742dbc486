"""Studies: create, list, read, control, promote, report."""

from __future__ import annotations

import logging
from typing import Annotated

from celery import Celery
from fastapi import APIRouter, Form, HTTPException, Query, UploadFile, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse
from sqlmodel import Session, col, func, select

from agents.spec import SpecIssue, parse_spec
from agents.tree.status import StudyStatus
from backend.api import schemas, serializers
from backend.api.deps import MAX_ID, Approver, CeleryDep, Operator, Reader, SessionDep, SettingsDep, StudyId
from backend.core import cloning, gitops
from backend.core.config import Settings
from backend.core.models import Study
from backend.services import drafting, lifecycle, report
from backend.services.studies import (
    NotPromotable,
    SourceRefused,
    check_new,
    check_operator_limits,
    check_source,
    check_study,
    create_study,
    register_study,
)
from backend.services.studies import promote as promote_trunk
from backend.worker.celery_app import CLONE_TASK
from backend.worker.dispatch import BROKER_AWAY, nudge

router = APIRouter(prefix="/studies", tags=["studies"])


def get_study(s: Session, study_id: int) -> Study:
    """Return a study or answer 404."""
    st = s.get(Study, study_id)
    if st is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no study with id {study_id}")
    return st


def _create(
    s: Session, settings: Settings, celery: Celery, spec: str, repository: str
) -> schemas.StudyPublic:
    check_source(settings, repository)
    if gitops.is_url(repository):
        # A remote may be slow: the study is `cloning` until a clone worker has its clone.
        st = register_study(s, settings, spec, repository)
        s.commit()
        try:
            celery.send_task(CLONE_TASK, args=[st.id])
        except Exception as exc:  # the broker is down: the study must not wait for a clone forever
            lifecycle.fail(s, st.id or 0, f"the task queue was unreachable: {exc}")
            s.commit()
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, "the task queue is unreachable"
            ) from None
        return serializers.study_public(s, st)
    st = create_study(s, settings, spec, repository, allow_plain_folder=False)
    s.commit()
    nudge(celery, st.id or 0)
    return serializers.study_public(s, st)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=schemas.StudyPublic)
def create(
    body: schemas.StudyCreate, s: SessionDep, settings: SettingsDep, celery: CeleryDep, who: Operator
) -> schemas.StudyPublic:
    """Create a study from a grove.toml text and a repository path or URL, and start it."""
    return _create(s, settings, celery, body.spec, body.repository)


@router.post("/form", status_code=status.HTTP_201_CREATED, response_model=schemas.StudyPublic)
async def create_form(
    s: SessionDep,
    settings: SettingsDep,
    celery: CeleryDep,
    who: Operator,
    repository: Annotated[str, Form(min_length=1)],
    spec: Annotated[str | None, Form()] = None,
    spec_file: UploadFile | None = None,
) -> schemas.StudyPublic:
    """Create a study from a form: the spec as text or as an uploaded grove.toml."""
    text = spec
    if spec_file is not None:
        raw = await spec_file.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise HTTPException(422, {"message": "spec_file: not UTF-8 text", "errors": []}) from None
    if not text:
        raise HTTPException(422, {"message": "spec: give the grove.toml text or upload it", "errors": []})
    return await run_in_threadpool(_create, s, settings, celery, text, repository)


@router.post("/draft", response_model=schemas.Draft)
def draft(body: schemas.DraftRequest, settings: SettingsDep, who: Operator) -> schemas.Draft:
    """Draft a commented grove.toml for a repository and a goal in words, explaining each choice."""
    if not gitops.is_url(body.repository):  # a URL is refused below (a draft reads this server's disk)
        check_source(settings, body.repository)
    try:
        name, files = drafting.read_repository(body.repository)
    except (FileNotFoundError, gitops.GitError) as exc:
        raise HTTPException(422, {"message": f"repository: {exc}", "errors": []}) from None
    made = drafting.draft_study(name, files, body.goal, use_model=body.use_model)
    return schemas.Draft(spec=made.spec, notes=made.notes, model=made.model, files=made.files)


@router.post("/validate", response_model=schemas.Message)
def validate(
    body: schemas.StudyCreate, s: SessionDep, settings: SettingsDep, who: Operator
) -> schemas.Message:
    """Check a grove.toml text against a repository without creating anything."""
    check_source(settings, body.repository)
    spec = parse_spec(body.spec)
    check_operator_limits(settings, spec)
    if gitops.is_url(body.repository):
        check_new(s, spec, body.repository)
        reach(settings, body.repository, spec.study.base)
        return schemas.Message(
            message=f"valid: study {spec.study.name!r} can be created; the repository answered, and is cloned "
            "and checked in the background when it is"
        )
    warnings: list[SpecIssue] = []
    spec = check_study(s, body.spec, body.repository, warnings)
    said = "".join(f"; warning: {w}" for w in warnings)
    return schemas.Message(message=f"valid: study {spec.study.name!r} can be created{said}")


def reach(settings: Settings, source: str, base: str) -> None:
    """Refuse a repository URL whose host does not answer within the clone's first-byte time (at most 20 s)."""
    try:
        cloning.reachable(cloning.check(settings, source), base, min(settings.clone_first_byte_timeout, 20.0))
    except cloning.HostRefused as exc:
        if exc.key != "repository":  # study.base: a field of the spec, not of the request
            error = {"key": exc.key, "message": exc.detail}
            raise HTTPException(422, {"message": str(exc), "errors": [error]}) from None
        raise SourceRefused(exc.key, exc.detail) from None


@router.get("", response_model=schemas.Page[schemas.StudyPublic])
def list_studies(
    s: SessionDep,
    who: Reader,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
) -> schemas.Page[schemas.StudyPublic]:
    """List studies, newest first."""
    count = s.exec(select(func.count()).select_from(Study)).one()
    rows = s.exec(select(Study).order_by(col(Study.id).desc()).offset(offset).limit(limit)).all()
    return schemas.Page(data=serializers.study_publics(s, list(rows)), count=count)


@router.get("/{study_id}", response_model=schemas.StudyPublic)
def read(study_id: StudyId, s: SessionDep, who: Reader) -> schemas.StudyPublic:
    """Return one study."""
    return serializers.study_public(s, get_study(s, study_id))


@router.post("/{study_id}/pause", response_model=schemas.StudyPublic)
def pause(study_id: StudyId, s: SessionDep, who: Operator) -> schemas.StudyPublic:
    """Pause a study: running experiments finish, nothing new starts."""
    get_study(s, study_id)
    st = lifecycle.pause(s, study_id, by=who.name)
    s.commit()
    return serializers.study_public(s, st)


@router.post("/{study_id}/resume", response_model=schemas.StudyPublic)
def resume(study_id: StudyId, s: SessionDep, celery: CeleryDep, who: Operator) -> schemas.StudyPublic:
    """Resume a paused study."""
    get_study(s, study_id)
    st = lifecycle.resume(s, study_id, by=who.name)
    s.commit()
    nudge(celery, study_id)
    return serializers.study_public(s, st)


@router.post("/{study_id}/stop", response_model=schemas.StudyPublic)
def stop(study_id: StudyId, s: SessionDep, celery: CeleryDep, who: Operator) -> schemas.StudyPublic:
    """Stop a study: queued experiments are revoked, running ones cancelled, the report written."""
    st = get_study(s, study_id)
    queued = lifecycle.stop(s, study_id, by=who.name)
    s.commit()
    if queued:
        try:
            celery.control.revoke(queued)
        except BROKER_AWAY:  # a revoked task only saves a worker the look at a cancelled job
            logging.getLogger(__name__).warning("study %s: queued tasks could not be revoked", study_id)
    if st.status == StudyStatus.STOPPING:  # a study stopped while cloning has already ended
        nudge(celery, study_id)
    return serializers.study_public(s, st)


@router.post("/{study_id}/promote", response_model=schemas.Message)
def promote(study_id: StudyId, s: SessionDep, who: Approver) -> schemas.Message:
    """Push the study's trunk to its origin repository as branch `grove/<study>`."""
    st = get_study(s, study_id)
    try:
        target = promote_trunk(s, st, who.name)
    except NotPromotable as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    except gitops.GitError as exc:
        raise HTTPException(status.HTTP_502_BAD_GATEWAY, f"push failed: {exc.stderr.strip()[:500]}") from None
    return schemas.Message(message=f"pushed {st.trunk_commit[:12]} to {st.source} as {target}")


@router.get("/{study_id}/progress", response_model=schemas.Progress)
def read_progress(study_id: StudyId, s: SessionDep, who: Reader) -> schemas.Progress:
    """Return the dev score of each experiment in order, and trunk's dev and held-out scores over time."""
    return serializers.progress(s, get_study(s, study_id))


@router.get("/{study_id}/search", response_model=schemas.SearchSpace)
def read_search_space(study_id: StudyId, s: SessionDep, who: Reader) -> schemas.SearchSpace:
    """Return each measured node's values of the `[search]` keys with its dev score."""
    return serializers.search_space(s, get_study(s, study_id))


@router.get("/{study_id}/importance", response_model=schemas.Importances)
def read_importance(study_id: StudyId, s: SessionDep, who: Reader) -> schemas.Importances:
    """Return how much each `[search]` key sets the best measured nodes apart (PED-ANOVA)."""
    return serializers.importances(s, get_study(s, study_id))


@router.get("/{study_id}/report", response_class=PlainTextResponse)
def read_report(study_id: StudyId, s: SessionDep, who: Reader) -> str:
    """Return the study's REPORT.md (built from its current state)."""
    get_study(s, study_id)
    return report.render(s, study_id)
