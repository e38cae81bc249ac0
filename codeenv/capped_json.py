"""Parsing JSON in an address space capped at what the text may take once parsed: the gateway's
body parser (`codeenv.api.body`) runs this module as its helper processes.

Python's `json.loads` turns the three bytes `{},` into a 64-byte dict and a list slot: a body of
them takes 20 to 40 times its size. Here RLIMIT_AS is lowered, for the time of one parse, to what
the helper holds plus `allowance`: a text whose parse needs more fails with MemoryError here, and
the gateway never holds it. Standard library only.

The helper reads one request per line on stdin, `PATH ALLOWANCE` (PATH: the gateway's memfd as
/proc/PID/fd/N), and answers each on stdout with one byte and an 8-byte length, then that many
bytes: `v` and the value pickled, or `e` and `KIND message` (MemoryError, ValueError,
RecursionError or OSError).
"""

from __future__ import annotations

import json
import pickle
import resource
import struct
import sys
from typing import Any

_PAGE = resource.getpagesize()
HEADER = struct.Struct("!cQ")


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * _PAGE


def loads_capped(text: bytes | bytearray, allowance: int) -> Any:
    """`json.loads(text)` with at most `allowance` more bytes of address space; MemoryError past it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space_bytes() + allowance
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:  # without the text it holds
        raise ValueError(str(exc)) from None
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def serve() -> None:
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        path, allowance = line.decode().split()
        text = b""
        try:
            with open(path, "rb") as f:
                text = f.read()
            answer = b"v" + pickle.dumps(loads_capped(text, int(allowance)), protocol=5)
        except (MemoryError, ValueError, RecursionError, OSError) as exc:
            answer = b"e" + f"{type(exc).__name__} {exc}".encode()
        del text
        out.write(HEADER.pack(answer[:1], len(answer) - 1))
        out.write(memoryview(answer)[1:])
        out.flush()
        del answer


if __name__ == "__main__":
    serve()
