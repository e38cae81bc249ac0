"""Targets a bench can start itself, on 127.0.0.1 and a free port, and stop again by PID.

- ``codeenv``: ``codeenv serve`` (embedded queue);
- ``codeenv-redis``: a private ``redis-server`` and ``codeenv serve --redis`` (worker in-process);
- ``naive`` / ``naive-jail``: the baselines of `codeenv.bench.baseline` behind the same gateway.

Anything else is a URL of a running service.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from codeenv.bench.services import Service, free_port, start_codeenv, start_redis
from codeenv.errors import TargetError

SPAWNABLE = ("codeenv", "codeenv-redis", "naive", "naive-jail")


def is_local(url: str) -> bool:
    return (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def target(spec: str, slots: int | None = None) -> Iterator[str]:
    """The URL of `spec`: as given, or of a service started for the duration of the block."""
    if spec not in SPAWNABLE:
        try:
            parts = urlsplit(spec)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        except ValueError:  # a bad port or bracket
            valid = False
        if not valid:
            raise TargetError(f"target {spec!r}: give a URL (http://127.0.0.1:8000) or one of "
                              f"{', '.join(SPAWNABLE)} to have the bench start it")
        yield spec.rstrip("/")
        return
    sized = ["--slots", str(slots)] if slots else []
    services: list[Service] = []
    with tempfile.TemporaryDirectory(prefix="codeenv-bench-") as tmp:
        log = Path(tmp) / "target.log"
        try:
            if spec == "codeenv-redis":
                services.append(start_redis(log=log))
                sized += ["--redis", services[-1].url]
            if spec.startswith("codeenv"):
                cmd = ["serve", "--log-level", "warning", "--log-format", "text", *sized]
            else:
                cmd = ["baseline", spec, *sized]
            services.append(start_codeenv(*cmd, port=free_port(), log=log))
            yield services[-1].wait_ready().url
        finally:
            for service in reversed(services):
                service.stop()
