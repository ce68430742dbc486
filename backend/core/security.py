"""Bearer tokens: issued once, stored as SHA-256 hashes, each with roles."""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime, timedelta

from sqlmodel import Session, col, select

from backend.core import db
from backend.core.config import Settings
from backend.core.models import ApiToken, now

# `sealed`: a worker trusted with held-out data (it may claim sealed jobs); the server's own need none.
ROLES = ("viewer", "operator", "approver", "worker", "sealed")
SEALED_ROLE = "sealed"


def hash_token(token: str) -> str:
    """Return the stored form of a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(
    settings: Settings, roles: list[str], name: str = "", *, expires_days: float | None = None
) -> str:
    """Issue a token with the given roles and return it (it is not stored in clear)."""
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles:
        raise ValueError(f"unknown role {bad[0] if bad else ''!r}; roles are {', '.join(ROLES)}")
    token = "grove_" + secrets.token_urlsafe(32)
    expires = now() + timedelta(days=expires_days) if expires_days is not None else None
    with db.session(settings.db_url) as s:
        s.add(
            ApiToken(
                name=name,
                roles=",".join(sorted(set(roles))),
                token_hash=hash_token(token),
                expires_at=expires,
            )
        )
    return token


def _state(row: ApiToken) -> str:
    if row.revoked:
        return "revoked"
    if row.expires_at is not None and _aware(row.expires_at) <= now():
        return "expired"
    return "live"


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def list_tokens(settings: Settings) -> list[tuple[ApiToken, str]]:
    """Return every token row with its state: live, expired or revoked."""
    with db.session(settings.db_url) as s:
        rows = list(s.exec(select(ApiToken).order_by(col(ApiToken.id))))
        for r in rows:
            s.expunge(r)
    return [(r, _state(r)) for r in rows]


def revoke_token(settings: Settings, ident: str) -> int:
    """Revoke the tokens with this id or name; raise LookupError if there are none."""
    with db.session(settings.db_url) as s:
        query = select(ApiToken).where(
            (ApiToken.id == int(ident)) if ident.isdigit() else (ApiToken.name == ident)
        )
        rows = [r for r in s.exec(query) if not r.revoked]
        if not rows:
            raise LookupError(f"no live token with id or name {ident!r}")
        for r in rows:
            r.revoked = True
            s.add(r)
        return len(rows)


def lookup(s: Session, token: str) -> ApiToken | None:
    """Return the live token row for a presented token."""
    digest = hash_token(token)
    row = s.exec(select(ApiToken).where(ApiToken.token_hash == digest)).first()
    if row is None or _state(row) != "live" or not secrets.compare_digest(row.token_hash, digest):
        return None
    return row


def is_fleet_token(settings: Settings, token: str) -> bool:
    """Return whether a token is the deployment's shared worker token (`GROVE_FLEET_TOKEN`)."""
    fleet = settings.fleet_token or ""
    return len(fleet) >= 32 and secrets.compare_digest(fleet.encode(), token.encode())
