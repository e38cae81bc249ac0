"""The native API (`/v1/...`), health, readiness and metrics, as an APIRouter."""

from __future__ import annotations

import logging
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from codeenv.api.service import Gateway, body_schema, merge, parse, split_batch
from codeenv.api.statuses import NATIVE, RETRY_AFTER_S, answered, answered_batch
from codeenv.errors import ApiError, QueueUnavailable
from codeenv.models import ExecRequest, ExecResult

logger = logging.getLogger("codeenv.api")

#: The live page's files (codeenv/api/static), read once.
PAGE = {name: (files("codeenv.api") / "static" / name).read_bytes() for name in ("live.html", "live.js", "live.css")}
#: What the page may load and do: its own script, style and data, nothing else (no inline code).
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                           "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
                                           "frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

#: The routes that take a JSON body (Guard reads and parses it).
JSON_PATHS = frozenset({"/v1/execute", "/v1/execute/batch", "/v1/execute/stream"})


class BatchRequest(BaseModel):
    """A batch of calls; each item has the shape of ExecRequest and is checked on its own."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"requests": [{"code": "print(1)"}, {"code": "1 / 0"}]}]})

    requests: list[ExecRequest]


class BatchResponse(BaseModel):
    """One result per request, in request order."""

    results: list[ExecResult]


class SlowestCall(BaseModel):
    id: str | None
    wall_s: float
    status: str


class StepFigures(BaseModel):
    step: int
    calls: int
    statuses: dict[str, int]
    service_faults: int
    cpu_s: float
    slowest: SlowestCall | None = Field(description="the step's call that ran longest (none if none ran)")


class StepsView(BaseModel):
    """Per training step (requests' `step` label), this gateway process's calls; the highest first."""

    steps: list[StepFigures]
    kept: int = Field(description="how many steps a gateway process keeps")


def _json(result: ExecResult, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(result.encoded(), status_code, headers, media_type="application/json")


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()
    _calls(api, gateway)
    _service(api, gateway)
    return api


def _calls(api: APIRouter, gateway: Gateway) -> None:
    """/v1/execute, its batch and its stream."""

    @api.post("/v1/execute", response_model=ExecResult, openapi_extra=body_schema("ExecRequest"),
              responses={422: {"description": "the request cannot be run as sent"},
                         429: {"model": ExecResult, "description": "overloaded (not run): retry after Retry-After "
                                                                   "seconds"},
                         404: {"description": "a session's cell, and no such session"},
                         409: {"description": "its id names another call (a different program): use a new id"}})
    async def execute(request: Request) -> Response:
        """Run one program and return its structured result."""
        [result] = await gateway.answer(request, [parse(request, ExecRequest)])
        code, headers = answered(result, NATIVE)  # a refused call: its 4xx
        return _json(result, code, headers)  # overloaded: the result itself, with the status the client retries

    def parse_batch(request: Request) -> tuple[list[ExecRequest], list[ExecResult | None]]:
        """The valid calls of a batch, and per item either None (valid) or its `rejected` result."""
        return split_batch(request, gateway.settings.max_batch, ExecRequest.model_validate)

    @api.post("/v1/execute/batch", response_model=BatchResponse, openapi_extra=body_schema("BatchRequest"),
              responses={429: {"model": BatchResponse, "description": "every call overloaded (none run): retry "
                                                                      "after Retry-After seconds"}})
    async def execute_batch(request: Request) -> Response:
        """Run a batch; results come in request order. An invalid item is answered `rejected`."""
        valid, refused = parse_batch(request)
        results = merge(refused, await gateway.answer(request, valid))
        payload = '{"results":[' + ",".join(r.encoded() for r in results) + "]}"
        code, headers = answered_batch(results, NATIVE)
        return Response(payload, code, headers, media_type="application/json")

    @api.post("/v1/execute/stream", openapi_extra=body_schema("BatchRequest"),
              responses={200: {"description": '{"accepted": n}, then one JSON line per call, {"i": index, '
                                              '"result": {...}}, in the order calls end',
                               "content": {"application/x-ndjson": {}}}})
    async def execute_stream(request: Request) -> Response:
        """Run a batch and stream each result as soon as its call ends (NDJSON): first
        `{"accepted": n}` once the calls are taken, then `{"i": index, "result": {...}}` per call in
        the order calls end, so a fast call never waits for a slow sibling. A client that hangs up
        cancels its calls that have not started."""
        valid, refused = parse_batch(request)
        return gateway.stream(request, valid, refused, ExecResult.encoded)


def _service(api: APIRouter, gateway: Gateway) -> None:
    """Results by id, health, readiness and metrics."""
    calls, metrics = gateway.queue, gateway.metrics

    @api.get("/v1/results/{call_id:path}", response_model=ExecResult,
             responses={202: {"description": "the call is still running"}, 404: {"description": "unknown id"},
                        503: {"description": "the queue cannot be asked now: retry after Retry-After seconds"}})
    async def result_by_id(call_id: str) -> Response:
        """The result of a call by the client's id, kept for a while after it ends."""
        try:
            known, result = await calls.lookup(call_id)
        except QueueUnavailable as exc:
            raise ApiError(503, str(exc), {"Retry-After": RETRY_AFTER_S}) from None
        if result is not None:
            return _json(result)
        if known:
            return JSONResponse({"id": call_id, "detail": "the call is still running"}, 202)
        raise ApiError(404, f"no call with id {call_id!r} is running or remembered")

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process answers (cheap, even at saturation)."""
        return {"status": "ok"}

    @api.get("/readyz", responses={503: {"description": "not ready", "content": {"application/json": {}}}})
    async def readyz() -> Response:
        """The pool started with at least one healthy slot (with Redis: Redis answers and a live
        worker has slots)."""
        if calls.ready():
            return JSONResponse({"ready": True})
        return JSONResponse({"ready": False}, 503)

    @api.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/live", response_model=dict[str, Any])
    async def live() -> Response:
        """What the live page (`/`) reads: every gateway process's calls by status, in-flight calls, the
        latency histograms (queue wait, run, overhead, end to end; cumulative bucket counts), the
        queue's and each worker's figures, the last steps. Counts only: no code, no output."""
        return JSONResponse(metrics.live())  # plain JSON already: FastAPI's encoder would walk it again

    @api.get("/", include_in_schema=False)
    async def page() -> Response:
        """The live page: one self-contained page (its script and style are this service's own)."""
        return Response(PAGE["live.html"], media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @api.get("/live.js", include_in_schema=False)
    async def page_script() -> Response:
        return Response(PAGE["live.js"], media_type="text/javascript; charset=utf-8", headers=PAGE_HEADERS)

    @api.get("/live.css", include_in_schema=False)
    async def page_style() -> Response:
        return Response(PAGE["live.css"], media_type="text/css; charset=utf-8", headers=PAGE_HEADERS)

    @api.get("/v1/steps", response_model=StepsView)
    async def steps() -> StepsView:
        """The calls that carried a `step` label, per training step: the last 64 steps this gateway
        process saw (the highest first): calls, status mix, service faults, CPU seconds, the slowest
        call. No code or output."""
        return StepsView(steps=metrics.steps.view(), kept=metrics.steps.kept)
