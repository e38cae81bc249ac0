"""The asynchronous, micro-batching client."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import httpx

from codeenv.client._problem import Problem
from codeenv.client._session import (
    AsyncSnapshot,
    ForksStarter,
    Recorder,
    SessionStarter,
    session_json,
    session_request,
)
from codeenv.client._step import StepFigures
from codeenv.client.errors import ClientClosed, RequestRejected, ServerError, TransportError
from codeenv.models import (
    SESSION_KEY_HEADER,
    STEP_MAX,
    ExecRequest,
    ExecResult,
    JudgeRequest,
    JudgeResult,
    Limits,
    Refusal,
    SessionInfo,
    SnapshotInfo,
    Status,
)


@dataclass(eq=False)
class _Item:
    request: ExecRequest
    future: asyncio.Future[ExecResult]
    created: float
    deadline: float | None  # monotonic time by which the call must have started
    attempts: int = 0
    last: ExecResult | None = field(default=None)


def check_base_url(base_url: str) -> None:
    """Refuse, at once, a base URL that is not http(s)://HOST[:PORT][/PATH]. Without a scheme
    ("127.0.0.1:8000") httpx reads it as a relative path (or "localhost" as the scheme), and every
    call would be retried as unreachable before failing."""
    try:
        url = httpx.URL(base_url)
        ok = url.scheme in ("http", "https") and bool(url.host)
    except (httpx.InvalidURL, TypeError):
        ok = False
    if not ok:
        fix = f"'http://{base_url}'" if "://" not in base_url and base_url else "'http://HOST:PORT'"
        raise ValueError(f"base_url {base_url!r} is not an http:// or https:// URL with a host; write it as {fix}")


class AsyncClient:
    """Runs programs on a codeenv service; many concurrent calls become few HTTP requests.

    Usage::

        async with AsyncClient("http://127.0.0.1:8000") as client:
            result = await client.run("print(6 * 7)", limits={"wall_s": 5})
            results = await client.run_many(["print(1)", "print(2)"])

    Batching: a call goes out at once while fewer than `max_in_flight` requests are outstanding;
    calls arriving while that many are out join the next batch, which leaves when a request
    returns or when its oldest call has waited `max_wait_s`; a batch holds at most `max_batch` calls.
    Batches go to /v1/execute/stream, so each caller gets its result as soon as its own call ends
    (`stream=False`: /v1/execute/batch, answered when the whole batch has ended).

    Retries: every call carries a client id (generated unless given). A call the service answered
    `overloaded` with `started: false` is sent again, with the same id, after a jittered
    exponential backoff that honours Retry-After, up to `retries` times and never past its
    deadline. A lost connection or a 5xx without results is retried the same way: the id makes the
    service attach a re-sent call to the one it may already be running, so nothing runs twice.
    Results are data: a call that still could not run comes back `overloaded`; only calls that got
    no result at all raise (see codeenv.client.errors).
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, token: str | None = None,
                 max_in_flight: int = 8, max_batch: int = 256, max_wait_s: float = 0.05, retries: int = 5,
                 backoff_s: float = 0.05, max_backoff_s: float = 2.0, default_wall_s: float = 10.0,
                 grace_s: float = 30.0, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None, headers: Mapping[str, str] | None = None,
                 stream: bool = True, seed: int | None = None, session_key: str | None = None) -> None:
        check_base_url(base_url)
        if max_in_flight < 1 or max_batch < 1 or max_wait_s < 0 or retries < 0:
            raise ValueError("max_in_flight and max_batch must be >= 1, max_wait_s and retries >= 0")
        # Its sessions belong to this key: made per client unless given (to share them between clients).
        self.session_key = session_key or secrets.token_urlsafe(32)
        all_headers = {"content-type": "application/json", SESSION_KEY_HEADER: self.session_key, **(headers or {})}
        if token is not None:
            all_headers["authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(base_url=base_url, transport=transport, headers=all_headers, timeout=None)
        self.max_in_flight, self.max_batch, self.max_wait_s = max_in_flight, max_batch, max_wait_s
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self.default_wall_s, self.grace_s = default_wall_s, grace_s
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.stream = stream
        self._rng = random.Random(seed)
        self._pending: collections.deque[_Item] = collections.deque()
        self._in_flight = 0
        self._flush_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._sends: dict[asyncio.Task[None], list[_Item]] = {}
        self._retrying: dict[asyncio.TimerHandle, _Item] = {}
        self._closed = False
        #: HTTP requests made so far (a batch counts once).
        self.requests_sent = 0
        self._label: int | None = None
        self._step = StepFigures(seed)

    # --- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client (idempotent): calls still waiting fail with ClientClosed."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        closed = ClientClosed("the client was closed before the call finished")
        for handle, item in self._retrying.items():
            handle.cancel()
            _fail(item, closed)
        self._retrying.clear()
        for item in self._pending:
            _fail(item, closed)
        self._pending.clear()
        sends = dict(self._sends)
        for task in sends:
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        for batch in sends.values():  # a send cancelled before it began never saw its batch
            for item in batch:
                _fail(item, closed)
        await self._http.aclose()

    # --- calls ----------------------------------------------------------------------------------

    async def run(self, code: str, *, stdin: str = "", limits: Mapping[str, Any] | None = None,
                  id: str | None = None, profile: str | None = None, deadline_s: float | None = None,
                  files: Mapping[str, str] | None = None, fetch_files: Iterable[str] | None = None,
                  ledger: Recorder | None = None, display_last: bool = False, language: str = "python",
                  preset: str | None = None, std: str | None = None) -> ExecResult:
        """Run one program; returns its structured result. `deadline_s`: it must start within this
        many seconds (counted from now, across retries) or it comes back `overloaded`, not run.
        `display_last`: the repr of the last top-level expression comes back as `value`.
        `language` "cpp": C++ compiled once with `preset` and `std` (its compilation in `compile`)."""
        request = ExecRequest.model_validate({
            "code": code, "stdin": stdin, "limits": Limits.model_validate(dict(limits or {}), strict=False),
            "id": id or uuid.uuid4().hex, "profile": profile, "deadline_s": deadline_s, "files": dict(files or {}),
            "fetch_files": list(fetch_files or []), "display_last": display_last, "language": language,
            "preset": preset, "std": std})
        return await self.submit(request, ledger=ledger)

    async def submit(self, request: ExecRequest, *, ledger: Recorder | None = None,
                     counted: bool = True) -> ExecResult:
        """Run one prepared ExecRequest (an id is added if it has none); `counted`: in step_metrics()."""
        if self._closed:
            raise ClientClosed("the client is closed")
        if request.id is None or (request.step is None and self.step is not None):
            request = request.model_copy(update={"id": request.id or uuid.uuid4().hex,
                                                 "step": self.step if request.step is None else request.step})
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        item = _Item(request, loop.create_future(), now,
                     None if request.deadline_s is None else now + request.deadline_s)
        self._enqueue(item)
        result = await item.future
        if counted:
            self._step.record(result)
        if ledger is not None:
            ledger.record(result)
        return result

    @property
    def step(self) -> int | None:
        """The training step every call is labelled with unless it has its own (`step` in the
        request): the service keeps per-step figures (GET /v1/steps). Set it as each step begins."""
        return self._label

    @step.setter
    def step(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= STEP_MAX):
            raise ValueError(f"a step is a count from 0 to {STEP_MAX}, not {value!r}")
        self._label = value

    def step_metrics(self, prefix: str = "codeenv/") -> dict[str, float]:
        """The figures of this client's calls (judged submissions and session cells included) since
        the last step_metrics(), flat and numeric, to merge into the trainer's metrics: `calls`,
        `status/<status>` counts, `tool_error_ratio` (the program's failures), `service_fault_ratio`,
        `queue_s/p50`, `queue_s/p99`, `run_s/p50`, `run_s/p99` and `slowest_s` (queue and run). Taking
        them starts the next step."""
        return self._step.take(prefix)

    async def judge(self, code: str, tests: Sequence[Mapping[str, Any]] | None = None, *,
                    problem: Problem | str | None = None, fn_name: str | None = None, compare: str = "lines",
                    float_tol: float = 1e-6, stop_on_failure: bool = False, limits: Mapping[str, Any] | None = None,
                    total_wall_s: float | None = None, id: str | None = None, deadline_s: float | None = None,
                    language: str = "python", preset: str | None = None, std: str | None = None) -> JudgeResult:
        """Run a submission against a problem's tests in one call (micro-batched like run()); see
        /v1/judge. `tests`: {"stdin", "expected_stdout"} each, or {"args", "expected"} with `fn_name`.
        Or `problem`: a Problem (or the sha256 of one uploaded before), judged by reference: where the
        service does not hold it (problem_unknown), a Problem is uploaded and the call sent once more.
        `language` "cpp": C++ compiled once with `preset` (codeforces, ioi or plain) and `std`.
        A bad request raises pydantic's ValidationError here, or comes back `rejected`."""
        fields: dict[str, Any] = {"code": code, "language": language, "stop_on_failure": stop_on_failure,
                                  "limits": dict(limits or {}), "total_wall_s": total_wall_s,
                                  "id": id or uuid.uuid4().hex, "deadline_s": deadline_s, "preset": preset, "std": std}
        if problem is None:
            fields.update(tests=None if tests is None else list(tests), fn_name=fn_name, compare=compare,
                          float_tol=float_tol)
        elif tests is not None or fn_name is not None:
            raise ValueError("a problem holds its tests (and fn_name): pass tests or problem, not both")
        else:
            fields["problem"] = problem if isinstance(problem, str) else problem.sha256
        call = JudgeRequest.model_validate(fields).to_call()
        result = await self.submit(call, counted=False)
        if result.refusal is Refusal.problem_unknown and isinstance(problem, Problem):
            await self.upload_problem(problem)
            # The first call never ran (refused before the queue, or by a worker that could not fetch
            # the package): sent again under a new id, answered under the caller's.
            result = await self.submit(call.model_copy(update={"id": uuid.uuid4().hex}), counted=False)
            result.id = call.id
        self._step.record(result)  # the call as the caller sees it: once
        return JudgeResult.from_call(result)

    async def upload_problem(self, problem: Problem) -> dict[str, Any]:
        """PUT the problem's package (idempotent: the same package again changes nothing); the
        service's answer: sha256, tests, bytes, created. RequestRejected for a package it refuses."""
        if self._closed:
            raise ClientClosed("the client is closed")
        self.requests_sent += 1
        try:
            response = await self._http.put(f"/v1/problems/{problem.sha256}", content=problem.body,
                                            timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise TransportError(f"the service could not be reached: {exc!r}") from exc
        if 400 <= response.status_code < 500:
            raise RequestRejected(f"the service refused the problem ({response.status_code}): {_detail(response)}",
                                  response.status_code)
        if response.status_code >= 300:
            raise ServerError(f"the service answered {response.status_code}: {_detail(response)}",
                              response.status_code)
        answer: dict[str, Any] = response.json()
        return answer

    async def run_many(self, requests: Iterable[ExecRequest | str | Mapping[str, Any]]) -> list[ExecResult]:
        """Run many programs concurrently; results in the same order. Items may be code strings,
        ExecRequests, or dicts of ExecRequest's fields."""
        prepared = [r if isinstance(r, ExecRequest) else ExecRequest(code=r) if isinstance(r, str)
                    else ExecRequest.model_validate(dict(r)) for r in requests]
        return list(await asyncio.gather(*(self.submit(r) for r in prepared)))

    def session(self, *, profile: str | None = None, limits: Mapping[str, Any] | None = None,
                idle_ttl_s: float | None = None, replay_on_loss: bool = False,
                functions: Mapping[str, Mapping[str, Any]] | None = None,
                host_budget: Mapping[str, Any] | None = None) -> SessionStarter:
        """A live session: ``async with client.session() as s: await s.run("x = 1")`` (closed at the
        end of the block), or ``s = await client.session()`` (close it yourself). A session that ends
        raises SessionLost from its next cell; with `replay_on_loss`, its kept cells are run again in
        a new session first (AsyncSession says what replay does not give back). `functions`: host
        functions its code calls by name (``{"llm_query": {"url": ..., "headers": ..., "timeout_s":
        ...}}``), each call made by the worker (README, "Host functions"); `host_budget`: their limits."""
        body: dict[str, Any] = {"limits": dict(limits or {})}
        if profile is not None:
            body["profile"] = profile
        if idle_ttl_s is not None:
            body["idle_ttl_s"] = idle_ttl_s
        if functions is not None:
            body["functions"] = {name: dict(spec) for name, spec in functions.items()}
        if host_budget is not None:
            body["host_budget"] = dict(host_budget)
        if replay_on_loss:
            return SessionStarter(self, "/v1/sessions", body, origin=body, history=[])
        return SessionStarter(self, "/v1/sessions", body)

    @overload
    def from_snapshot(self, snapshot_id: str, count: None = None) -> SessionStarter: ...

    @overload
    def from_snapshot(self, snapshot_id: str, count: int) -> ForksStarter: ...

    def from_snapshot(self, snapshot_id: str, count: int | None = None) -> SessionStarter | ForksStarter:
        """A new session from snapshot `snapshot_id` (one of this client's session key's; awaited, or
        ``async with``); with `count`, that many made at once (a list). No replay: the client does not
        know the cells the snapshot was made of."""
        return AsyncSnapshot(self, SnapshotInfo(snapshot_id=snapshot_id, profile="", age_s=0.0, cells=0,
                                                expires_in_s=0.0)).fork(count)

    async def _session_request(self, method: str, path: str, body: dict[str, Any] | None = None) -> SessionInfo | None:
        if self._closed:
            raise ClientClosed("the client is closed")
        self.requests_sent += 1
        return await session_request(self._http, method, path, body, self.timeout_s)

    async def _session_json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        if self._closed:
            raise ClientClosed("the client is closed")
        self.requests_sent += 1
        return await session_json(self._http, method, path, body, self.timeout_s)

    # --- batching -------------------------------------------------------------------------------

    def _enqueue(self, item: _Item) -> None:
        if self._closed:
            _fail(item, ClientClosed("the client was closed"))
            return
        self._pending.append(item)
        if len(self._pending) >= self.max_batch and self._in_flight < self.max_in_flight:
            self._flush()  # a full batch leaves now, not at the end of the tick
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self._flush()

    def _flush(self, force: bool = False) -> None:
        """Send what may go now: below the in-flight cap, or everything once the oldest waited."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()  # its caller gave up before it was sent
        now = time.monotonic()
        while self._pending and (force or self._in_flight < self.max_in_flight
                                 or now - self._pending[0].created >= self.max_wait_s):
            batch: list[_Item] = []
            while self._pending and len(batch) < self.max_batch:
                item = self._pending.popleft()
                if not item.future.done():
                    batch.append(item)
            if batch:
                self._in_flight += 1
                task = asyncio.ensure_future(self._send(batch))
                self._sends[task] = batch
                task.add_done_callback(lambda t: self._sends.pop(t, None))
        if self._pending:
            wait = max(0.0, self._pending[0].created + self.max_wait_s - now)
            self._timer = asyncio.get_running_loop().call_later(wait, self._flush)

    async def _send(self, batch: list[_Item]) -> None:
        released = False

        def release() -> None:
            """This request stops counting against the in-flight cap (once): send what waits."""
            nonlocal released
            if released:
                return
            released = True
            self._in_flight -= 1
            if self._pending and not self._closed and not self._flush_scheduled:
                self._flush_scheduled = True
                asyncio.get_running_loop().call_soon(self._scheduled_flush)

        try:
            now = time.monotonic()
            payload: list[str] = []
            sendable: list[_Item] = []
            wait_budget = 0.0
            for item in batch:
                remaining = None if item.deadline is None else item.deadline - now
                if remaining is not None and remaining <= 0:
                    _resolve(item, item.last or _not_started(item, "its deadline passed before it was sent"))
                    continue
                request = item.request if remaining is None else item.request.model_copy(
                    update={"deadline_s": remaining})
                payload.append(request.model_dump_json(exclude_defaults=True))
                sendable.append(item)
                wall = _wall_s(item.request, self.default_wall_s)
                wait_budget = max(wait_budget, (self.timeout_s if remaining is None else remaining) + wall)
            if not sendable:
                return
            timeout = httpx.Timeout(wait_budget + self.grace_s, connect=self.connect_timeout_s)
            body = '{"requests":[' + ",".join(payload) + "]}"
            self.requests_sent += 1
            if self.stream:
                await self._send_streaming(sendable, body, timeout, release)
                return
            try:
                response = await self._http.post("/v1/execute/batch", timeout=timeout, content=body)
            except httpx.TransportError as exc:
                for item in sendable:
                    self._retry(item, exc)
                return
            self._handle(sendable, response)
        except BaseException as exc:
            for item in batch:
                if isinstance(exc, asyncio.CancelledError) and self._closed:
                    _fail(item, ClientClosed("the client was closed before the call finished"))
                else:
                    _fail(item, exc if isinstance(exc, asyncio.CancelledError)
                          else ServerError(f"the client failed on this batch: {exc!r}"))
            if not isinstance(exc, Exception):
                raise
        finally:
            release()

    async def _send_streaming(self, items: list[_Item], body: str, timeout: httpx.Timeout,
                              release: Callable[[], None]) -> None:
        """POST /v1/execute/stream: each result resolves its caller as soon as its call ends."""
        answered = [False] * len(items)
        try:
            async with self._http.stream("POST", "/v1/execute/stream", content=body, timeout=timeout) as response:
                if response.status_code != 200:
                    await response.aread()
                    self._handle(items, response)
                    return
                # The service has taken the calls: their wait is its queue's now, so the next batch
                # may leave while this one's results stream back.
                release()
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    try:
                        message = json.loads(line)
                        if "i" not in message:
                            continue  # {"accepted": n}: the service took the batch (released above)
                        index = message["i"]
                        result = ExecResult.model_validate(message["result"])
                        if not 0 <= index < len(items) or answered[index]:
                            raise ValueError(f"no call {index} awaits a result")
                    except (ValueError, KeyError, TypeError) as exc:
                        raise httpx.RemoteProtocolError(f"unreadable line from the service: {exc}") from exc
                    answered[index] = True
                    self._settle(items[index], result, None)
        except httpx.TransportError as exc:
            for item, done in zip(items, answered, strict=True):
                if not done:
                    self._retry(item, exc)
            return
        missing = [item for item, done in zip(items, answered, strict=True) if not done]
        if missing:  # the stream ended early: the ids make a re-send attach to what may be running
            cut = httpx.RemoteProtocolError(f"the stream ended with {len(missing)} calls unanswered")
            for item in missing:
                self._retry(item, cut)

    def _settle(self, item: _Item, result: ExecResult, retry_after: float | None) -> None:
        if result.status == Status.overloaded and not result.started:
            item.last = result
            self._retry(item, None, retry_after)
        else:
            _resolve(item, result)

    def _handle(self, items: list[_Item], response: httpx.Response) -> None:
        code = response.status_code
        retry_after = _retry_after(response)
        if code in (200, 429):
            try:
                results = [ExecResult.model_validate(r) for r in response.json()["results"]]
                if len(results) != len(items):
                    raise ValueError(f"{len(results)} results for {len(items)} calls")
            except (ValueError, KeyError, TypeError) as exc:
                for item in items:
                    _fail(item, ServerError(f"unreadable answer from the service: {exc}", code))
                return
            for item, result in zip(items, results, strict=True):
                self._settle(item, result, retry_after)
        elif 400 <= code < 500:
            detail = _detail(response)
            for item in items:
                _fail(item, RequestRejected(f"the service refused the request ({code}): {detail}", code))
        else:  # 5xx without results (a proxy, a crash): safe to re-send, the ids attach
            error = ServerError(f"the service answered {code}: {_detail(response)}", code)
            for item in items:
                self._retry(item, error, retry_after)

    def _retry(self, item: _Item, cause: BaseException | None, retry_after: float | None = None) -> None:
        item.attempts += 1
        if item.attempts > self.retries or self._closed:
            if item.last is not None and cause is None:
                _resolve(item, item.last)
            elif isinstance(cause, ServerError):
                _fail(item, cause)
            else:
                _fail(item, _transport_error(cause, item.attempts))
            return
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (item.attempts - 1)) * self._rng.uniform(0.5, 1.5)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.max_backoff_s * 4))
        if item.deadline is not None and time.monotonic() + delay >= item.deadline:
            if item.last is not None or cause is None:
                _resolve(item, item.last or _not_started(item, "its deadline passed while retrying"))
            else:
                _fail(item, _transport_error(cause, item.attempts))
            return
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def again() -> None:
            if handle is not None:
                self._retrying.pop(handle, None)
            self._enqueue(item)

        handle = loop.call_later(delay, again)
        self._retrying[handle] = item


def _wall_s(request: ExecRequest, default: float) -> float:
    """How long a call may run once started (a judged one: all its tests)."""
    limits, judge = request.limits, request.judge
    if judge is None:
        return limits.wall_s or default
    per_test = limits.wall_s or 3 * (limits.cpu_s or default) + 1
    return judge.total_wall_s or len(judge.tests) * (per_test + 1)


def _resolve(item: _Item, result: ExecResult) -> None:
    if not item.future.done():  # its caller may have given up (cancelled) meanwhile
        item.future.set_result(result)


def _fail(item: _Item, exc: BaseException) -> None:
    if item.future.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        item.future.cancel()
    else:
        item.future.set_exception(exc)


def _transport_error(cause: BaseException | None, attempts: int) -> TransportError:
    error = TransportError(f"the service could not be reached after {attempts} attempts: {cause!r}")
    error.__cause__ = cause
    return error


def _not_started(item: _Item, why: str) -> ExecResult:
    return ExecResult(id=item.request.id, status=Status.overloaded, started=False, message=f"{why}; not run")


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def _detail(response: httpx.Response) -> str:
    try:
        return json.dumps(response.json().get("detail"))[:500]
    except (ValueError, AttributeError):
        return response.text[:500]
