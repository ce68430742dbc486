"""Bearer tokens: issued once, stored as SHA-256 hashes, each with roles."""

from __future__ import annotations

import hashlib
import secrets

from sqlmodel import Session, select

from backend.core import db
from backend.core.config import Settings
from backend.core.models import ApiToken

ROLES = ("viewer", "operator", "approver")


def hash_token(token: str) -> str:
    """Return the stored form of a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(settings: Settings, roles: list[str], name: str = "") -> str:
    """Issue a token with the given roles and return it (it is not stored in clear)."""
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles:
        raise ValueError(f"unknown role {bad[0] if bad else ''!r}; roles are {', '.join(ROLES)}")
    token = "grove_" + secrets.token_urlsafe(32)
    with db.session(settings.db_url) as s:
        s.add(ApiToken(name=name, roles=",".join(sorted(set(roles))), token_hash=hash_token(token)))
    return token


def lookup(s: Session, token: str) -> ApiToken | None:
    """Return the live token row for a presented token."""
    digest = hash_token(token)
    row = s.exec(select(ApiToken).where(ApiToken.token_hash == digest)).first()
    if row is None or row.revoked or not secrets.compare_digest(row.token_hash, digest):
        return None
    return row
