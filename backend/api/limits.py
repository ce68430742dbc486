"""Request body caps, per route, checked before a body is read: the caller's token first, then its size.

A request that carries a body is answered 401 unless it presents a live token (413 if it announces
more than its route's cap), before a byte of the body is read; a route with a larger cap (a
worker's bundle) also needs the worker role there. A body that streams past its cap gets 413.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.core import db, security
from backend.core.config import Settings


@dataclass(frozen=True)
class Cap:
    """A route's body cap: paths matching `pattern` may send `max_bytes`, with a token holding `role`."""

    pattern: re.Pattern[str]
    max_bytes: int
    role: str | None = None


def caps(settings: Settings, prefix: str) -> list[Cap]:
    """Return the routes whose bodies may be larger than `max_body_bytes`, with what they need."""
    w = re.escape(f"{prefix}/worker/")
    calls = max(settings.max_body_bytes, settings.max_call_bytes)
    return [
        Cap(re.compile(rf"{w}jobs/\d+/publish"), settings.max_upload_bytes, "worker"),
        Cap(
            re.compile(rf"{w}jobs/\d+/outputs/.+"),
            max(settings.max_body_bytes, settings.output_cap_bytes),
            "worker",
        ),
        Cap(re.compile(rf"{w}jobs/\d+/call/[^/]+"), calls, "worker"),
        Cap(re.compile(rf"{w}git/\d+/git-upload-pack"), calls, "worker"),
    ]


def token_roles(settings: Settings) -> Callable[[str], frozenset[str] | None]:
    """Return a function giving a presented token's roles, or None for no live token."""

    def roles(token: str) -> frozenset[str] | None:
        if security.is_fleet_token(settings, token):
            return frozenset({"worker"})
        with db.session(settings.db_url) as s:
            row = security.lookup(s, token)
            return None if row is None else frozenset(row.roles.split(","))

    return roles


def _has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length", b"").strip()
    return b"transfer-encoding" in headers or (length != b"" and length != b"0")


class BodyLimit:
    """ASGI middleware: authenticate a request that has a body, then refuse it over its route's cap."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        larger: list[Cap] | None = None,
        roles: Callable[[str], frozenset[str] | None] | None = None,
    ) -> None:
        self.app, self.max_bytes, self.larger, self.roles = app, max_bytes, larger or [], roles

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, counting its body; answer 401 or 413 before reading what it should not."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if not _has_body(headers):
            await self.app(scope, receive, send)
            return
        route = next((c for c in self.larger if c.pattern.fullmatch(scope["path"])), None)
        cap, role = (route.max_bytes, route.role) if route else (self.max_bytes, None)
        if self.roles is not None:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            held = await run_in_threadpool(self.roles, token.strip()) if scheme.lower() == "bearer" else None
            if held is None:
                await _answer(send, 401, "a bearer token is required to send a body", bearer=True)
                return
            if role is not None and role not in held:
                await _answer(send, 403, f"this needs a token with the {role!r} role")
                return
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > cap:
            await _answer(send, 413, f"request body over {cap} bytes")
            return
        # The body is read here, up to the cap, and replayed: a route never sees an oversized one.
        buffered: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > cap:
                await _answer(send, 413, f"request body over {cap} bytes")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)


async def _answer(send: Send, code: int, detail: str, bearer: bool = False) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if bearer:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
