"""ASGI middleware in front of every route: the token, then a JSON body read, capped and parsed once.

Bodies are read once, size-capped (413) and parsed here (400 for malformed or too deeply nested
JSON), so bad input always gets a 4xx that says what to fix, never a 5xx.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Iterable
from typing import Any

from fastapi.responses import JSONResponse

from codeenv.errors import ApiError
from codeenv.settings import GatewaySettings

#: Where Guard leaves the time (monotonic) a request arrived: its calls' queue wait starts there.
ACCEPTED = "codeenv.accepted"
#: Where Guard leaves a request's parsed JSON body.
JSON_BODY = "codeenv.json"


class Guard:
    """The token, then the body of the POST routes that take JSON (`json_paths`).

    The body is read here once, capped (413) and parsed (400), and left in the scope; the app then
    sees an empty body followed by the client's real messages, so an endpoint can still notice
    the client hanging up (http.disconnect) while its calls wait.
    """

    def __init__(self, app: Any, settings: GatewaySettings, json_paths: Iterable[str]) -> None:
        self.app = app
        self.settings = settings
        self.json_paths = frozenset(json_paths)
        self.expected = f"Bearer {settings.token}".encode() if settings.token is not None else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ACCEPTED] = time.monotonic()
        try:
            if self.expected is not None:
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected):
                    raise ApiError(401, "missing or wrong token: send 'Authorization: Bearer <token>'")
            if scope["method"] == "POST" and scope["path"] in self.json_paths:
                body = await self._read_body(scope, receive)
                if body is None:
                    return  # the client went away while sending
                try:
                    scope[JSON_BODY] = json.loads(body)
                except RecursionError:  # the C decoder refuses nesting past the recursion limit
                    raise ApiError(400, "the JSON body is nested too deeply") from None
                except ValueError as exc:
                    raise ApiError(400, f"the body is not valid JSON: {exc}") from None
                replayed = False

                async def replay() -> dict[str, Any]:
                    nonlocal replayed
                    if not replayed:
                        replayed = True
                        return {"type": "http.request", "body": b"", "more_body": False}
                    message: dict[str, Any] = await receive()
                    return message

                await self.app(scope, replay, send)
                return
        except ApiError as exc:
            await JSONResponse({"detail": exc.detail}, exc.status_code, exc.headers)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _read_body(self, scope: dict[str, Any], receive: Any) -> bytes | None:
        max_bytes = self.settings.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > max_bytes:
            raise ApiError(413, f"the body is {int(declared)} bytes; the limit is {max_bytes}")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, f"the body is over the limit of {max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
