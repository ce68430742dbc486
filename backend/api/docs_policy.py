"""The API's documentation pages load nothing from outside: a Content-Security-Policy says so.

Swagger UI and ReDoc come from assets the API serves itself (fastapi-offline), but ReDoc's
bundle still shows Redocly's logo from its CDN; the policy keeps the browser from asking for it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'"
)


class OfflineDocs:
    """ASGI middleware: answer the documentation pages with a same-origin-only policy."""

    def __init__(self, app: ASGIApp, paths: tuple[str, ...] = ("/docs", "/redoc")) -> None:
        self.app, self.paths = app, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; add the policy header to a documentation page's response."""
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return

        async def with_policy(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"content-security-policy", POLICY.encode()),
                ]
            await send(message)

        await self.app(scope, receive, with_policy)
