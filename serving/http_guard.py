"""HttpGuard: the ASGI middleware in front of the HTTP app — API keys and the body-size limit.

Runs before FastAPI reads anything: a request without a valid key gets 401 (with
``WWW-Authenticate: Bearer``) and its body is never read; a ``Content-Length`` over
``max_body_bytes`` gets 413 at once; a chunked body is counted as it arrives and stops with 413
as soon as it passes the limit (nothing over the limit is buffered). Error bodies are the
OpenAI-style ``{"error": {"message", "type", "code"}}`` of the rest of the API.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException

from serving.auth import UNAUTHENTICATED_MESSAGE, ApiKeys
from serving.errors import Status
from serving.metrics import ServingMetrics

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def error_body(status: Status, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": status.label, "code": status.http_status}}


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a streamed body passes the limit; FastAPI lets an
    HTTPException through its body parsing, and the app's handler turns it into a 413."""

    def __init__(self, limit: int):
        super().__init__(Status.TOO_LARGE.http_status, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return f"request body is over this server's limit max_body_bytes={limit}"


class HttpGuard:
    """Wraps an ASGI app; ``limit`` is the body-size limit in bytes."""

    def __init__(self, app: Any, keys: ApiKeys, limit: int, metrics: ServingMetrics):
        self.app, self.keys, self.limit, self.metrics = app, keys, limit, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if not self.keys.is_open_http_path(scope.get("path", "")) and not self.keys.allows(
            headers.get(b"authorization")
        ):
            self.metrics.outcome(Status.UNAUTHENTICATED.label)
            extra = [(b"www-authenticate", b"Bearer")]
            await _respond(send, Status.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE, extra)
            return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            self.metrics.outcome(Status.TOO_LARGE.label)
            await _respond(send, Status.TOO_LARGE, too_large_message(self.limit))
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    self.metrics.outcome(Status.TOO_LARGE.label)
                    raise BodyTooLarge(self.limit)
            return message

        return counted


async def _respond(
    send: Send, status: Status, message: str, headers: list[tuple[bytes, bytes]] = ()
) -> None:
    body = json.dumps(error_body(status, message)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    start = {"type": "http.response.start", "status": status.http_status}
    await send({**start, "headers": head + list(headers)})
    await send({"type": "http.response.body", "body": body})
