"""Sending the planned calls: generator processes, each an asyncio loop with its own HTTP client.

The parent process only watches: it gathers the records the generators send back (in small
batches, a few times a second), draws the progress bar, and measures how much CPU the generators
themselves used, so that a report can say when the generator, not the target, was the bottleneck.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue as queue_mod
import resource
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier
from typing import Any

from codeenv.bench.apis import SERVICE_ERRORS, Http, Outcome, api
from codeenv.bench.traffic import Item, split
from codeenv.bench.workload import Call, Expected

#: One answered call: (step, trajectory, turn, origin, scheduled, sent, done, status, queue_s,
#: run_s, correct (1, 0, or -1 when unchecked), error). Times are time.monotonic() seconds.
Record = tuple[int, int, int, float, float, float, float, str, float | None, float | None, int, str | None]

FLUSH_S = 0.2


@dataclass
class Part:
    url: str
    api: str
    mode: str
    items: list[Item]
    calls: list[Call]
    expected: list[Expected] | None
    concurrency: int
    http_timeout_s: float
    steps: int = 1


@dataclass
class RoundResult:
    records: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    generator_cpu_s: list[float] = field(default_factory=list)
    watcher_cpu_s: float = 0.0
    failure: str | None = None


def generate(part: Part, barrier: Barrier, out: mp.Queue[Any]) -> None:
    """A generator process's body: run its share of the plan, report records and CPU."""
    try:
        cpu0 = time.process_time()
        asyncio.run(_generate(part, barrier, out))
        out.put(("end", time.process_time() - cpu0))
    except threading.BrokenBarrierError:
        pass  # the round was called off (another generator failed, or the user stopped it)
    except BaseException:
        out.put(("failed", traceback.format_exc()))
        barrier.abort()


async def _generate(part: Part, barrier: Barrier, out: mp.Queue[Any]) -> None:
    speaker = api(part.api)
    buffer: list[Record] = []
    connections = part.concurrency if part.mode == "concurrency" else len({i[1] for i in part.items}) or 1

    async def one(client: Http, item: Item, origin: float, scheduled: float) -> None:
        call = part.calls[item[3]]
        sent = time.monotonic()
        result: Outcome = await speaker.call(client, call)
        done = time.monotonic()
        # A call the service did not run (an HTTP failure, overloaded, rejected) is an error, not a wrong answer.
        correct = -1 if part.expected is None or result.status in SERVICE_ERRORS else \
            int(part.expected[item[3]].matches(result.status, result.stdout))
        buffer.append((item[0], item[1], item[2], origin, scheduled, sent, done, result.status, result.queue_s,
                       result.run_s, correct, result.error))

    async def flusher() -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            flush()

    def flush() -> None:
        if buffer:
            out.put(("records", buffer.copy()))
            buffer.clear()

    async with Http(part.url, part.http_timeout_s, connections if part.mode != "rate" else None) as client:
        await speaker.start(part.url)
        flushing = asyncio.create_task(flusher())
        try:
            if part.mode == "grpo":
                await _grpo(part.items, part.steps, barrier, lambda item, origin, t: one(client, item, origin, t))
            elif part.mode == "concurrency":
                await asyncio.to_thread(barrier.wait)
                origin = time.monotonic()
                pending = iter(part.items)

                async def lane() -> None:
                    for item in pending:
                        await one(client, item, origin, time.monotonic())

                await asyncio.gather(*(lane() for _ in range(part.concurrency)))
            else:
                await asyncio.to_thread(barrier.wait)
                origin = time.monotonic()
                tasks = []
                for item in part.items:
                    scheduled = origin + item[4]
                    if (delay := scheduled - time.monotonic()) > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(one(client, item, origin, scheduled)))
                await asyncio.gather(*tasks)
        finally:
            flushing.cancel()
            flush()
            await speaker.stop()


async def _grpo(items: list[Item], steps_total: int, barrier: Barrier,
                one: Callable[[Item, float, float], Any]) -> None:
    steps: dict[int, dict[int, list[Item]]] = defaultdict(lambda: defaultdict(list))
    for item in items:
        steps[item[0]][item[1]].append(item)
    for step in range(steps_total):  # every generator passes every step's barrier, even with no share of it
        await asyncio.to_thread(barrier.wait)  # every generator starts the step together
        origin = time.monotonic()

        async def trajectory(turns: list[Item], origin: float = origin) -> None:
            for item in turns:
                await asyncio.sleep(item[4])  # the model thinks, then calls its tool
                await one(item, origin, time.monotonic())

        await asyncio.gather(*(trajectory(turns) for turns in steps[step].values()))


def run_round(part: Part, procs: int, on_records: Callable[[list[Record]], None]) -> RoundResult:
    """Send `part.items` from `procs` generator processes; return every record."""
    ctx = mp.get_context("spawn")
    out: mp.Queue[Any] = ctx.Queue()
    shares = [s for s in split(part.items, procs) if s] or [[]]
    barrier = ctx.Barrier(len(shares))
    n = len(shares)
    # The lanes of a saturation run, dealt out so that exactly `concurrency` calls are in flight.
    lanes = [part.concurrency // n + (1 if k < part.concurrency % n else 0) for k in range(n)]
    workers = [ctx.Process(target=generate, daemon=True,
                           args=(Part(part.url, part.api, part.mode, share, part.calls, part.expected,
                                      max(1, lane), part.http_timeout_s, part.steps), barrier, out))
               for share, lane in zip(shares, lanes, strict=True)]
    result = RoundResult()
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    for w in workers:
        w.start()
    ended = 0
    try:
        while ended < len(workers):
            try:
                kind, payload = out.get(timeout=0.5)
            except queue_mod.Empty:
                kind, payload = "", None
            if kind == "records":
                result.records.extend(payload)
                on_records(payload)
            elif kind == "end":
                result.generator_cpu_s.append(payload)
                ended += 1
            elif kind == "failed":
                result.failure = payload
                break
            if dead := [w for w in workers if w.exitcode not in (None, 0)]:
                result.failure = f"a generator process died (exit {dead[0].exitcode})"
                break
    finally:
        barrier.abort()  # generators waiting for a step that will not come give up
        deadline = time.monotonic() + 5
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join()
    result.wall_s = time.monotonic() - t0
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    result.watcher_cpu_s = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return result

