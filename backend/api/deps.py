"""Request dependencies: settings, a database session per request, the Celery app, and the caller's roles."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from celery import Celery
from fastapi import Depends, HTTPException, Path, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlmodel import Session

from backend.core import db, security
from backend.core.config import Settings

bearer = HTTPBearer(auto_error=False, description="A token from `grove token create`")


def get_settings_dep(request: Request) -> Settings:
    """Return the app's settings."""
    settings: Settings = request.app.state.settings
    return settings


def get_celery(request: Request) -> Celery:
    """Return the app's Celery client."""
    app: Celery = request.app.state.celery
    return app


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    """Yield the request's session: committed when the route returns, rolled back if it raises."""
    with db.session(settings.db_url) as s:
        yield s


# scope="function": the commit happens before the response is sent, so a client never sees a 200 for
# a write that did not land.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
MAX_ID = 2**31 - 1
StudyId = Annotated[int, Path(ge=1, le=MAX_ID, description="a study id")]
NodeId = Annotated[int, Path(ge=1, le=MAX_ID, description="a node id")]
Cursor = Annotated[int, Query(ge=0, le=2**62, description="return events with a larger id")]
CeleryDep = Annotated[Celery, Depends(get_celery)]


@dataclass(frozen=True)
class Principal:
    name: str
    roles: frozenset[str]
    token_id: int | None = None


def principal(
    s: SessionDep,
    settings: SettingsDep,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Principal | None:
    """Return who is calling, or None without a valid token."""
    if creds is None:
        return None
    row = security.lookup(s, creds.credentials)
    if row is None and security.is_fleet_token(settings, creds.credentials):
        return Principal("fleet", frozenset({"worker"}))
    if row is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "invalid or revoked token", headers={"WWW-Authenticate": "Bearer"}
        )
    return Principal(row.name or f"token-{row.id}", frozenset(row.roles.split(",")), row.id)


def require(role: str | None) -> Callable[..., Principal]:
    """Return a dependency that needs a token with `role` (None: any token, unless reads are public)."""

    def dep(settings: SettingsDep, who: Annotated[Principal | None, Depends(principal)]) -> Principal:
        if who is None:
            if role is None and settings.public_reads:
                return Principal("anonymous", frozenset({"viewer"}))
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "a bearer token is required",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if role is None and who.roles <= {"worker", "sealed"}:
            raise HTTPException(status.HTTP_403_FORBIDDEN, "a worker token reaches only the worker routes")
        if role is not None and role not in who.roles:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"this needs a token with the {role!r} role")
        return who

    return dep


Reader = Annotated[Principal, Depends(require(None))]
Operator = Annotated[Principal, Depends(require("operator"))]
Approver = Annotated[Principal, Depends(require("approver"))]
Worker = Annotated[Principal, Depends(require("worker"))]
