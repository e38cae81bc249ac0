"""Live sessions over HTTP (`/v1/sessions`): create, run cells, fork, delete, list.

Cells of many sessions can also go in one `/v1/execute/batch` or `/v1/execute/stream` request: an
item that names a `session` runs as that session's next cell. Sessions live in the worker that owns
them: in embedded mode (`codeenv serve`) that is this process's pool; behind `serve --processes N`
the host's pool process; with Redis the worker that created them, whichever gateway is asked
(`codeenv.queue.remote_sessions`). A queue that runs none (a test's own) answers 501.

A session belongs to whoever created it: every request about it must carry the same
`X-Codeenv-Session-Key` header (a secret of the client's; one is made and returned as `session_key`
when a POST /v1/sessions comes without it). Another key gets 404, as for an id that never existed,
and the listing shows only the caller's own sessions.
"""

from __future__ import annotations

import logging
import re
import secrets
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from codeenv.api.service import NO_SESSIONS, Gateway, body_schema, owner, parse, session_key
from codeenv.api.statuses import SESSION_CELL, answered, session_error, session_start_failed
from codeenv.errors import ApiError, InvalidRequest, SandboxError, SessionError, session_not_found
from codeenv.models import (
    ExecResult,
    ForkList,
    SessionCell,
    SessionCreate,
    SessionFork,
    SessionInfo,
    SessionList,
    SnapshotCreate,
    SnapshotInfo,
)
from codeenv.queue.base import SessionService

logger = logging.getLogger("codeenv.api")

PREFIX = "/v1/sessions"
SNAPSHOTS = "/v1/snapshots"
ERRORS: dict[int | str, dict[str, Any]] = {404: {"description": "no such session of yours: it never existed here, "
                                                                 "or it was created with another session key"},
          410: {"description": "the session ended (expired, evicted, deleted, or its worker restarted)"},
          422: {"description": "the request cannot be run as sent"},
          429: {"description": "the worker holds as many sessions as it may: retry after Retry-After seconds"},
          501: {"description": "this gateway's queue does not run sessions"},
          503: {"description": "a session could not start on this worker"}}
SNAPSHOT_ERRORS: dict[int | str, dict[str, Any]] = {
    **{k: v for k, v in ERRORS.items() if k not in (404, 410, 503)},
    404: {"description": "no such snapshot of yours: it never existed here, or it was taken with another "
                         "session key"},
    410: {"description": "the snapshot ended (its TTL ran out, it was deleted or evicted, or its worker "
                         "restarted)"}}
FORKS_FULL = {"description": "its family holds as many sessions as one may, or its fork cannot be kept apart"}


class RedactSessionIds(logging.Filter):
    """Session ids are secrets (with the key, they are the session): no log line shows one. Installed
    on uvicorn's access log, whose lines carry each request's path."""

    PATH = re.compile(r"(/v1/(?:sessions|snapshots)/)[^/?#\s\"]+")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.PATH.sub(r"\1<id>", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = self.PATH.sub(r"\1<id>", record.msg)
        return True


def redact_access_log(name: str = "uvicorn.access") -> None:
    """Have logger `name` drop session ids from its lines (once, however many apps are made)."""
    access = logging.getLogger(name)
    if not any(isinstance(f, RedactSessionIds) for f in access.filters):
        access.addFilter(RedactSessionIds())


def is_json_route(method: str, path: str) -> bool:
    """The session and snapshot routes that take a JSON body (the Guard reads and parses it)."""
    if method != "POST":
        return False
    if path == PREFIX:
        return True
    if path.startswith(PREFIX + "/"):
        return path.endswith(("/execute", "/fork", "/snapshot"))
    return path.startswith(SNAPSHOTS + "/") and path.endswith("/fork")


def session_service(gateway: Gateway) -> SessionService:
    """The sessions of the queue behind this gateway; ApiError 501 if it runs none."""
    service = gateway.sessions
    if service is None:
        raise ApiError(501, NO_SESSIONS.format(queue=type(gateway.queue).__name__))
    return service


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()
    _all_sessions(api, gateway)
    _one_session(api, gateway)
    _snapshots(api, gateway)
    return api


def _all_sessions(api: APIRouter, gateway: Gateway) -> None:
    """Create a session, list the caller's."""

    @api.post(PREFIX, status_code=201, response_model=SessionInfo,
              openapi_extra=body_schema("SessionCreate", required=False),
              responses={**{k: v for k, v in ERRORS.items() if k not in (404, 410)},
                         403: {"description": "a host function's URL is not one this worker's operator allows "
                                              "(CODEENV_HOST_FUNCTION_URLS)"},
                         409: {"description": "you have a live session of the session_id you chose"}})
    async def create(request: Request) -> Response:
        """Start a live session: an interpreter whose globals, imports, open files and work dir last
        from cell to cell, until it is deleted or idle for `idle_ttl_s`."""
        body = parse(request, SessionCreate)
        service = session_service(gateway)
        key = session_key(request)
        made = None if key is not None else secrets.token_urlsafe(32)
        try:
            info = await service.create(body.profile, body.limits, body.idle_ttl_s, owner(key or made), body.session_id,
                                        body.host())
        except SessionError as exc:
            raise session_error(exc) from None
        except InvalidRequest as exc:
            raise ApiError(422, str(exc)) from None
        except SandboxError as exc:  # e.g. a host whose kernel refuses a family's namespaces
            logger.error("a session could not start: %s", exc)
            raise session_start_failed(exc) from None
        info.session_key = made
        return JSONResponse(info.model_dump(exclude_none=True), 201, {"Location": f"{PREFIX}/{info.session_id}"})

    @api.get(PREFIX, response_model=SessionList, responses={501: ERRORS[501], 422: ERRORS[422]})
    async def listing(request: Request) -> SessionList:
        """The caller's live sessions and snapshots (those created with its X-Codeenv-Session-Key): for
        each its worker, age, idle time, cells, CPU time and memory."""
        service = session_service(gateway)
        infos = await service.describe(owner(session_key(request)))
        return SessionList(sessions=[i for i in infos if i.kind == "session"],
                           snapshots=[SnapshotInfo.of(i) for i in infos if i.kind == "snapshot"])


def _one_session(api: APIRouter, gateway: Gateway) -> None:
    """Show one session, run its next cell, fork it, delete it."""

    @api.get(PREFIX + "/{session_id}", response_model=SessionInfo, responses={
        k: v for k, v in ERRORS.items() if k not in (429, 503)})
    async def show(session_id: str, request: Request) -> SessionInfo:
        """One live session of the caller."""
        try:
            return await session_service(gateway).lookup(session_id, owner(session_key(request)))
        except SessionError as exc:
            raise session_error(exc) from None

    @api.post(PREFIX + "/{session_id}/execute", response_model=ExecResult, openapi_extra=body_schema("SessionCell"),
              responses={**ERRORS, 409: {"description": "its id names another call: use a new id"},
                         410: {"model": ExecResult, "description": "the session ended: the cell's "
                                                                   "result says session_lost"},
                         429: {"model": ExecResult, "description": "overloaded (not run): retry after Retry-After "
                                                                   "seconds"}})
    async def execute(session_id: str, request: Request) -> Response:
        """Run the next cell: the result of /v1/execute, plus `value` (the repr of its last
        expression), `execution_count` and `rolled_back` (a cell stopped by a limit leaves the
        session exactly as before it)."""
        cell = parse(request, SessionCell)
        session_service(gateway)
        try:
            call = cell.to_request(session_id)
        except ValidationError:  # an id no session can have (too long, not text): none of the caller's
            raise session_error(session_not_found(session_id)) from None
        [result] = await gateway.answer(request, [call])
        code, headers = answered(result, SESSION_CELL)  # a refused cell: its 4xx (404 for no such session)
        return Response(result.encoded(), code, headers, media_type="application/json")

    @api.post(PREFIX + "/{session_id}/fork", status_code=201, response_model=SessionInfo | ForkList,
              openapi_extra=body_schema("SessionFork", required=False),
              responses={**{k: v for k, v in ERRORS.items() if k != 503}, 409: FORKS_FULL})
    async def fork(session_id: str, request: Request) -> Response:
        """New sessions from this one's current state (copy-on-write; its work dir is copied), the
        caller's too: one (answered as a session), or `count` made at once (the N samples of a GRPO
        group from their shared prefix), each in a Landlock domain and cgroup of its own. A fork asked
        for while a cell runs waits for the cell to end."""
        return await _forks(gateway, request, session_id, snapshot=False)

    @api.post(PREFIX + "/{session_id}/snapshot", status_code=201, response_model=SnapshotInfo,
              openapi_extra=body_schema("SnapshotCreate", required=False),
              responses={**{k: v for k, v in ERRORS.items() if k != 503}, 409: FORKS_FULL})
    async def snapshot(session_id: str, request: Request) -> Response:
        """Keep the session's current state (after its running cell, if any) as a snapshot: it runs no
        cell, its work dir is held in its memory, and it can be forked (POST /v1/snapshots/{id}/fork)
        until its TTL runs out or it is deleted, after the session itself ended too. It counts as a
        session against the worker's and the caller's most, and lives in the session's family."""
        body = parse(request, SnapshotCreate)
        try:
            info = await session_service(gateway).snapshot(session_id, owner(session_key(request)), body.ttl_s)
        except SessionError as exc:
            raise session_error(exc) from None
        except InvalidRequest as exc:
            raise ApiError(422, str(exc)) from None
        taken = SnapshotInfo.of(info)
        return JSONResponse(taken.model_dump(), 201, {"Location": f"{SNAPSHOTS}/{taken.snapshot_id}"})

    @api.delete(PREFIX + "/{session_id}", status_code=204, responses={
        k: v for k, v in ERRORS.items() if k not in (429, 503)})
    async def delete(session_id: str, request: Request) -> Response:
        """End a session: its processes and files are gone when this answers."""
        try:
            await session_service(gateway).delete(session_id, owner(session_key(request)))
        except SessionError as exc:
            raise session_error(exc) from None
        return Response(status_code=204)


def _snapshots(api: APIRouter, gateway: Gateway) -> None:
    """Fork a snapshot, delete it (the caller's are listed with its sessions)."""

    @api.post(SNAPSHOTS + "/{snapshot_id}/fork", status_code=201, response_model=SessionInfo | ForkList,
              openapi_extra=body_schema("SessionFork", required=False), responses={**SNAPSHOT_ERRORS, 409: FORKS_FULL})
    async def fork_snapshot(snapshot_id: str, request: Request) -> Response:
        """New sessions from the snapshot's state, the caller's: one (answered as a session), or `count`
        made at once. Each fork's work dir is written from what the snapshot holds."""
        return await _forks(gateway, request, snapshot_id, snapshot=True)

    @api.delete(SNAPSHOTS + "/{snapshot_id}", status_code=204, responses=SNAPSHOT_ERRORS)
    async def delete_snapshot(snapshot_id: str, request: Request) -> Response:
        """End a snapshot (its forks live on)."""
        try:
            await session_service(gateway).delete(snapshot_id, owner(session_key(request)), snapshot=True)
        except SessionError as exc:
            raise session_error(exc) from None
        return Response(status_code=204)


async def _forks(gateway: Gateway, request: Request, source_id: str, snapshot: bool) -> Response:
    body = parse(request, SessionFork)
    try:
        forks = await session_service(gateway).fork(source_id, owner(session_key(request)), body.count or 1, snapshot)
    except SessionError as exc:
        raise session_error(exc) from None
    except InvalidRequest as exc:
        raise ApiError(422, str(exc)) from None
    if body.count is None:
        [child] = forks
        return JSONResponse(child.model_dump(), 201, {"Location": f"{PREFIX}/{child.session_id}"})
    made = ForkList(session_ids=[f.session_id for f in forks], sessions=forks)
    return JSONResponse(made.model_dump(), 201)
