"""A request's JSON body, read and parsed without taking much more memory than its size, and
without stalling the other clients.

Parsed in the event loop, a 60 MiB body of `{}` took the gateway from 66 MiB to 1.6 GiB and held
every other client for 2 s (`json.loads` makes a 64-byte dict of three bytes). So:

- a body of at most `INLINE_BYTES` is kept and parsed here: whatever its shape, it takes at most
  about 1 MiB, in well under a millisecond;
- a larger one is written to a memfd as it arrives, never into the gateway's heap, and parsed by a
  helper process (`python -m codeenv.capped_json`) whose address space may grow by at most
  `PARSED_TIMES` the body's size plus `SLACK_BYTES` for it: a body that would take more is refused
  (413), and the gateway never holds its parse. The value comes back pickled (strings are copied
  whole, not scanned again) while the event loop serves everyone else.

Usage::

    parser = BodyParser()
    body = Body()
    body.add(chunk)                     # as the chunks arrive
    value = await parser.parse(body)    # ApiError 400 or 413 for what cannot be taken
    await parser.close()                # with the app
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import pickle
import sys
from typing import Any

from codeenv.capped_json import HEADER
from codeenv.errors import ApiError

#: Bodies up to this size are parsed in the event loop (at most ~1 MiB parsed, whatever the shape).
INLINE_BYTES = 32 << 10
#: What a larger body may take once parsed, in multiples of its size, and what the parse may take
#: besides (the helper's read of the body and its own buffers).
PARSED_TIMES = 2
SLACK_BYTES = 16 << 20
#: Parses at once, each in a helper process of its own (started on first use).
HELPERS = 2
#: Allocations of this size or more are mapped apart, and unmapped when freed (`return_large_frees`).
LARGE_BYTES = 256 << 10
M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>


def return_large_frees() -> bool:
    """Give a large buffer's memory back to the system as soon as it is freed (glibc). By default
    glibc raises its mmap threshold to the size of each large block freed, up to 32 MiB: after one
    large body, the next ones' buffers and values were carved out of the heap, and their pages stayed
    with the gateway once freed (10 MiB of a 30 MiB body kept while its call ran, in half the runs).
    A fixed threshold keeps every block of LARGE_BYTES or more in a mapping of its own. True if set."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library by that name (musl has it, and ignores it)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, LARGE_BYTES))


class Body:
    """A request body as it arrives: in memory while small, then in a memfd."""

    def __init__(self) -> None:
        self.size = 0
        self.head = bytearray()
        self.fd: int | None = None

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.fd is None and self.size <= INLINE_BYTES:
            self.head += chunk
            return
        if self.fd is None:
            self.fd = os.memfd_create("codeenv-body", os.MFD_CLOEXEC)
            self._write(self.head)
            self.head = bytearray()
        self._write(chunk)

    def _write(self, data: bytes | bytearray) -> None:
        assert self.fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def is_blank(self) -> bool:
        """Empty, or only whitespace."""
        return self.fd is None and not self.head.strip()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.head = bytearray()


class _Helper:
    """One helper process and its pipes; one parse at a time."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls) -> _Helper:
        return cls(await asyncio.create_subprocess_exec(
            sys.executable, "-m", "codeenv.capped_json", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE))

    async def parse(self, path: str, allowance: int) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{path} {allowance}\n".encode())
        await self.proc.stdin.drain()
        kind, size = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
        payload = await self.proc.stdout.readexactly(size)
        if kind == b"v":
            return pickle.loads(payload)
        name, _, message = payload.decode().partition(" ")
        raise {"MemoryError": MemoryError, "RecursionError": RecursionError, "ValueError": ValueError}.get(
            name, OSError)(message)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


class BodyParser:
    """Parses JSON bodies: small ones here, large ones in helper processes."""

    def __init__(self) -> None:
        self._idle: list[_Helper] = []
        self._all: set[_Helper] = set()
        self._slots = asyncio.Semaphore(HELPERS)

    async def parse(self, body: Body) -> Any:
        """The body's JSON value; ApiError 400 (not JSON, nested too deeply) or 413 (it would take
        more than PARSED_TIMES its size once parsed). The body is closed."""
        try:
            if body.fd is None:
                return json.loads(body.head)
            return await self._parse_aside(body.fd, body.size)
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
        async with self._slots:
            helper = self._idle.pop() if self._idle else None
            try:
                if helper is None:
                    helper = await _Helper.start()
                    self._all.add(helper)
                value = await helper.parse(f"/proc/{os.getpid()}/fd/{fd}", PARSED_TIMES * size + SLACK_BYTES)
            except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError) as exc:
                # Killed, or a parse given up half way: that helper is not used again.
                if helper is not None:
                    self._all.discard(helper)
                    await asyncio.shield(helper.stop())
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise ApiError(503, "the body's parser stopped; send the request again",
                               {"Retry-After": "1"}) from None
            self._idle.append(helper)
            return value

    async def close(self) -> None:
        """Stop the helpers (with the app)."""
        helpers, self._all, self._idle = self._all, set(), []
        for helper in helpers:
            await helper.stop()
