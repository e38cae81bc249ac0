"""How a gateway process stops on SIGTERM or SIGINT (Ctrl-C), whatever serves it.

uvicorn stops taking connections at the first signal and waits for the requests in flight, up to its
graceful timeout (the grace period), before it cancels them (a plain-text 500 to their clients) and
runs the app's shutdown. So the queue is told at the same moment, by a handler chained in front of
uvicorn's: calls that have not started are answered `overloaded` (started: false) at once, and calls
still running shortly before the grace period ends are stopped and answered `killed`; every request
ends with an answer within the grace period, and the shutdown then has nothing left to wait for.
A second signal stops the running calls at once; a third is uvicorn's own (it exits without waiting).

Usage (in the app's lifespan, after the queue started)::

    restore = drain_on_signals(queue, settings.shutdown_grace_s)
    ...
    restore()

Also how a service process settles once started: `freeze_startup()`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Drainable(Protocol):
    def drain(self, until: float) -> None: ...

    def force(self) -> None: ...


def answers_by(grace_s: float) -> float:
    """When (time.monotonic()) running calls are stopped after a stop signal: early enough that their
    answers reach the clients before the grace period is over."""
    return time.monotonic() + max(0.0, grace_s - max(1.5, 0.1 * grace_s))


def drain_on_signals(queue: Drainable, grace_s: float) -> Callable[[], None]:
    """Chain a stop-signal handler in front of the current ones (uvicorn's); returns what restores them.
    Outside the main thread (where no signal handler can be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {sig: signal.getsignal(sig) for sig in SIGNALS}
    received = 0

    def handler(sig: int, frame: FrameType | None) -> None:
        nonlocal received
        received += 1
        if received == 1:
            until = answers_by(grace_s)
            loop.call_soon_threadsafe(queue.drain, until)
        else:
            loop.call_soon_threadsafe(queue.force)
        if received != 2:  # the second stops the calls, not uvicorn's wait for their answers
            chained = previous[sig]
            if callable(chained):
                chained(sig, frame)

    for sig in SIGNALS:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, chained in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, chained)

    return restore


def freeze_startup() -> None:
    """What a service process made to start (modules, its app, its pool, settings) stays out of the
    garbage collector's scans from here on (CPython's gc.freeze, after a last collection of what
    start-up left): each full collection walked all of it again, about a fifth of a gateway's CPU
    per /v1/execute request (216 -> 175 us). Objects made later are collected as before."""
    gc.collect()
    gc.freeze()
