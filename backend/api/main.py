"""The FastAPI application: `/api/v1`, OpenAPI at `/docs` and `/redoc` (served offline)."""

from __future__ import annotations

import gc

from fastapi import APIRouter, FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline

from agents.spec import SpecError
from agents.tree.status import IllegalStudyTransition
from backend.api.docs_policy import OfflineDocs
from backend.api.limits import BodyLimit, caps, token_roles
from backend.api.routes import (
    approvals,
    events,
    health,
    learning,
    learning_worker,
    memory,
    studies,
    tree,
    worker,
)
from backend.core import fanout
from backend.core.config import Settings, get_settings
from backend.core.gitops import GitError
from backend.services.spec_errors import repository_error
from backend.services.studies import SourceRefused, StudyExists
from backend.worker.celery_app import make_app

API_PREFIX = "/api/v1"


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the API app for the given settings."""
    settings = settings or get_settings()
    if settings.fleet_token and len(settings.fleet_token) < 32:
        raise ValueError("GROVE_FLEET_TOKEN: use at least 32 random characters (e.g. `openssl rand -hex 32`)")
    settings.ensure_dirs()
    # Swagger UI and ReDoc from assets the package ships: /docs works with no network outside.
    app = FastAPIOffline(
        title="Grove",
        version="0.1.0",
        description="Autonomous research over a git repository: studies, hypothesis trees, sealed gates.",
        generate_unique_id_function=lambda r: f"{r.tags[0]}-{r.name}" if r.tags else r.name,
    )
    app.state.settings = settings
    app.state.sse_open = {}
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, larger=caps(settings, API_PREFIX), roles=token_roles(settings)
    )  # fmt: skip
    app.add_middleware(OfflineDocs)
    app.state.celery = make_app(settings)
    fanout.enable(settings.redis_url)
    api = APIRouter(prefix=API_PREFIX)
    for module in (studies, tree, approvals, events, learning, memory, health, worker, learning_worker):
        api.include_router(module.router)
    app.include_router(api)

    @app.exception_handler(SpecError)
    async def spec_error(request: Request, exc: SpecError) -> JSONResponse:
        errors = [{"key": f"spec.{i.key}" if i.key else "spec", "message": i.message} for i in exc.issues]
        message = "; ".join(f"{e['key']}: {e['message']}" for e in errors)
        return JSONResponse(
            {"detail": {"message": message, "errors": errors}}, status.HTTP_422_UNPROCESSABLE_CONTENT
        )

    @app.exception_handler(StudyExists)
    async def exists(request: Request, exc: StudyExists) -> JSONResponse:
        error = {"key": "spec.study.name", "message": str(exc)}
        return JSONResponse(
            {"detail": {"message": f"spec.study.name: {exc}", "errors": [error]}}, status.HTTP_409_CONFLICT
        )

    @app.exception_handler(SourceRefused)
    async def refused(request: Request, exc: SourceRefused) -> JSONResponse:
        error = {"key": exc.key, "message": exc.detail}
        return JSONResponse(
            {"detail": {"message": str(exc), "errors": [error]}}, status.HTTP_422_UNPROCESSABLE_CONTENT
        )

    @app.exception_handler(IllegalStudyTransition)
    async def illegal(request: Request, exc: IllegalStudyTransition) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_409_CONFLICT)

    @app.exception_handler(FileNotFoundError)
    @app.exception_handler(GitError)
    async def repo_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": repository_error(exc)}, status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"key": ".".join(str(p) for p in e["loc"] if p != "body"), "message": e["msg"]}
            for e in exc.errors()
        ]
        message = "; ".join(f"{e['key']}: {e['message']}" for e in errors)
        return JSONResponse(
            {"detail": {"message": message, "errors": errors}}, status.HTTP_422_UNPROCESSABLE_CONTENT
        )

    # Everything imported so far lives as long as the process: keep it out of the collector's
    # full passes, which otherwise scan it all and stall a large response (p95 of GET /tree).
    gc.freeze()
    return app
