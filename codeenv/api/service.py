"""What every API of the gateway shares: running calls through the queue (metrics, logs, a client
that hangs up cancels its unstarted calls), merging refused items back into a batch, parsing a
body into a model, and the HTTP status each API gives a result."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from codeenv.api.guard import ACCEPTED, JSON_BODY
from codeenv.api.metrics import Metrics
from codeenv.errors import ApiError
from codeenv.models import ExecRequest, ExecResult, Status
from codeenv.queue.base import CallQueue
from codeenv.settings import GatewaySettings

logger = logging.getLogger("codeenv.api")

RETRY_AFTER_S = "1"
DISCONNECT_POLL_S = 0.25

#: The HTTP status a result of one call gets, per API, where it is not 200: the native API answers
#: overload with 429 and Retry-After; SandboxFusion's clients retry only 504 (verl).
NATIVE_STATUS: Mapping[Status, int] = {Status.rejected: 422, Status.overloaded: 429}
SANDBOX_FUSION_STATUS: Mapping[Status, int] = {Status.rejected: 422, Status.overloaded: 504}


def refusal(result: ExecResult, statuses: Mapping[Status, int]) -> ApiError | None:
    """The HTTP error to answer instead of this result, or None if it is answered with 200."""
    code = statuses.get(result.status)
    if code is None:
        return None
    if result.status == Status.rejected:
        return ApiError(code, result.message)
    return ApiError(code, result.message or result.status.value, {"Retry-After": RETRY_AFTER_S})


def validation_errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False, include_context=False, include_input=False)]


def parse[M: BaseModel](request: Request, model: type[M]) -> M:
    """The request's JSON body (parsed by Guard) as `model`; ApiError 422 saying what is wrong."""
    try:
        return model.model_validate(request.scope[JSON_BODY])
    except ValidationError as exc:
        raise ApiError(422, validation_errors(exc)) from None


def merge(refused: Iterable[ExecResult | None], ran: Iterable[ExecResult]) -> list[ExecResult]:
    """A batch's results in request order: each item's own refusal, else the next result that ran."""
    results = iter(ran)
    return [item if item is not None else next(results) for item in refused]


class Gateway:
    """Runs calls for the routes: through the queue, counted in the metrics, logged per batch."""

    def __init__(self, settings: GatewaySettings, queue: CallQueue, metrics: Metrics) -> None:
        self.settings = settings
        self.queue = queue
        self.metrics = metrics

    async def answer(self, request: Request, requests: list[ExecRequest]) -> list[ExecResult]:
        """One result per call, in order; a client that hangs up cancels its unstarted calls."""
        if not requests:
            return []
        self.metrics.in_flight.inc(len(requests))
        started = request.scope.get(ACCEPTED, time.monotonic())
        gone = asyncio.Event()

        async def watch_disconnect() -> None:
            # Starlette has no disconnect event to wait on here: poll it, cheaply.
            while not await request.is_disconnected():  # noqa: ASYNC110
                await asyncio.sleep(DISCONNECT_POLL_S)
            gone.set()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            results = await self.queue.submit(requests, gone, started)
        finally:
            watcher.cancel()
            self.metrics.in_flight.dec(len(requests))
        self.metrics.observe(results)
        statuses: dict[str, int] = {}
        for r in results:
            statuses[r.status.value] = statuses.get(r.status.value, 0) + 1
        logger.info("batch", extra={"event": "batch", "calls": len(results), "statuses": statuses,
                                    "ms": round(1000 * (time.monotonic() - started), 2)})
        return results
