"""The embedded queue: calls go straight to an in-process slot pool (no Redis needed).

Usage::

    queue = EmbeddedQueue(SlotPool(settings), max_queued=100_000)
    await queue.start()
    results = await queue.submit([ExecRequest(code="print(1)")])
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Sequence

from codeenv.errors import InvalidRequest, PoolClosed
from codeenv.models import ExecRequest, ExecResult, Status
from codeenv.sandbox.pool import SlotPool


class EmbeddedQueue:
    """An in-process queue in front of a SlotPool, bounded by `max_queued` waiting calls.

    Calls that carry a client id are remembered for `results_ttl_s` after they end: the same id
    sent again (a retry after a lost connection) attaches to the same call instead of running it
    twice, and `result(id)` answers it.
    """

    def __init__(self, pool: SlotPool, max_queued: int, results_ttl_s: float = 600.0,
                 max_remembered: int = 200_000) -> None:
        self.pool = pool
        self.max_queued = max_queued
        self.in_flight = 0
        self.results_ttl_s = results_ttl_s
        self.max_remembered = max_remembered
        # id -> (fingerprint, the call's future, when it ended or None); oldest first
        self._calls: OrderedDict[str, tuple[str, asyncio.Future[ExecResult], float | None]] = OrderedDict()
        self._tasks: set[asyncio.Future[ExecResult]] = set()

    async def start(self) -> None:
        await self.pool.start()

    async def close(self, grace_s: float = 30.0) -> None:
        """Let running calls finish (up to `grace_s`), then stop the pool."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        await self.pool.close()

    def stats(self) -> dict[str, float]:
        slots = len(self.pool.slots)
        free = self.pool.free_slots
        return {"slots": slots, "free_slots": free, "slot_restarts": self.pool.restarts,
                "waiting": max(0, self.in_flight - (slots - free))}

    def ready(self) -> bool:
        return self.pool.is_open and any(not z.dead for s in self.pool.slots for z in s.zygotes.values())

    async def submit(self, requests: Sequence[ExecRequest]) -> list[ExecResult]:
        self._forget_expired()
        room = max(0, self.max_queued + len(self.pool.slots) - self.in_flight)
        work: list[Awaitable[ExecResult]] = []
        for request in requests:
            known = self._calls.get(request.id) if request.id is not None else None
            if known is not None:
                work.append(self._attach(request, *known))
            elif room > 0:
                room -= 1
                self.in_flight += 1  # counted now, so concurrent submits see it
                future: asyncio.Future[ExecResult] | None = None
                if request.id is not None:
                    # Registered now, not when the coroutine first runs: a resubmission arriving in
                    # the same tick must find it.
                    future = asyncio.get_running_loop().create_future()
                    future.add_done_callback(lambda f: f.cancelled() or f.exception())
                    self._calls[request.id] = (_fingerprint(request), future, None)
                work.append(self._tracked(request, future))
            else:
                work.append(self._overloaded(request))
        # The calls run as tasks of their own, so a caller that goes away (a dropped connection)
        # cannot leave a registered call unfinished or the in-flight count wrong.
        tasks = [asyncio.ensure_future(w) for w in work]
        for task in tasks:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return list(await asyncio.shield(asyncio.gather(*tasks)))

    def result(self, call_id: str) -> ExecResult | None:
        """The result of a remembered call that has ended, if any."""
        known = self._calls.get(call_id)
        if known is None or not known[1].done() or known[1].cancelled():
            return None
        return known[1].result()

    def known(self, call_id: str) -> bool:
        return call_id in self._calls

    async def _overloaded(self, request: ExecRequest) -> ExecResult:
        return ExecResult(id=request.id, status=Status.overloaded, started=False,
                          message=f"more than {self.max_queued} calls are waiting; retry later")

    async def _tracked(self, request: ExecRequest, future: asyncio.Future[ExecResult] | None) -> ExecResult:
        try:
            if request.id is None or future is None:
                return await self._one(request)
            try:
                result = await self._one(request)
            except BaseException as exc:
                if not future.done():
                    future.set_exception(exc)
                self._calls.pop(request.id, None)
                raise
            future.set_result(result)
            if result.status in (Status.overloaded, Status.rejected) or not result.started:
                self._calls.pop(request.id, None)  # never ran: the same id may be sent again
            else:
                self._calls[request.id] = (self._calls[request.id][0], future, time.monotonic())
                self._calls.move_to_end(request.id)
            return result
        finally:
            self.in_flight -= 1

    async def _attach(self, request: ExecRequest, fingerprint: str, future: asyncio.Future[ExecResult],
                      _ended: float | None) -> ExecResult:
        if fingerprint != _fingerprint(request):
            return ExecResult(id=request.id, status=Status.rejected, started=False,
                              message=f"id {request.id!r} already names a different call; use a new id")
        return await asyncio.shield(future)

    def _forget_expired(self) -> None:
        now = time.monotonic()
        for call_id, (_, _, ended) in list(self._calls.items()):
            if len(self._calls) <= self.max_remembered and (ended is None or now - ended < self.results_ttl_s):
                break
            if ended is not None:
                del self._calls[call_id]

    async def _one(self, request: ExecRequest) -> ExecResult:
        try:
            return await self.pool.run(request)
        except InvalidRequest as exc:
            return ExecResult(id=request.id, status=Status.rejected, started=False, message=str(exc))
        except PoolClosed as exc:
            return ExecResult(id=request.id, status=Status.overloaded, started=False, message=str(exc))


def _fingerprint(request: ExecRequest) -> str:
    """What makes two submissions the same call."""
    canonical = json.dumps(request.model_dump(exclude={"id"}), sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()
