"""Problem packages (`PUT /v1/problems/{sha256}`, `GET /v1/problems/{sha256}`): a problem's tests,
checker, graders and limits uploaded once and judged by reference (`/v1/judge` with `problem`).

The body is streamed to this host's disk as it arrives, hashed on the way (never held in the
gateway's memory), checked against its name and validated in a child process (`codeenv.problems`).
The same body again is a 200 that changes nothing. A worker that lacks a package fetches it with
GET, signed by the ticket its call carries (the Guard lets a valid ticket stand for the token).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import re
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from codeenv.api.service import Gateway
from codeenv.errors import ApiError, InvalidRequest, ProblemUnavailable
from codeenv.models import PROBLEM_SHA256, ProblemPackage
from codeenv.problems import Sink

PREFIX = "/v1/problems/"
_NAME = re.compile(PROBLEM_SHA256)
#: An upload may be this slow (bytes a second) beyond the body timeout before it is given up.
SLOWEST_UPLOAD = 1 << 20


class ProblemStored(BaseModel):
    """A problem package held here, under its name."""

    sha256: str
    tests: int = Field(description="its test count")
    bytes: int = Field(description="the package's size")
    created: bool = Field(description="false: it was held already (the upload changed nothing)")


def ticketed(gateway: Gateway) -> Any:
    """The Guard's check of a worker's fetch: GET of one package with that package's ticket."""

    def check(scope: dict[str, Any]) -> bool:
        path: str = scope["path"]
        if scope["method"] != "GET" or not path.startswith(PREFIX):
            return False
        name = path[len(PREFIX):]
        given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("ticket", [""])[0]
        return bool(_NAME.fullmatch(name)) and bool(given) and gateway.problems.ticket_ok(name, given)

    return check


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()
    settings, store = gateway.settings, gateway.problems
    name_param = Path(pattern=PROBLEM_SHA256, description="the sha256 of the package's JSON body (lower-case hex)")

    @api.put("/v1/problems/{sha256}", status_code=201, response_model=ProblemStored,
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
                 "$ref": "#/components/schemas/ProblemPackage"}}}}},
             responses={200: {"model": ProblemStored, "description": "held already: nothing changed"},
                        400: {"description": "the body's sha256 is not the name in the path"},
                        413: {"description": "over problem_max_mb"},
                        507: {"description": "the gateway could not store it (its disk)"},
                        415: {"description": "not sent as application/json"},
                        422: {"description": "not a problem package (the message says what to fix)"}})
    async def put_problem(request: Request, sha256: str = name_param) -> Response:
        """Upload a problem package once: its tests, checker, graders and limits (ProblemPackage),
        named by the sha256 of the body; judge submissions against it with `/v1/judge` `problem`."""
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise ApiError(415, f"send the package as JSON with 'Content-Type: application/json' (got "
                                f"{media or 'none'})")
        most = settings.problem_max_mb << 20
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > most:
            raise ApiError(413, f"the package is {declared} bytes; the limit is {most} (problem_max_mb)")
        try:
            tmp = store.temp(sha256)
        except OSError as exc:
            raise ApiError(507, f"the gateway cannot store problems: {exc}") from None
        try:
            size = await _receive(request, tmp, sha256, most, settings.body_timeout_s + most / SLOWEST_UPLOAD)
            count = store.tests(sha256)
            created = count is None
            if created:
                try:
                    count = await store.validate(tmp, settings)
                except InvalidRequest as exc:
                    raise ApiError(422, str(exc)) from None
                except ProblemUnavailable as exc:
                    raise ApiError(500, str(exc)) from None
                store.keep(sha256, tmp, count)
            else:
                tmp.unlink()
        except OSError as exc:  # e.g. its disk is full
            tmp.unlink(missing_ok=True)
            raise ApiError(507, f"the gateway could not store the package: {exc}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        assert count is not None
        stored = ProblemStored(sha256=sha256, tests=count, bytes=size, created=created)
        return JSONResponse(stored.model_dump(), 201 if created else 200)

    @api.get("/v1/problems/{sha256}", response_class=StreamingResponse,
             responses={200: {"description": "the package's JSON body", "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/ProblemPackage"}}}},
                        404: {"description": "not held here"}})
    async def get_problem(sha256: str = name_param) -> Response:
        """A problem package held here, as it was uploaded (its workers fetch it so)."""
        try:
            if store.tests(sha256) is None:
                raise FileNotFoundError
            fd = os.open(store.path(sha256), os.O_RDONLY | os.O_CLOEXEC)  # held open: the LRU may remove it
        except FileNotFoundError:
            raise ApiError(404, f"problem {sha256} is not held here") from None
        size = os.fstat(fd).st_size

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while chunk := await asyncio.to_thread(os.read, fd, 1 << 20):
                    yield chunk
            finally:
                os.close(fd)

        return StreamingResponse(chunks(), media_type="application/json", headers={"Content-Length": str(size)})

    return api


async def _receive(request: Request, tmp: pathlib.Path, sha256: str, most: int, timeout_s: float) -> int:
    """Stream the body into `tmp`, hashed on the way; its size. ApiError for one over `most`
    bytes, not in within `timeout_s`, or whose sha256 is not `sha256`."""
    digest = hashlib.sha256()
    size = 0
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            with Sink(tmp) as sink:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > most:
                        raise ApiError(413, f"the package is over the limit of {most} bytes (problem_max_mb)")
                    digest.update(chunk)
                    sink.write(chunk)
    except TimeoutError:
        raise ApiError(408, f"the package did not arrive within {time.monotonic() - started:.0f}s; send it "
                            "whole, promptly", {"Connection": "close"}) from None
    if digest.hexdigest() != sha256:
        raise ApiError(400, f"the body's sha256 is {digest.hexdigest()}, not {sha256}: a package is named by the "
                            "sha256 of the exact bytes sent")
    return size


#: The body's schema, for the OpenAPI document.
MODELS = (ProblemPackage,)
