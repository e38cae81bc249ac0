"""What the benchmarks share: starting `codeenv serve` and a private redis-server, and waiting for them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx

from codeenv import SandboxSettings


def start_serve(port: int, slots: int, uid_offset: int, *extra: str) -> subprocess.Popen[bytes]:
    """`codeenv serve` on 127.0.0.1:`port`, its slots on a uid range of its own."""
    env = dict(os.environ, CODEENV_UID_BASE=str(SandboxSettings().uid_base + uid_offset))
    return subprocess.Popen(
        [sys.executable, "-m", "codeenv.cli", "serve", "--port", str(port), "--slots", str(slots),
         "--log-level", "warning", *extra], env=env, stderr=subprocess.DEVNULL)


def start_redis(port: int) -> subprocess.Popen[bytes]:
    """A redis-server that keeps nothing on disk, on 127.0.0.1:`port`."""
    return subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)


async def wait_ready(url: str, timeout_s: float = 90) -> None:
    """Until the service at `url` answers /readyz with 200."""
    async with httpx.AsyncClient(base_url=url) as c:
        for _ in range(int(timeout_s * 10)):
            try:
                if (await c.get("/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} never became ready")
