"""An in-memory CallQueue: the gateway's contract (bodies, caps, tokens, browsers, statuses) tested
without a jail, as httpx's MockTransport tests a client without a network.

`FakeQueue` answers each call at once with `answer(request)` (by default: `ok`, with the call's
stdin echoed as its stdout) and keeps what it was sent in `calls`. It admits each call as a worker
would, so a call the server refuses is answered `rejected` with the worker's message.

Usage::

    queue = FakeQueue()
    async with gateway(queue=queue) as client:
        await client.post("/v1/execute", json={"code": "print(1)", "stdin": "hi"})
    assert queue.calls[0].code == "print(1)"
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from codeenv.admission import admit, judge_limits
from codeenv.errors import InvalidRequest
from codeenv.models import ExecRequest, ExecResult, Status
from codeenv.queue.base import NO_STATS, OnResult
from codeenv.settings import GatewaySettings


def echo(request: ExecRequest) -> ExecResult:
    """The default answer: the call ran, and printed its stdin."""
    return ExecResult(id=request.id, status=Status.ok, started=True, exit_code=0, stdout=request.stdin)


class FakeQueue:
    """A CallQueue that runs nothing: each call is admitted, recorded, and answered by `answer`."""

    def __init__(self, answer: Callable[[ExecRequest], ExecResult] = echo,
                 settings: GatewaySettings | None = None) -> None:
        self.answer = answer
        self.settings = settings or GatewaySettings()
        self.calls: list[ExecRequest] = []
        self.results: dict[str, ExecResult] = {}
        self.draining = False

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def submit(self, requests: Sequence[ExecRequest], gone: asyncio.Event | None = None,
                     accepted_at: float | None = None, on_result: OnResult | None = None) -> list[ExecResult]:
        results = [self._one(request) for request in requests]
        if on_result is not None:
            for index, result in enumerate(results):
                on_result(index, result)
        return results

    def _one(self, request: ExecRequest) -> ExecResult:
        if self.draining:
            return ExecResult(id=request.id, status=Status.overloaded, started=False, message="stopping")
        try:
            if request.judge is not None:
                judge_limits(request, self.settings)
            else:
                admit(request, self.settings)
        except InvalidRequest as exc:
            return ExecResult(id=request.id, status=Status.rejected, started=False, message=str(exc))
        self.calls.append(request)
        result = self.answer(request)
        if request.id is not None:
            self.results[request.id] = result
        return result

    def ready(self) -> bool:
        return not self.draining

    def drain(self, until: float) -> None:
        self.draining = True

    def force(self) -> None:
        self.draining = True

    async def lookup(self, call_id: str) -> tuple[bool, ExecResult | None]:
        result = self.results.get(call_id)
        return result is not None, result

    def stats(self) -> dict[str, float]:
        return dict(NO_STATS)
