"""How a bench speaks to a target: codeenv's API, code-judge's or SandboxFusion's.

Each API sends one call per HTTP request, the way its usual clients do (``codeenv-client`` goes
through codeenv's own client library instead, which batches the calls in flight), and turns the answer into
an `Outcome`: how the call ended (the same words for every API), its stdout, and the queue wait
and run time where the API reports them (codeenv reports both; code-judge and SandboxFusion only
the run time, so their overhead figure includes queueing).

A code workload's submission (a call with tests) goes to ``judge`` as one /v1/judge request; every
other API sends its tests as concurrent requests of their own and compares the outputs here, as
the reward functions of verl and SkyRL do. Both answer ``ok`` with the stdout ``PASSED/TOTAL``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from codeenv.bench.workload import Call, Test
from codeenv.compare import same_output
from codeenv.errors import TargetError
from codeenv.models import Compare

APIS = ("codeenv", "codeenv-client", "judge", "code-judge", "sandbox-fusion")
#: A code workload's comparison of a test's output with the expected one.
CODE_COMPARE = Compare.lines
#: Outcomes where the service did not run the call: counted as errors, never as answers.
SERVICE_ERRORS = ("http_error", "internal_error", "overloaded", "rejected")


@dataclass(frozen=True, slots=True)
class Outcome:
    status: str
    stdout: str = ""
    queue_s: float | None = None
    run_s: float | None = None
    error: str | None = None  # why an HTTP exchange failed


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer, read whole."""

    status_code: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)


class Http:
    """The bench's HTTP client, on one target: aiohttp's, which costs a generator a quarter of what
    httpx's async client does per request (`benchmarks/client_floor.py`: about 0.3-0.6 ms over a
    plain socket's round trip against 2-2.5 ms), so the figures are more the service's and less the
    generator's. `connections` at most at once (None: no limit), each kept alive."""

    def __init__(self, url: str, timeout_s: float, connections: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10),
            connector=aiohttp.TCPConnector(limit=connections or 0, limit_per_host=0))

    async def __aenter__(self) -> Http:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()

    async def get(self, path: str) -> Answer:
        async with self.session.get(self.url + path) as response:
            return Answer(response.status, await response.read())

    async def post(self, path: str, json: Any) -> Answer:
        async with self.session.post(self.url + path, json=json) as response:
            return Answer(response.status, await response.read())


def _short(response: Answer) -> str:
    return f"HTTP {response.status_code}: {response.text[:200].strip()}"


class Api:
    name: str
    ping_path: str
    call_path: str

    async def start(self, url: str) -> None:
        """Set up what the API's calls need beyond the bench's HTTP client (nothing, mostly)."""

    async def stop(self) -> None:
        pass

    def body(self, call: Call) -> dict[str, Any]:
        raise NotImplementedError

    def outcome(self, data: Any) -> Outcome:
        raise NotImplementedError

    async def call(self, client: Http, call: Call) -> Outcome:
        if call.tests is not None:
            return await self._tests(client, call)
        return await self._one(client, call)

    async def _tests(self, client: Http, call: Call) -> Outcome:
        """A submission's tests, one request each, all at once; the outputs compared here."""
        assert call.tests is not None
        outcomes = await asyncio.gather(*(self._one(client, Call(call.code, t.stdin, call.timeout,
                                                                 language=call.language))
                                          for t in call.tests))
        for outcome in outcomes:
            if outcome.status in SERVICE_ERRORS:
                return outcome
        passed = sum(o.status == "ok" and same_output(o.stdout, t.expected_stdout, CODE_COMPARE, 1e-6)
                     for o, t in zip(outcomes, call.tests, strict=True))
        return Outcome("ok", f"{passed}/{len(call.tests)}", None, sum(o.run_s or 0.0 for o in outcomes))

    async def _one(self, client: Http, call: Call) -> Outcome:
        try:
            response = await client.post(self.call_path, json=self.body(call))
        except Exception as exc:  # a refused connection, a reset, a malformed URL: the call got no answer
            return Outcome("http_error", error=f"{type(exc).__name__}: {exc}"[:200])
        if response.status_code == 504 or response.status_code == 429:
            return Outcome("overloaded", error=_short(response))
        if response.status_code == 422:
            return Outcome("rejected", error=_short(response))
        if response.status_code != 200:
            return Outcome("http_error", error=_short(response))
        try:
            data = response.json()
            if not isinstance(data, dict):
                raise TypeError(f"a JSON {type(data).__name__}, not an object")
            return self.outcome(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return Outcome("http_error", error=f"unexpected {self.name} answer ({exc!r}): {response.text[:200]}")

    async def _trial(self, client: Http) -> Outcome:
        """A trial call that prints 1."""
        return await self.call(client, Call("print(1)"))

    async def check(self, client: Http) -> None:
        """Raise TargetError unless the target is up, speaks this API and runs `print(1)`."""
        base = client.url
        try:
            ping = await client.get(self.ping_path)
        except Exception as exc:
            raise TargetError(f"cannot reach {base} ({type(exc).__name__}: {exc}); is the service running?") from exc
        if ping.status_code == 404:
            raise TargetError(f"{base} does not speak the {self.name} API: GET {self.ping_path} answered 404; "
                              f"pick the right --api ({', '.join(APIS)})")
        if ping.status_code >= 400:
            raise TargetError(f"{base} is not ready: GET {self.ping_path} answered {_short(ping)}")
        result = await self._trial(client)
        if result.status == "http_error" and result.error and "HTTP 404" in result.error:
            raise TargetError(f"{base} does not speak the {self.name} API: POST {self.call_path} answered 404; "
                              f"pick the right --api ({', '.join(APIS)})")
        if result.status != "ok" or result.stdout.strip() != "1":
            raise TargetError(f"{base} failed a trial call (print(1)) through the {self.name} API: "
                              f"{result.error or f'status {result.status}, stdout {result.stdout[:80]!r}'}")


class CodeenvApi(Api):
    name, ping_path, call_path = "codeenv", "/readyz", "/v1/execute"

    def body(self, call: Call) -> dict[str, Any]:
        body: dict[str, Any] = {"code": call.code, "stdin": call.stdin, "language": call.language}
        if call.timeout is not None:
            body["limits"] = {"wall_s": call.timeout}
        return body

    def outcome(self, data: Any) -> Outcome:
        if not isinstance(data.get("status"), str):
            raise TypeError("no status in the answer")
        return Outcome(data["status"], str(data.get("stdout") or ""), float(data.get("queue_s") or 0.0),
                       float(data.get("wall_s") or 0.0))


class CodeenvClientApi(CodeenvApi):
    """codeenv through its own client library (`codeenv.client.AsyncClient`), which coalesces the
    calls in flight into streamed batches: what a trainer that uses the client sends."""

    name = "codeenv-client"

    def __init__(self) -> None:
        self._client: Any = None

    async def start(self, url: str) -> None:
        from codeenv.client import AsyncClient

        self._client = AsyncClient(url, retries=0)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def call(self, client: Http, call: Call) -> Outcome:
        from codeenv.client import RequestRejected

        try:
            result = await self._client.run(call.code, stdin=call.stdin, language=call.language,
                                            limits={"wall_s": call.timeout} if call.timeout is not None else None)
        except RequestRejected as exc:
            return Outcome("rejected", error=f"{type(exc).__name__}: {exc}"[:200])
        except Exception as exc:  # ClientError, or a call the client's model refuses before sending
            return Outcome("http_error", error=f"{type(exc).__name__}: {exc}"[:200])
        return Outcome(result.status.value, result.stdout, result.queue_s, result.wall_s)


class JudgeApi(Api):
    """codeenv's ``POST /v1/judge``: a submission and all its tests in one request."""

    name, ping_path, call_path = "judge", "/readyz", "/v1/judge"

    async def call(self, client: Http, call: Call) -> Outcome:
        if call.tests is None:  # a plain program: a submission with one test, its output expected
            return Outcome("rejected", error="the judge API runs code workloads (calls with tests)")
        return await self._one(client, call)

    async def _trial(self, client: Http) -> Outcome:
        outcome = await self.call(client, Call("print(1)", tests=(Test("", "1"),)))
        return Outcome(outcome.status, "1" if outcome.stdout == "1/1" else outcome.stdout, error=outcome.error)

    def body(self, call: Call) -> dict[str, Any]:
        assert call.tests is not None
        body: dict[str, Any] = {"code": call.code, "compare": CODE_COMPARE.value, "language": call.language,
                                "tests": [{"stdin": t.stdin, "expected_stdout": t.expected_stdout}
                                          for t in call.tests]}
        if call.timeout is not None:
            body["limits"] = {"cpu_s": call.timeout}
        return body

    def outcome(self, data: Any) -> Outcome:
        status = data.get("status")
        if status in ("overloaded", "internal_error", "rejected"):
            return Outcome(status, "", data.get("queue_s"), data.get("wall_s"), data.get("message"))
        if status not in ("passed", "failed", "compile_error"):
            raise TypeError(f"no judge status in the answer: {status!r}")
        return Outcome("ok", f"{data['passed']}/{data['total']}", float(data.get("queue_s") or 0.0),
                       float(data.get("wall_s") or 0.0))


class CodeJudgeApi(Api):
    """code-judge's ``POST /run`` (its result says only success, run_success, cost and reason)."""

    name, ping_path, call_path = "code-judge", "/ping", "/run"

    def body(self, call: Call) -> dict[str, Any]:
        return {"type": call.language, "solution": call.code, "input": call.stdin}

    def outcome(self, data: Any) -> Outcome:
        if data.get("reason") == "worker_timeout":
            status = "timeout"
        elif data.get("reason") == "queue_timeout":
            status = "overloaded"
        elif data.get("reason") == "invalid_input":
            status = "rejected"
        elif data.get("reason"):
            status = "internal_error"
        else:
            status = "ok" if data["run_success"] else "error"
        return Outcome(status, str(data.get("stdout") or ""), None, float(data.get("cost") or 0.0))


class SandboxFusionApi(Api):
    """SandboxFusion's ``POST /run_code``."""

    name, ping_path, call_path = "sandbox-fusion", "/v1/ping", "/run_code"

    def body(self, call: Call) -> dict[str, Any]:
        body: dict[str, Any] = {"code": call.code, "stdin": call.stdin, "language": call.language}
        if call.timeout is not None:
            body["run_timeout"] = call.timeout
        return body

    def outcome(self, data: Any) -> Outcome:
        run = data.get("run_result") or {}
        if not isinstance(run, dict):
            raise TypeError("run_result is not an object")
        if data["status"] == "SandboxError":
            status = "internal_error"
        elif run.get("status") == "TimeLimitExceeded":
            status = "timeout"
        else:
            status = "ok" if data["status"] == "Success" else "error"
        return Outcome(status, run.get("stdout") or "", None, float(run.get("execution_time") or 0.0))


def api(name: str) -> Api:
    apis: dict[str, type[Api]] = {"codeenv": CodeenvApi, "codeenv-client": CodeenvClientApi, "judge": JudgeApi,
                                  "code-judge": CodeJudgeApi, "sandbox-fusion": SandboxFusionApi}
    if name not in apis:
        raise TargetError(f"unknown API {name!r}; choose from {', '.join(APIS)}")
    return apis[name]()
