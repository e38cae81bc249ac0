"""Targets a bench can start itself, on 127.0.0.1 and a free port, and stop again by PID.

- ``codeenv``: ``codeenv serve`` (embedded queue);
- ``codeenv-redis``: a private ``redis-server`` and ``codeenv serve --redis`` (worker in-process);
- ``naive`` / ``naive-jail``: the baselines of `codeenv.bench.baseline` behind the same gateway.

Anything else is a URL of a running service.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from codeenv.bench.apis import TargetError
from codeenv.settings import SandboxSettings

SPAWNABLE = ("codeenv", "codeenv-redis", "naive", "naive-jail")
#: Each spawned target's slots run on host uids of their own: blocks of 1024 (the most slots a pool
#: has) above the default uid_base, clear of the ranges the test suite and the benchmarks use.
UID_OFFSETS = {"codeenv": 1 << 16, "codeenv-redis": (1 << 16) + 1024, "naive-jail": (1 << 16) + 2048,
               "naive": (1 << 16) + 3072}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_local(url: str) -> bool:
    return (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 30) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise TargetError(f"the target exited (status {proc.returncode}) before it was ready:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/readyz").status_code == 200:
                    return
            time.sleep(0.1)
    raise TargetError(f"the target at {url} was not ready within {timeout_s:g}s")


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
    port = free_port()
    env = dict(os.environ, CODEENV_UID_BASE=str(SandboxSettings().uid_base + UID_OFFSETS[spec]))
    sized = ["--slots", str(slots)] if slots else []
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="codeenv-bench-") as tmp:
        log = Path(tmp) / "target.log"
        try:
            with log.open("wb") as out:
                if spec == "codeenv-redis":
                    redis_server = shutil.which("redis-server")
                    if redis_server is None:
                        raise TargetError("codeenv-redis needs redis-server on PATH (Debian: apt install redis-server)")
                    redis_port = free_port()
                    procs.append(subprocess.Popen(
                        [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                         "--appendonly", "no"], stdout=out, stderr=out))
                    sized += ["--redis", f"redis://127.0.0.1:{redis_port}"]
                if spec.startswith("codeenv"):
                    cmd = ["serve", "--port", str(port), "--log-level", "warning", "--log-format", "text", *sized]
                else:
                    cmd = ["baseline", spec, "--port", str(port), *sized]
                procs.append(subprocess.Popen([sys.executable, "-m", "codeenv.cli", *cmd], env=env,
                                              stdout=out, stderr=out))
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, procs[-1], log)
            yield url
        finally:
            for proc in reversed(procs):
                _stop(proc)
