"""Start a codeenv service (or a redis-server) as a subprocess on 127.0.0.1, wait until it is ready,
stop it by PID: the one starter that `codeenv bench`, the benchmarks and the tests share.

    with start_codeenv("serve", "--slots", "2", port=free_port(), log=path) as service:
        service.wait_ready()               # in async code: await service.await_ready()
        httpx.post(service.url + "/v1/execute", json={"code": "print(1)"})

A service that exits before it is ready, or is not ready in time, raises `ServiceError` with the
tail of its log.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Self

import httpx

from codeenv.errors import ServiceError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_ready(url: str, headers: Mapping[str, str] | None = None) -> bool:
    """Whether the codeenv service at `url` answers GET /readyz with 200."""
    try:
        return httpx.get(f"{url.rstrip('/')}/readyz", headers=headers, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def redis_ready(port: int) -> bool:
    """Whether a redis-server on 127.0.0.1:`port` answers PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def wait_ready(url: str, timeout_s: float = 180, headers: Mapping[str, str] | None = None) -> None:
    """Until the codeenv service at `url` (started elsewhere) is ready; ServiceError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not http_ready(url, headers):
        if time.monotonic() > deadline:
            raise ServiceError(f"{url} was not ready within {timeout_s:g}s")
        time.sleep(0.1)


class Service:
    """A process this module starts (and may start again on the same port), stopped by its PID.

    Its stdout and stderr go to `log` (appended; discarded when None). `url` is where it listens.
    """

    def __init__(self, name: str, argv: list[str], *, port: int | None = None, url: str | None = None,
                 env: Mapping[str, str] | None = None, log: Path | None = None) -> None:
        self.name, self.argv, self.port, self.log = name, argv, port, log
        self._url = url
        self.env = dict(os.environ if env is None else env)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise ValueError(f"{self.name} listens on no port")
        return self._url

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ValueError(f"{self.name} is not started")
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has exited (negative: the signal that ended it)."""
        return None if self.proc is None else self.proc.poll()

    def start(self) -> Self:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is running already")
        if self.log is None:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            with self.log.open("ab") as out:
                self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT)
        return self

    def stop(self, grace_s: float = 30) -> int | None:
        """SIGTERM, and SIGKILL if it has not exited after `grace_s`; its exit status (None: never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def kill(self) -> int | None:
        """SIGKILL now (nothing it holds survives), and reap it."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def wait(self, timeout_s: float | None = None) -> int:
        """Until it exits by itself; its exit status (subprocess.TimeoutExpired after `timeout_s`)."""
        if self.proc is None:
            raise ValueError(f"{self.name} is not started")
        return self.proc.wait(timeout_s)

    async def stop_async(self, grace_s: float = 30) -> int | None:
        """`stop` without blocking the event loop."""
        return await asyncio.to_thread(self.stop, grace_s)

    def log_tail(self, chars: int = 2000) -> str:
        if self.log is None or not self.log.exists():
            return "(no log kept)"
        return self.log.read_text(errors="replace")[-chars:]

    def ready(self) -> bool:
        """One probe: redis-server answers PING, codeenv answers GET /readyz with 200. ServiceError if it exited."""
        if self.proc is None:
            raise ValueError(f"{self.name} is not started")
        if self.proc.poll() is not None:
            raise ServiceError(f"{self.name} exited (status {self.proc.returncode}) before it was ready:\n"
                               f"{self.log_tail()}")
        if self.argv[0].endswith("redis-server") and self.port is not None:
            return redis_ready(self.port)
        return http_ready(self.url)

    def wait_ready(self, timeout_s: float = 180) -> Self:
        """Until it is ready (ServiceError if it exits first or takes longer than `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                raise ServiceError(f"{self.name} at {self.url} was not ready within {timeout_s:g}s:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    async def await_ready(self, timeout_s: float = 180) -> Self:
        """`wait_ready` without blocking the event loop."""
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self.ready):
            if time.monotonic() > deadline:
                raise ServiceError(f"{self.name} at {self.url} was not ready within {timeout_s:g}s:\n{self.log_tail()}")
            await asyncio.sleep(0.05)
        return self

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_async()


def start_codeenv(*args: str, port: int | None = None, env: Mapping[str, str] | None = None,
                  log: Path | None = None, uid_base: int | None = None) -> Service:
    """`codeenv ARGS [--port PORT]` (this interpreter's codeenv).

    `env` replaces this process's environment. Its slots run on a block of host uids that it claims
    itself, or from `uid_base` when given (CODEENV_UID_BASE; one inherited from `env` is dropped, so
    that services started side by side never share one).
    """
    argv = [sys.executable, "-m", "codeenv.cli", *args, *(["--port", str(port)] if port is not None else [])]
    environment = {k: v for k, v in (os.environ if env is None else env).items() if k != "CODEENV_UID_BASE"}
    if uid_base is not None:
        environment["CODEENV_UID_BASE"] = str(uid_base)
    url = f"http://127.0.0.1:{port}" if port is not None else None
    return Service(f"codeenv {args[0]}" if args else "codeenv", argv, port=port, url=url, env=environment,
                   log=log).start()


def start_redis(port: int | None = None, log: Path | None = None, timeout_s: float = 30) -> Service:
    """A private redis-server on 127.0.0.1:`port` (default: a free one) that keeps nothing on disk, ready."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError("redis-server is not on PATH (Debian: apt install redis-server)")
    port = free_port() if port is None else port
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    service = Service("redis-server", argv, port=port, url=f"redis://127.0.0.1:{port}/0", log=log)
    return service.start().wait_ready(timeout_s)
