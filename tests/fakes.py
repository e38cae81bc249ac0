"""An in-memory CallQueue: the gateway's contract (bodies, caps, tokens, browsers, statuses) tested
without a jail, as httpx's MockTransport tests a client without a network.

`FakeQueue` answers each call at once with `answer(request)` (by default: `ok`, with the call's
stdin echoed as its stdout) and keeps what it was sent in `calls`. Like every queue it checks
nothing: the gateway admits each call before it reaches the queue. It runs no sessions.

Usage::

    queue = FakeQueue()
    async with gateway(queue=queue) as client:
        await client.post("/v1/execute", json={"code": "print(1)", "stdin": "hi"})
    assert queue.calls[0].code == "print(1)"
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from codeenv.models import ExecRequest, ExecResult, Status
from codeenv.queue.base import NO_STATS, OnResult, SessionService


def echo(request: ExecRequest) -> ExecResult:
    """The default answer: the call ran, and printed its stdin."""
    return ExecResult(id=request.id, status=Status.ok, started=True, exit_code=0, stdout=request.stdin)


class FakeQueue:
    """A CallQueue that runs nothing: each call is recorded and answered by `answer`."""

    sessions: SessionService | None = None

    def __init__(self, answer: Callable[[ExecRequest], ExecResult] = echo) -> None:
        self.answer = answer
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
