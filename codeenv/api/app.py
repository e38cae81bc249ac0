"""The HTTP gateway: the native API and the compatibility APIs over a call queue.

Usage::

    app = create_app(settings, queue)          # serve with uvicorn; OpenAPI at /docs

Which queue (embedded pool, the host's pool socket, Redis) is the caller's choice: `codeenv.topology`
builds it from the settings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from codeenv.api import compat, contract, judging, mcp, native, nemo, piston, problems, routers, sessions
from codeenv.api.body import BodyParser, return_large_frees
from codeenv.api.guard import Guard, Matcher, direct_routes, templated_routes
from codeenv.api.metrics import Metrics
from codeenv.api.service import Gateway
from codeenv.errors import ApiError
from codeenv.models import (
    ExecRequest,
    JudgeRequest,
    Limits,
    SessionCell,
    SessionCreate,
    SessionFork,
    SnapshotCreate,
)
from codeenv.queue.base import CallQueue, declared_profiles
from codeenv.settings import GatewaySettings
from codeenv.stopping import drain_on_signals, freeze_startup

if TYPE_CHECKING:
    from codeenv.worker.redis import StreamWorker

LAG_PROBE_S = 0.5
#: Where the gateway serves the documentation pages' JavaScript, CSS and icon.
DOCS_ASSETS = "/docs/assets"
#: How long before the queue gives up on running calls a local Redis worker stops them (and writes
#: their `killed` results).
WORKER_CUT_AHEAD_S = 0.7


class Stopping:
    """What a stop signal drains: the queue, and the Redis worker sharing this process (it stops
    claiming, hands back what it has not started, and gives its running calls until `until`)."""

    def __init__(self, queue: CallQueue, worker: StreamWorker | None) -> None:
        self.queue, self.worker = queue, worker
        self._worker_stop: asyncio.Task[None] | None = None

    def drain(self, until: float) -> None:
        self.queue.drain(until)
        if self.worker is not None and self._worker_stop is None:
            # Its running calls are cut a little before the queue stops waiting, so their answers arrive.
            grace = max(0.0, until - time.monotonic() - WORKER_CUT_AHEAD_S)
            self._worker_stop = asyncio.create_task(self.worker.stop(grace_s=grace))

    def force(self) -> None:
        self.queue.force()
        if self.worker is not None:
            self.worker.force()

    async def worker_stopped(self) -> None:
        assert self.worker is not None
        if self._worker_stop is None:
            self._worker_stop = asyncio.create_task(self.worker.stop())
        await self._worker_stop


def create_app(settings: GatewaySettings, queue: CallQueue, *, worker: StreamWorker | None = None,
               freeze: bool = False) -> FastAPI:
    """The gateway over `queue`, which it starts and closes with the app's lifespan (and `worker`, a
    Redis worker sharing this process, started before the queue and stopped after it). `freeze`: the
    process is the service's own (`codeenv serve`): once started, what it made is kept out of the
    garbage collector's scans (stopping.freeze_startup; not for an app among others, as in tests)."""
    metrics = Metrics(queue)
    parser = BodyParser()  # the Guard's; its helper processes end with the app
    gateway = Gateway(settings, queue, metrics)
    mcp_endpoints = mcp.McpEndpoints(gateway)
    sessions.redact_access_log()

    async def measure_lag() -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)
            metrics.loop_lag.set(max(0.0, time.monotonic() - t0 - LAG_PROBE_S))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        return_large_frees()  # what a large body took goes back to the system with it
        if worker is not None:
            await worker.start()
        try:
            await queue.start()
        except BaseException:
            if worker is not None:
                await worker.stop(grace_s=0)
            raise
        probe = asyncio.create_task(measure_lag(), name="codeenv-loop-lag")
        if freeze:
            freeze_startup()
        stopping = Stopping(queue, worker)
        restore_signals = drain_on_signals(stopping, settings.shutdown_grace_s)
        try:
            async with mcp_endpoints.running():
                yield
        finally:
            restore_signals()
            probe.cancel()
            await queue.close()
            if worker is not None:
                await stopping.worker_stopped()
            await parser.close()
            await gateway.problems.close()
            metrics.process_exit()

    # /docs (Swagger UI) and /redoc load their scripts and styles from DOCS_ASSETS, served here from
    # an installed package: training clusters seldom reach a CDN (nor Swagger UI's online validator).
    app = FastAPIOffline(title="codeenv", version="0.1.0", lifespan=lifespan, static_url=DOCS_ASSETS,
                         swagger_ui_parameters={"validatorUrl": None},
                         description="Run untrusted Python in jails, with hard limits and structured results.")
    json_paths = (native.JSON_PATHS | judging.JSON_PATHS | routers.JSON_PATHS | compat.CODE_JUDGE_JSON_PATHS
                  | compat.SANDBOX_FUSION_JSON_PATHS | nemo.JSON_PATHS | piston.JSON_PATHS)
    direct: dict[str, Any] = {}  # filled below, once the routes exist
    templated: list[Matcher] = []
    app.add_middleware(Guard, settings=settings, json_paths=json_paths, json_route=sessions.is_json_route,
                       parser=parser, ticketed=problems.ticketed(gateway), direct=direct, templated=templated,
                       handlers=app.exception_handlers)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return JSONResponse({"detail": exc.detail}, exc.status_code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method of the path, not only the first route's
            allowed = {m for route in app.router.routes if isinstance(route, Route)
                       and route.matches({"type": "http", "path": request.url.path, "method": ""})[0] != Match.NONE
                       for m in (route.methods or ())}
            headers["Allow"] = ", ".join(sorted(allowed))
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers)

    # The routes go onto the app's own router: an included router stays a nested router that every
    # request walks through (measured: +14% Python calls per /v1/execute, +38% per /run_code).
    for api in (native.router(gateway), judging.router(gateway), compat.code_judge_router(gateway),
                compat.sandbox_fusion_router(gateway), routers.router(gateway), sessions.router(gateway),
                nemo.router(gateway), piston.router(gateway), problems.router(gateway)):
        app.router.routes.extend(api.routes)
    app.router.routes.extend(mcp_endpoints.routes())
    direct.update(direct_routes(app.router.routes, json_paths))
    templated.extend(templated_routes(app.router.routes))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            # The bodies the Guard parses (their routes name them with body_schema).
            for model in (ExecRequest, Limits, native.BatchRequest, JudgeRequest, judging.JudgeBatchRequest,
                          SessionCreate, SessionCell, SessionFork, SnapshotCreate,
                          compat.Submission, compat.BatchSubmission,
                          compat.RunCodeRequest, routers.ScriptBatch, nemo.NemoExecute, nemo.NemoError,
                          piston.PistonExecute, *problems.MODELS):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = contract.complete(schema, settings, declared_profiles(settings.image),
                                                   gateway.sessions is not None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.metrics = metrics
    app.state.queue = queue
    app.state.parser = parser  # closed by the lifespan (an app run without one closes it itself)
    return app
