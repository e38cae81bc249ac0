"""The embedded queue: calls go straight to an in-process slot pool (no Redis needed).

Usage::

    queue = EmbeddedQueue(SlotPool(settings), max_queued=100_000)
    await queue.start()
    results = await queue.submit([ExecRequest(code="print(1)")])
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from codeenv.errors import InvalidRequest, PoolClosed
from codeenv.models import ExecRequest, ExecResult, Status
from codeenv.sandbox.pool import SlotPool


class EmbeddedQueue:
    """An in-process queue in front of a SlotPool, bounded by `max_queued` waiting calls."""

    def __init__(self, pool: SlotPool, max_queued: int) -> None:
        self.pool = pool
        self.max_queued = max_queued
        self.in_flight = 0

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    def ready(self) -> bool:
        return self.pool.is_open and any(not z.dead for s in self.pool.slots for z in s.zygotes.values())

    async def submit(self, requests: Sequence[ExecRequest]) -> list[ExecResult]:
        room = max(0, self.max_queued + len(self.pool.slots) - self.in_flight)
        admitted, refused = requests[:room], requests[room:]
        self.in_flight += len(admitted)
        try:
            results = list(await asyncio.gather(*(self._one(r) for r in admitted)))
        finally:
            self.in_flight -= len(admitted)
        results += [ExecResult(id=r.id, status=Status.overloaded, started=False,
                               message=f"more than {self.max_queued} calls are waiting; retry later")
                    for r in refused]
        return results

    async def _one(self, request: ExecRequest) -> ExecResult:
        try:
            return await self.pool.run(request)
        except InvalidRequest as exc:
            return ExecResult(id=request.id, status=Status.rejected, started=False, message=str(exc))
        except PoolClosed as exc:
            return ExecResult(id=request.id, status=Status.overloaded, started=False, message=str(exc))
