"""Request body cap: a body over the limit gets 413 before it is read whole."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """ASGI middleware: refuse bodies over `max_bytes`, by Content-Length or while they stream in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, counting its body; answer 413 once it is too large."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
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
            if seen > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": f"request body over {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
