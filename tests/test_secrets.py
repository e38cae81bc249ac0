"""Secrets reach codeenv's processes through the environment, never a command line (`ps` shows every
process's argv to every user of the host), and each process gets only the secrets it needs."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from codeenv.bench.services import Service, free_port, redis_ready, wait_ready
from tests.conftest import jail_env, until

pytestmark = [pytest.mark.jail, pytest.mark.slow]


def command_lines() -> dict[int, bytes]:
    lines = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:
                pass
    return lines


def _ping(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(128)
    except OSError:
        return b""


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:
        return False
    return True


def redis_with_config(tmp_path: Path, config: str) -> tuple[Service, int]:
    """A redis-server on a free port whose secrets are in a config file only root reads (not its argv)."""
    conf = tmp_path / "redis.conf"
    conf.write_text(f"save \"\"\nappendonly no\n{config}")
    conf.chmod(0o600)
    port = free_port()
    binary = shutil.which("redis-server")
    assert binary is not None
    redis = Service("redis-server", [binary, str(conf), "--port", str(port), "--bind", "127.0.0.1"], port=port,
                    log=tmp_path / "redis.log")
    return redis.start(), port


def environment(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


async def test_serve_with_processes_puts_no_secret_on_a_command_line(tmp_path: Path) -> None:
    password, token = secrets.token_hex(16), secrets.token_hex(16)
    # A redis-server that needs the password.
    redis, port = redis_with_config(tmp_path, f"requirepass {password}\n")
    gateway_port = free_port()
    url = f"http://127.0.0.1:{gateway_port}"
    gateway = Service("codeenv serve", [sys.executable, "-m", "codeenv.cli", "serve", "--processes", "2", "--slots",
                                        "1", "--port", str(gateway_port), "--log-level", "warning"],
                      port=gateway_port, url=url, log=tmp_path / "serve.log",
                      env=jail_env(CODEENV_REDIS_URL=f"redis://:{password}@127.0.0.1:{port}/0", CODEENV_TOKEN=token))
    gateway.start()
    auth = {"Authorization": f"Bearer {token}"}
    try:
        await asyncio.to_thread(wait_ready, url, 180, auth)
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=60) as client:
            r = await client.post("/v1/execute", json={"code": "print(6 * 7)"})
            assert r.status_code == 200 and r.json()["stdout"] == "42\n", r.text
        lines = command_lines()
        for pid, line in lines.items():
            assert password.encode() not in line and token.encode() not in line, (pid, line)
        # The pool process (a `codeenv worker` here) has the Redis URL, and not the gateways' token.
        workers = [pid for pid, line in lines.items() if b"codeenv.cli\x00worker" in line]
        assert workers, "no worker process found"
        for pid in workers:
            env = environment(pid)
            assert password.encode() in env and token.encode() not in env
    finally:
        gateway.stop()
        redis.stop()


#: As docs/deploy.md gives them.
GATEWAY_ACL = ("~codeenv:* resetchannels +@read +@write +@stream +@scripting +@transaction +@connection "
               "-@dangerous +info +time")
WORKER_ACL = GATEWAY_ACL


@pytest.mark.redis
async def test_gateway_and_worker_run_as_redis_users_of_their_own(tmp_path: Path) -> None:
    # The ACL users docs/deploy.md gives, on a real redis-server: a gateway and a worker each with
    # their own user and password, and the default user off.
    gateway_pw, worker_pw = secrets.token_hex(16), secrets.token_hex(16)
    redis, port = redis_with_config(tmp_path, f"user default off\nuser codeenv-gateway on >{gateway_pw} {GATEWAY_ACL}\n"
                                              f"user codeenv-worker on >{worker_pw} {WORKER_ACL}\n")
    await until(lambda: redis_ready(port) or b"NOAUTH" in _ping(port), "redis-server listening", 30)
    url = f"redis://codeenv-{{}}:{{}}@127.0.0.1:{port}/0"
    worker = Service("codeenv worker", [sys.executable, "-m", "codeenv.cli", "worker", "--slots", "1"],
                     env=jail_env(CODEENV_REDIS_URL=url.format("worker", worker_pw)), log=tmp_path / "worker.log")
    gateway_port = free_port()
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    gateway = Service("codeenv serve", [sys.executable, "-m", "codeenv.cli", "serve", "--no-local-worker",
                                        "--port", str(gateway_port), "--log-level", "warning"],
                      port=gateway_port, url=gateway_url, log=tmp_path / "serve.log",
                      env=jail_env(CODEENV_REDIS_URL=url.format("gateway", gateway_pw)))
    worker.start()
    gateway.start()
    try:
        await gateway.await_ready(180)
        async with httpx.AsyncClient(base_url=gateway_url, timeout=120) as client:
            r = await client.post("/v1/execute/batch", json={"requests": [{"code": f"print({i})"} for i in range(4)]})
            assert r.status_code == 200, r.text
            assert [x["stdout"] for x in r.json()["results"]] == [f"{i}\n" for i in range(4)], r.text
        for log in ("worker.log", "serve.log"):
            assert "NOPERM" not in (tmp_path / log).read_text(), (tmp_path / log).read_text()[-2000:]
    finally:
        gateway.stop()
        worker.stop()
        redis.stop()


@pytest.mark.redis
async def test_redis_over_tls_end_to_end(tmp_path: Path) -> None:
    # A self-signed certificate for 127.0.0.1; the service verifies it against that CA file.
    openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
               "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(tmp_path / "key.pem"),
               "-out", str(tmp_path / "cert.pem")]
    await asyncio.to_thread(subprocess.run, openssl, check=True, capture_output=True)
    port = free_port()
    binary = shutil.which("redis-server")
    assert binary is not None
    redis = Service("redis-server", [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                                     "--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-key-file",
                                     str(tmp_path / "key.pem"), "--tls-ca-cert-file", str(tmp_path / "cert.pem"),
                                     "--tls-auth-clients", "no", "--save", "", "--appendonly", "no"],
                    port=port, log=tmp_path / "redis.log").start()
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={tmp_path / 'cert.pem'}"
    gateway_port = free_port()
    gateway = Service("codeenv serve", [sys.executable, "-m", "codeenv.cli", "serve", "--slots", "1", "--port",
                                        str(gateway_port), "--log-level", "warning"],
                      port=gateway_port, url=f"http://127.0.0.1:{gateway_port}", log=tmp_path / "serve.log",
                      env=jail_env(CODEENV_REDIS_URL=url))
    try:
        await until(lambda: _listening(port), "redis-server listening", 30)
        gateway.start()
        await gateway.await_ready(180)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            r = await client.post("/v1/execute", json={"code": "print(6 * 7)"})
            assert r.status_code == 200 and r.json()["stdout"] == "42\n", r.text
    finally:
        gateway.stop()
        redis.stop()
