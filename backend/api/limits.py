"""Request body cap: a body over the limit gets 413 before it is read whole."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """ASGI middleware: refuse bodies over `max_bytes`, by Content-Length or while they stream in."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.larger = larger or {}  # path prefix -> its own cap (workers' uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, counting its body; answer 413 once it is too large."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = next((n for p, n in self.larger.items() if scope["path"].startswith(p)), self.max_bytes)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > cap:
            await self._refuse(send, cap)
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
                await self._refuse(send, cap)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, cap: int) -> None:
        body = json.dumps({"detail": f"request body over {cap} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
