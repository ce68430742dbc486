"""Health and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sqlmodel import func, select

from backend.api import schemas
from backend.api.deps import Reader, SessionDep, SettingsDep
from backend.core import db
from backend.core.locks import client
from backend.core.models import Approval, Job, Node, Study

router = APIRouter(tags=["health"])


@router.get("/health", response_model=dict[str, str])
def health(settings: SettingsDep) -> dict[str, str]:
    """Report whether the database and Redis answer."""
    out = {"status": "ok", "database": "ok", "redis": "ok"}
    try:
        with db.session(settings.db_url) as s:
            s.exec(select(1)).one()
    except Exception as exc:
        out["database"], out["status"] = f"error: {type(exc).__name__}", "degraded"
    try:
        client(settings.redis_url).ping()
    except Exception as exc:
        out["redis"], out["status"] = f"error: {type(exc).__name__}", "degraded"
    return out


@router.get("/whoami", response_model=schemas.Me)
def whoami(who: Reader) -> schemas.Me:
    """Return the name and roles of the token the request carries."""
    return schemas.Me(name=who.name, roles=sorted(who.roles))


@router.get("/metrics", response_class=Response)
def metrics(s: SessionDep) -> Response:
    """Expose counts of studies, nodes, jobs and approvals by status for Prometheus."""
    registry = CollectorRegistry()
    for name, model in (("studies", Study), ("nodes", Node), ("jobs", Job), ("approvals", Approval)):
        g = Gauge(f"grove_{name}", f"Grove {name} by status", ["status"], registry=registry)
        for status_, count in s.exec(select(model.status, func.count()).group_by(model.status)):
            g.labels(status=status_).set(count)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
