"""The server's outer wall, an ASGI middleware that runs before any route or parser.

In order, for every HTTP request:
1. the API key (401) on every route but /health and /metrics (those too when asked);
2. POST bodies must say `application/json` (415);
3. bodies larger than the limit are refused (413): at once when Content-Length says so,
   else (chunked) as soon as the bytes read pass it, before anything parses them.
Every refusal is an OpenAI-style error body; none reaches the application.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from hybridserve.entrypoints.openai.limits import ServerLimits

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health", "/metrics")


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


async def send_error(send: Send, status: int, message: str, type_: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = error_body(message, type_, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class HttpGuard:
    def __init__(self, app: ASGIApp, limits: ServerLimits) -> None:
        # (added with app.add_middleware, so inside FastAPI's error handling, before routing)
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if not self._authorized(scope["path"], headers):
            await send_error(send, 401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                             "invalid_request_error", "invalid_api_key",
                             headers=[(b"www-authenticate", b'Bearer realm="hybridserve"')])
            return
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                await send_error(send, 415, f"request bodies must be application/json, got {ctype or 'none'!r}",
                                 "invalid_request_error", "unsupported_media_type")
                return
        limit = self.limits.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > limit:
                await self._too_large(send, limit)
                return
            await self.app(scope, receive, send)  # the HTTP layer holds the body to its declared length
            return
        # A chunked body has no declared length: read it here, up to the limit, and hand
        # the app a replay of it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(send, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(send: Send, limit: int) -> None:
        await send_error(send, 413, f"the request body is larger than the server's limit of {limit} bytes",
                         "invalid_request_error", "request_too_large")

    def _authorized(self, path: str, headers: dict[str, str]) -> bool:
        limits = self.limits
        if limits.api_key is None or (path in OPEN_PATHS and not limits.protect_health_and_metrics):
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and limits.key_matches(token.strip())
