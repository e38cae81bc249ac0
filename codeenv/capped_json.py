"""Parsing JSON in an address space capped at what the text may take once parsed.

Python's `json.loads` turns the three bytes `{},` into a 64-byte dict and a list slot: a body of
them takes 20 to 40 times its size. `loads_capped` runs in a helper process of the gateway
(`codeenv.api.body`) with RLIMIT_AS lowered, for the time of one parse, to what it holds now plus
`allowance`: a text whose parse needs more raises MemoryError there, and the gateway never holds it.
Standard library only: the helper imports nothing else.
"""

from __future__ import annotations

import json
import resource
from typing import Any

_PAGE = resource.getpagesize()


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * _PAGE


def load_capped(path: str, allowance: int) -> Any:
    """The JSON value of the file at `path` (the gateway's memfd, as /proc/PID/fd/N), parsed with
    at most `allowance` more bytes of address space; MemoryError past it."""
    with open(path, "rb") as f:
        return loads_capped(f.read(), allowance)


def loads_capped(text: bytes | bytearray, allowance: int) -> Any:
    """`json.loads(text)` with at most `allowance` more bytes of address space; MemoryError past it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space_bytes() + allowance
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:  # without the text it carries, which would travel back whole
        raise ValueError(str(exc)) from None
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
