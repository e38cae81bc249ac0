"""The HTTP gateway: the native API over a call queue (embedded by default).

Usage::

    app = create_app(GatewaySettings())          # serve with uvicorn; OpenAPI at /docs

Bodies are read once, size-capped (413) and parsed here (400 for malformed or too deeply nested
JSON), so bad input always gets a 4xx that says what to fix, never a 5xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from codeenv.api.compat import JSON_BODY, add_code_judge, add_sandbox_fusion, validation_errors
from codeenv.errors import QueueUnavailable
from codeenv.models import ExecRequest, ExecResult, Limits, Status
from codeenv.queue.base import CallQueue
from codeenv.settings import GatewaySettings

if TYPE_CHECKING:
    from codeenv.worker import StreamWorker

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
#: Where Guard leaves the time (monotonic) a request arrived: its calls' queue wait starts there.
ACCEPTED = "codeenv.accepted"
#: The endpoints that take a JSON body (read, capped and parsed once, in Guard).
JSON_POSTS = frozenset({"/v1/execute", "/v1/execute/batch", "/v1/execute/stream", "/run_code"} | {
    f"/{verb}{suffix}" for verb in ("run", "judge") for suffix in ("", "/batch", "/long-batch")})
LAG_PROBE_S = 0.5
DISCONNECT_POLL_S = 0.25


class BatchRequest(BaseModel):
    """A batch of calls; each item has the shape of ExecRequest and is checked on its own."""

    requests: list[ExecRequest]


class BatchResponse(BaseModel):
    """One result per request, in request order."""

    results: list[ExecResult]


class ApiError(Exception):
    def __init__(self, status_code: int, detail: Any, headers: dict[str, str] | None = None) -> None:
        self.status_code = status_code
        self.detail = detail
        self.headers = headers


class Metrics:
    """Prometheus metrics of a gateway. Under `serve --processes N` (PROMETHEUS_MULTIPROC_DIR set)
    every process writes its values to files and a scrape of any process reads them all: counters
    and histograms add up, in-flight calls add up over live processes, the queue's gauges (the same
    host-wide figures in every process) are the most recent reading."""

    STATS = (("slots", "Slots of the workers"), ("free_slots", "Slots free right now"),
             ("slot_restarts", "Jails recycled since start"),
             ("waiting", "Calls accepted and waiting for a slot (the queue's depth)"),
             ("oldest_wait_s", "How long the oldest waiting call has waited (the queue's age)"),
             ("workers", "Live workers behind this gateway"),
             ("calls_run", "Calls the workers have run"))

    def __init__(self, queue: CallQueue) -> None:
        self.queue = queue
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry()
        self.calls = Counter("codeenv_calls", "Calls answered, by status", ["status"], registry=self.registry)
        self.queue_s = Histogram("codeenv_queue_seconds", "Time a call waited for a slot", registry=self.registry,
                                 buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60))
        self.run_s = Histogram("codeenv_run_seconds", "Wall time of a call's program", registry=self.registry,
                               buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.in_flight = Gauge("codeenv_in_flight_calls", "Calls accepted and not yet answered",
                               registry=self.registry, multiprocess_mode="livesum")
        self.loop_lag = Gauge("codeenv_event_loop_lag_seconds", "How late a gateway's event loop runs a timer",
                              registry=self.registry, multiprocess_mode="livemax")
        self.stats = {key: Gauge(f"codeenv_{key}", doc, registry=self.registry, multiprocess_mode="mostrecent")
                      for key, doc in self.STATS}

    def observe(self, results: list[ExecResult]) -> None:
        for r in results:
            self.calls.labels(r.status.value).inc()
            if r.started:
                self.queue_s.observe(r.queue_s)
                self.run_s.observe(r.wall_s)

    def exposition(self) -> bytes:
        stats = self.queue.stats()
        for key, gauge in self.stats.items():
            gauge.set(stats[key])
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)

    def process_exit(self) -> None:
        if self.multiprocess:
            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


def app_from_env() -> FastAPI:
    """The gateway configured by CODEENV_* variables: what each `serve --processes N` process runs."""
    return create_app(GatewaySettings())


def create_app(settings: GatewaySettings, queue: CallQueue | None = None) -> FastAPI:
    """The gateway. Without `queue`: an embedded slot pool, or with `settings.redis_url` the Redis
    Streams queue (and, with `settings.local_worker`, a worker in this process), for its lifetime."""
    worker: StreamWorker | None = None
    if queue is None and settings.pool_socket is not None:
        from codeenv.queue.host_socket import HostSocketQueue

        queue = HostSocketQueue(settings.pool_socket)
    elif queue is None and settings.redis_url is not None:
        from codeenv.queue.redis import RedisQueue
        from codeenv.worker import StreamWorker

        queue = RedisQueue(settings)
        worker = StreamWorker(settings) if settings.local_worker else None
    elif queue is None:
        from codeenv.queue.embedded import EmbeddedQueue
        from codeenv.sandbox.pool import SlotPool

        queue = EmbeddedQueue(SlotPool(settings), settings.max_queued, grace_s=settings.shutdown_grace_s)
    calls: CallQueue = queue
    metrics = Metrics(calls)

    async def measure_lag() -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)
            metrics.loop_lag.set(max(0.0, time.monotonic() - t0 - LAG_PROBE_S))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if worker is not None:
            await worker.start()
        try:
            await calls.start()
        except BaseException:
            if worker is not None:
                await worker.stop(grace_s=0)
            raise
        probe = asyncio.create_task(measure_lag(), name="codeenv-loop-lag")
        try:
            yield
        finally:
            probe.cancel()
            await calls.close()
            if worker is not None:
                await worker.stop()
            metrics.process_exit()

    app = FastAPI(title="codeenv", version="0.1.0", lifespan=lifespan,
                  description="Run untrusted Python in jails, with hard limits and structured results.")

    app.add_middleware(Guard, settings=settings)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return JSONResponse({"detail": exc.detail}, exc.status_code, exc.headers)

    async def answer(request: Request, requests: list[ExecRequest]) -> list[ExecResult]:
        metrics.in_flight.inc(len(requests))
        started = request.scope.get(ACCEPTED, time.monotonic())
        gone = asyncio.Event()

        async def watch_disconnect() -> None:
            # Starlette has no disconnect event to wait on here: poll it, cheaply.
            while not await request.is_disconnected():  # noqa: ASYNC110
                await asyncio.sleep(DISCONNECT_POLL_S)
            gone.set()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            results = await calls.submit(requests, gone, started)
        finally:
            watcher.cancel()
            metrics.in_flight.dec(len(requests))
        metrics.observe(results)
        statuses: dict[str, int] = {}
        for r in results:
            statuses[r.status.value] = statuses.get(r.status.value, 0) + 1
        logger.info("batch", extra={"event": "batch", "calls": len(results), "statuses": statuses,
                                    "ms": round(1000 * (time.monotonic() - started), 2)})
        return results

    @app.post("/v1/execute", response_model=ExecResult, openapi_extra=_body_schema("ExecRequest"),
              responses={422: {"description": "the request cannot be run as sent"},
                         429: {"description": "overloaded: retry after Retry-After seconds"}})
    async def execute(request: Request) -> Response:
        """Run one program and return its structured result."""
        try:
            call = ExecRequest.model_validate(request.scope[JSON_BODY])
        except ValidationError as exc:
            raise ApiError(422, validation_errors(exc)) from None
        [result] = await answer(request, [call])
        if result.status == Status.rejected:
            raise ApiError(422, result.message)
        if result.status == Status.overloaded:
            return Response(result.encoded(), 429, {"Retry-After": RETRY_AFTER_S}, media_type="application/json")
        return Response(result.encoded(), media_type="application/json")

    def parse_batch(request: Request) -> tuple[list[ExecRequest], list[ExecResult | None]]:
        """The valid calls of a batch, and per item either None (valid) or its `rejected` result."""
        body = request.scope[JSON_BODY]
        items = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise ApiError(422, "the body must be an object with a list under 'requests'")
        if len(items) > settings.max_batch:
            raise ApiError(422, f"a batch holds at most {settings.max_batch} calls; this one has {len(items)}")
        valid: list[ExecRequest] = []
        slots: list[ExecResult | None] = []
        for item in items:
            try:
                valid.append(ExecRequest.model_validate(item))
                slots.append(None)
            except ValidationError as exc:
                call_id = item.get("id") if isinstance(item, dict) and isinstance(item.get("id"), str) else None
                if call_id is not None and not _encodable(call_id):
                    call_id = None
                slots.append(ExecResult(id=call_id, status=Status.rejected,
                                        message=json.dumps(validation_errors(exc))))
        return valid, slots

    @app.post("/v1/execute/batch", response_model=BatchResponse, openapi_extra=_body_schema("BatchRequest"))
    async def execute_batch(request: Request) -> Response:
        """Run a batch; results come in request order. An invalid item is answered `rejected`."""
        valid, slots = parse_batch(request)
        ran = iter(await answer(request, valid)) if valid else iter(())
        results = [slot if slot is not None else next(ran) for slot in slots]
        payload = '{"results":[' + ",".join(r.encoded() for r in results) + "]}"
        if results and all(r.status == Status.overloaded for r in results):
            return Response(payload, 429, {"Retry-After": RETRY_AFTER_S}, media_type="application/json")
        return Response(payload, media_type="application/json")

    @app.post("/v1/execute/stream", openapi_extra=_body_schema("BatchRequest"),
              responses={200: {"description": '{"accepted": n}, then one JSON line per call, {"i": index, '
                                              '"result": {...}}, in the order calls end',
                               "content": {"application/x-ndjson": {}}}})
    async def execute_stream(request: Request) -> Response:
        """Run a batch and stream each result as soon as its call ends (NDJSON): first
        `{"accepted": n}` once the calls are taken, then `{"i": index, "result": {...}}` per call in
        the order calls end, so a fast call never waits for a slow sibling. A client that hangs up
        cancels its calls that have not started."""
        valid, slots = parse_batch(request)
        gone = asyncio.Event()
        indices = [i for i, slot in enumerate(slots) if slot is None]
        started = request.scope.get(ACCEPTED, time.monotonic())

        async def lines() -> AsyncIterator[str]:
            statuses: dict[str, int] = {}
            ended: asyncio.Queue[tuple[int, ExecResult]] = asyncio.Queue()
            metrics.in_flight.inc(len(valid))
            left = len(valid)
            submitted = asyncio.ensure_future(calls.submit(
                valid, gone, started, lambda i, result: ended.put_nowait((indices[i], result))))
            answered: set[int] = set()

            def failed(task: asyncio.Future[list[ExecResult]]) -> None:
                # submit never raises for one bad call; if it fails as a whole, answer what is left.
                exc = None if task.cancelled() else task.exception()
                if exc is not None:
                    logger.error("a streamed batch failed: %r", exc)
                    for i in indices:
                        if i not in answered:
                            ended.put_nowait((i, ExecResult(status=Status.internal_error, started=True,
                                                            message=f"the service failed on this call: {exc!r}")))

            submitted.add_done_callback(failed)
            try:
                # At once: the client learns its calls are taken (headers alone may wait for a body).
                yield f'{{"accepted":{len(slots)}}}\n'
                for i, slot in enumerate(slots):
                    if slot is not None:
                        yield f'{{"i":{i},"result":{slot.encoded()}}}\n'
                while left:
                    i, result = await ended.get()
                    if i in answered:
                        continue
                    answered.add(i)
                    left -= 1
                    metrics.in_flight.dec()
                    metrics.observe([result])
                    statuses[result.status.value] = statuses.get(result.status.value, 0) + 1
                    yield f'{{"i":{i},"result":{result.encoded()}}}\n'
            finally:
                gone.set()  # the client hung up (or all is sent): unstarted calls are cancelled
                metrics.in_flight.dec(left)
                logger.info("stream", extra={"event": "stream", "calls": len(slots), "statuses": statuses,
                                             "ms": round(1000 * (time.monotonic() - started), 2)})

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/results/{call_id:path}", response_model=ExecResult,
             responses={202: {"description": "the call is still running"}, 404: {"description": "unknown id"}})
    async def result_by_id(call_id: str) -> Response:
        """The result of a call by the client's id, kept for a while after it ends."""
        try:
            known, result = await calls.lookup(call_id)
        except QueueUnavailable as exc:
            raise ApiError(503, str(exc), {"Retry-After": RETRY_AFTER_S}) from None
        if result is not None:
            return Response(result.encoded(), media_type="application/json")
        if known:
            return JSONResponse({"id": call_id, "detail": "the call is still running"}, 202)
        raise ApiError(404, f"no call with id {call_id!r} is running or remembered")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process answers (cheap, even at saturation)."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        """The pool started with at least one healthy slot (with Redis: Redis answers and a live
        worker has slots)."""
        if calls.ready():
            return JSONResponse({"ready": True})
        return JSONResponse({"ready": False}, 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    add_code_judge(app, settings, calls, answer)
    add_sandbox_fusion(app, settings, answer)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (ExecRequest, Limits, BatchRequest):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.metrics = metrics
    app.state.queue = calls
    return app


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _body_schema(model: str) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}}}


class Guard:
    """ASGI middleware in front of every route: the token, then the body of JSON_POSTS.

    The body is read here once, capped (413) and parsed (400), and left in the scope; the app then
    sees an empty body followed by the client's real messages, so an endpoint can still notice
    the client hanging up (http.disconnect) while its calls wait.
    """

    def __init__(self, app: Any, settings: GatewaySettings) -> None:
        self.app = app
        self.settings = settings
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
            if scope["method"] == "POST" and scope["path"] in JSON_POSTS:
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
