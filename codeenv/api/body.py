"""A request's JSON body, read and parsed without taking much more memory than its size, and
without stalling the other clients.

Parsed in the event loop, a 60 MiB body of `{}` took the gateway from 66 MiB to 1.6 GiB and held
every other client for 2 s (`json.loads` makes a 64-byte dict of three bytes). So:

- a body of at most `INLINE_BYTES` is kept and parsed here: whatever its shape, it takes at most
  about 1 MiB, in well under a millisecond;
- a larger one is written as it arrives to a memfd, never into the gateway's heap, and parsed by a
  helper process (`codeenv.capped_json`) whose address space may grow by at most `PARSED_TIMES`
  the body's size plus `SLACK_BYTES` for it: a body that would take more is refused (413), and the
  gateway never holds its parse. The value comes back pickled (strings copied whole, not
  re-scanned) while the event loop serves everyone else.

Usage::

    parser = BodyParser()
    body = parser.body(declared_length)    # a Body: .add(chunk) as chunks arrive
    value = await parser.parse(body)       # ApiError 400 or 413 for what cannot be taken
    parser.close()                         # with the app
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from codeenv.capped_json import load_capped
from codeenv.errors import ApiError

#: Bodies up to this size are parsed in the event loop (at most ~1 MiB parsed, whatever the shape).
INLINE_BYTES = 32 << 10
#: What a larger body may take once parsed, in multiples of its size, and what the parse may take
#: besides (the helper's read of the body and its own buffers).
PARSED_TIMES = 2
SLACK_BYTES = 16 << 20
#: Parses at once (each in its own helper process).
HELPERS = 2


class Body:
    """A request body as it arrives: in memory while small, then in a memfd."""

    def __init__(self) -> None:
        self.size = 0
        self._head = bytearray()
        self._fd: int | None = None

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._fd is None and self.size <= INLINE_BYTES:
            self._head += chunk
            return
        if self._fd is None:
            self._fd = os.memfd_create("codeenv-body", os.MFD_CLOEXEC)
            self._write(self._head)
            self._head = bytearray()
        self._write(chunk)

    def _write(self, data: bytes | bytearray) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def is_blank(self) -> bool:
        """Empty, or only whitespace."""
        return self._fd is None and not self._head.strip()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._head = bytearray()


class BodyParser:
    """Parses JSON bodies: small ones here, large ones in helper processes started on first use."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, body: Body) -> Any:
        """The body's JSON value; ApiError 400 (not JSON, nested too deeply) or 413 (it would take
        more than PARSED_TIMES its size once parsed). The body is closed."""
        try:
            if body._fd is None:
                return json.loads(body._head)
            return await self._parse_aside(body._fd, body.size)
        except RecursionError:  # the C decoder refuses nesting past the recursion limit
            raise ApiError(400, "the JSON body is nested too deeply") from None
        except MemoryError:
            raise ApiError(413, f"the JSON body would take more than {PARSED_TIMES} times its {body.size} bytes "
                                "once parsed: send fewer, larger values (a batch of calls, not a list of "
                                "empty objects)") from None
        except ValueError as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        finally:
            body.close()

    async def _parse_aside(self, fd: int, size: int) -> Any:
        if self._pool is None:
            # forkserver: a helper is a fresh interpreter, not a fork of the gateway and its threads.
            self._pool = ProcessPoolExecutor(HELPERS, mp_context=multiprocessing.get_context("forkserver"))
        pool = self._pool
        try:
            return await asyncio.wrap_future(pool.submit(
                load_capped, f"/proc/{os.getpid()}/fd/{fd}", PARSED_TIMES * size + SLACK_BYTES))
        except BrokenProcessPool:  # a helper was killed (by the OOM killer, or by hand): start anew
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise ApiError(503, "the body's parser stopped; send the request again", {"Retry-After": "1"}) from None

    def close(self) -> None:
        """Stop the helpers (with the app: no parse is under way then)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
