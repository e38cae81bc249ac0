"""What every API of the gateway shares: admitting calls once and running them through the queue
(metrics, logs, a client that hangs up cancels its unstarted calls), merging refused items back into
a batch, and parsing a body into a model. The HTTP status of each outcome: `codeenv.api.statuses`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from codeenv.admission import answer_bytes, check
from codeenv.api.contract import SESSION_KEY_PATHS
from codeenv.api.guard import ACCEPTED, ANSWERED, JSON_BODY
from codeenv.api.metrics import Metrics, api_of
from codeenv.errors import ApiError, InvalidRequest
from codeenv.models import SESSION_KEY_HEADER, ExecRequest, ExecResult, Refusal, Status
from codeenv.problems import ProblemStore
from codeenv.queue.base import CallQueue, SessionService
from codeenv.settings import GatewaySettings

logger = logging.getLogger("codeenv.api")

DISCONNECT_POLL_S = 0.25

#: What a gateway whose queue runs no sessions answers a session's cell.
NO_SESSIONS = ("this gateway's queue ({queue}) runs no sessions: they run in embedded mode (`codeenv serve`), "
               "behind `serve --processes N` and on Redis workers")


#: Who sends no key: owns nothing (no session is ever created for it: it gets a key made for it).
NO_OWNER = b"-"


def session_key(request: Request) -> str | None:
    """The request's session key, or None; ApiError 422 for one that is not a usable secret."""
    key = request.headers.get(SESSION_KEY_HEADER)
    if key is not None and not (16 <= len(key) <= 256 and key.isascii() and key.isprintable() and " " not in key):
        raise ApiError(422, f"the {SESSION_KEY_HEADER} header must be 16 to 256 visible ASCII characters "
                            "(a secret of yours, e.g. 32 random bytes in base64)")
    return key


def owner(key: str | None) -> bytes:
    """Who a session key names (its hash; NO_OWNER without one)."""
    return NO_OWNER if key is None else hashlib.sha256(key.encode()).digest()


def body_schema(model: str, required: bool = True) -> dict[str, Any]:
    """The OpenAPI request body of a route whose JSON the Guard parses (`model`'s schema is added to
    the document's components by create_app)."""
    return {"requestBody": {"required": required, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}}}


def validation_errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False, include_context=False, include_input=False)]


def parse[M: BaseModel](request: Request, model: type[M]) -> M:
    """The request's JSON body (parsed by Guard) as `model`; ApiError 422 saying what is wrong."""
    try:
        return model.model_validate(request.scope.pop(JSON_BODY, None))  # nothing else of it is kept
    except ValidationError as exc:
        raise ApiError(422, validation_errors(exc)) from None


def split_batch(request: Request, max_batch: int, call: Callable[[Any], ExecRequest],
                noun: str = "calls") -> tuple[list[ExecRequest], list[ExecResult | None]]:
    """The calls of a batch body `{"requests": [...]}` (each item made one by `call`), and per item
    None (valid) or its `rejected` result; ApiError 422 for another shape or too many items."""
    body = request.scope.pop(JSON_BODY, None)  # kept only while its items are read
    items = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise ApiError(422, "the body must be an object with a list under 'requests'")
    if len(items) > max_batch:
        raise ApiError(422, f"a batch holds at most {max_batch} {noun}; this one has {len(items)}")
    valid: list[ExecRequest] = []
    refused: list[ExecResult | None] = []
    for item in items:
        try:
            valid.append(call(item))
            refused.append(None)
        except ValidationError as exc:
            refused.append(rejected(item, exc))
        except InvalidRequest as exc:
            refused.append(rejected(item, str(exc), Refusal(exc.refusal)))
    return valid, refused


def rejected(item: Any, why: ValidationError | str, refusal: Refusal = Refusal.invalid) -> ExecResult:
    """The `rejected` answer to one invalid item of a batch, under its id if it has a usable one."""
    call_id = item.get("id") if isinstance(item, dict) and isinstance(item.get("id"), str) else None
    if call_id is not None:
        try:
            call_id.encode("utf-8")
        except UnicodeEncodeError:  # e.g. a lone surrogate: nothing could send it back
            call_id = None
    message = why if isinstance(why, str) else json.dumps(validation_errors(why))
    return ExecResult(id=call_id, status=Status.rejected, refusal=refusal, message=message)


def merge(refused: Iterable[ExecResult | None], ran: Iterable[ExecResult]) -> list[ExecResult]:
    """A batch's results in request order: each item's own refusal, else the next result that ran."""
    results = iter(ran)
    return [item if item is not None else next(results) for item in refused]


def bind_owner(request: Request, calls: list[ExecRequest]) -> None:
    """Each session cell of `calls` asks as the owner of the request's session key (a malformed key
    is a 422 whether or not a call names a session: the document declares the header)."""
    named = False
    for call in calls:  # a loop, not any(): this runs for every request
        if call.session is not None:
            named = True
            break
    if not named and not request.scope["path"].startswith(SESSION_KEY_PATHS):
        return
    key = session_key(request)
    if named:
        who = owner(key)
        for call in calls:
            if not call._owner:  # a route that names the owner itself (NeMo-Skills') keeps it
                call._owner = who


class Gateway:
    """Runs calls for the routes: admitted once, through the queue, counted in the metrics, logged
    per batch. `sessions` are the queue's (None where it runs none)."""

    def __init__(self, settings: GatewaySettings, queue: CallQueue, metrics: Metrics) -> None:
        self.settings = settings
        self.queue = queue
        self.metrics = metrics
        self.problems = ProblemStore.from_settings(settings)  # packages uploaded here
        # A queue written before CallQueue had `sessions` (e.g. a test's own fake) runs none.
        self.sessions: SessionService | None = getattr(queue, "sessions", None)

    def admit(self, calls: list[ExecRequest], base_url: Callable[[], str]) -> list[ExecResult | None] | None:
        """Each call checked against this gateway's settings (the one admission on this side): None
        when every call is admitted, else per call its `rejected` result or None. A call judged by
        reference learns its problem's test count and where its worker fetches it (this gateway, at
        `public_url` or else `base_url`), or is refused problem_unknown."""
        refused: list[ExecResult | None] | None = None
        for index, call in enumerate(calls):
            try:
                if call.session is not None and self.sessions is None:
                    raise InvalidRequest(NO_SESSIONS.format(queue=type(self.queue).__name__))
                if call.judge is not None and call.judge.problem is not None:
                    self.problems.refer(call.judge, self.settings.public_url or base_url())
                check(call, self.settings)
            except InvalidRequest as exc:
                if refused is None:
                    refused = [None] * len(calls)
                refused[index] = ExecResult(id=call.id, status=Status.rejected, refusal=Refusal(exc.refusal),
                                            message=str(exc))
        return refused

    def bound_answer(self, calls: list[ExecRequest]) -> None:
        """ApiError 422 when the calls' answer could carry more output than max_answer_mb."""
        most = self.settings.max_answer_mb << 20
        total = sum(answer_bytes(call, self.settings) for call in calls)
        if total > most:
            raise ApiError(422, f"these {len(calls)} calls' answer could carry {total >> 20} MiB of output (stdout "
                                f"and stderr at each call's output_bytes); the most is {most >> 20} MiB "
                                "(max_answer_mb): ask less output_bytes, or send fewer calls at once")

    async def answer(self, request: Request, requests: list[ExecRequest]) -> list[ExecResult]:
        """One result per call, in order; a client that hangs up cancels its unstarted calls."""
        bind_owner(request, requests)
        if not requests:
            return []
        gone = asyncio.Event()

        async def watch_disconnect() -> None:
            # Starlette has no disconnect event to wait on here: poll it, cheaply. The first look
            # takes the Guard's replayed body (a disconnect, once seen, stays seen).
            await request.is_disconnected()
            while not await request.is_disconnected():  # noqa: ASYNC110
                await asyncio.sleep(DISCONNECT_POLL_S)
            gone.set()

        # The watch starts after one poll interval, when its second look did: most calls have ended
        # by then, and made no task of it.
        watchers: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()
        timer = loop.call_later(DISCONNECT_POLL_S, lambda: watchers.append(loop.create_task(watch_disconnect())))
        try:
            return await self.run_calls(requests, lambda: str(request.base_url), gone,
                                        request.scope.get(ACCEPTED, time.monotonic()), api_of(request.scope["path"]),
                                        request.scope.get(ANSWERED))
        finally:
            timer.cancel()
            for watcher in watchers:
                watcher.cancel()

    async def run_calls(self, requests: list[ExecRequest], base_url: Callable[[], str], gone: asyncio.Event,
                        started: float, api: str, answered: list[Callable[[], None]] | None = None) -> list[ExecResult]:
        """answer() for a caller that is no HTTP request of its own (an MCP tool call): `gone` set
        cancels the unstarted calls; `base_url()`: this gateway as the caller reached it; `api`: the
        metrics' label of the API they came by; `answered`: run once the answer is sent (where the
        calls' end to end ends: see Metrics.observe)."""
        refused = self.admit(requests, base_url)
        valid = requests if refused is None else [c for c, r in zip(requests, refused, strict=True) if r is None]
        self.bound_answer(valid)
        self.metrics.accepted.inc(len(requests))
        self.metrics.in_flight.inc(len(requests))
        try:
            results = await self.queue.submit(valid, gone, started) if valid else []
        finally:
            self.metrics.in_flight.dec(len(requests))
        if refused is not None:
            results = merge(refused, results)
        self.metrics.observe(results, requests, started, api, answered)
        if logger.isEnabledFor(logging.INFO):  # the line's fields are counted only for a line written
            statuses: dict[str, int] = {}
            for r in results:
                statuses[r.status.value] = statuses.get(r.status.value, 0) + 1
            logger.info("batch", extra={"event": "batch", "calls": len(results), "statuses": statuses,
                                        "ms": round(1000 * (time.monotonic() - started), 2)})
        return results

    def stream(self, request: Request, valid: list[ExecRequest], refused: list[ExecResult | None],
               encode: Callable[[ExecResult], str]) -> StreamingResponse:
        """Run a batch and stream each result as its call ends (NDJSON): first `{"accepted": n}`
        once the calls are taken, then `{"i": index, "result": ...}` per call in the order calls
        end (`encode` gives the result's JSON). A client that hangs up cancels its unstarted calls."""
        bind_owner(request, valid)
        sent: list[ExecRequest | None] = [None] * len(refused)  # each call by its index in the batch
        for index, call in zip([i for i, item in enumerate(refused) if item is None], valid, strict=True):
            sent[index] = call
        api = api_of(request.scope["path"])
        more = self.admit(valid, lambda: str(request.base_url))
        if more is not None:  # refused here: answered in their place in the batch
            unrefused = [i for i, item in enumerate(refused) if item is None]
            for index, item in zip(unrefused, more, strict=True):
                if item is not None:
                    refused[index] = item
            valid = [call for call, item in zip(valid, more, strict=True) if item is None]
        self.bound_answer(valid)
        gone = asyncio.Event()
        indices = [i for i, item in enumerate(refused) if item is None]
        started = request.scope.get(ACCEPTED, time.monotonic())
        metrics, calls = self.metrics, self.queue

        async def lines() -> AsyncIterator[str]:
            statuses: dict[str, int] = {}
            ended: asyncio.Queue[tuple[int, ExecResult]] = asyncio.Queue()
            metrics.accepted.inc(len(refused))
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
                yield f'{{"accepted":{len(refused)}}}\n'
                for i, item in enumerate(refused):
                    if item is not None:
                        metrics.observe([item], [sent[i]], started, api)
                        yield f'{{"i":{i},"result":{encode(item)}}}\n'
                while left:
                    i, result = await ended.get()
                    if i in answered:
                        continue
                    answered.add(i)
                    left -= 1
                    metrics.in_flight.dec()
                    metrics.observe([result], [sent[i]], started, api)
                    statuses[result.status.value] = statuses.get(result.status.value, 0) + 1
                    yield f'{{"i":{i},"result":{encode(result)}}}\n'
            finally:
                gone.set()  # the client hung up (or all is sent): unstarted calls are cancelled
                metrics.in_flight.dec(left)
                logger.info("stream", extra={"event": "stream", "calls": len(refused), "statuses": statuses,
                                             "ms": round(1000 * (time.monotonic() - started), 2)})

        return StreamingResponse(lines(), media_type="application/x-ndjson")
