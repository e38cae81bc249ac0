"""The roles a codeenv process plays, and how they start and stop. `cli.py` parses arguments into
settings and calls one of these.

- `run_gateway`: ``codeenv serve`` — one uvicorn process over the queue the settings select, or
  ``--processes N`` uvicorn processes over one pool process (`run_pool`, or a Redis worker).
- `run_pool`: the host's slot pool behind ``serve --processes N`` without Redis (a Unix socket).
- `run_worker`: ``codeenv worker`` — a Redis worker with its slot pool.

Queue backends are a table of import strings (`QUEUES`), loaded on use, so that a process imports
only the backend it runs. Every role stops in two stages (`on_stop_signals`): the first SIGTERM or
SIGINT drains (no new work; running calls finish within the grace period), the second forces.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from codeenv.errors import PoolFailed
from codeenv.settings import GatewaySettings, QueueSettings, SandboxSettings
from codeenv.stopping import answers_by, freeze_startup

if TYPE_CHECKING:
    from fastapi import FastAPI

    from codeenv.queue.base import CallQueue
    from codeenv.sandbox.image import Progress

logger = logging.getLogger(__name__)

#: The queue backends, by name: "module:function" building a CallQueue from GatewaySettings.
QUEUES: Mapping[str, str] = {
    "embedded": "codeenv.queue.embedded:from_settings",
    "host_socket": "codeenv.queue.host_socket:from_settings",
    "redis": "codeenv.queue.redis:from_settings",
}


def queue_backend(settings: GatewaySettings) -> str:
    """Which backend the settings select: the host's pool socket, Redis, else an embedded pool."""
    if settings.pool_socket is not None:
        return "host_socket"
    if settings.redis_url is not None:
        return "redis"
    return "embedded"


def build_queue(settings: GatewaySettings) -> CallQueue:
    module, _, name = QUEUES[queue_backend(settings)].partition(":")
    factory: Callable[[GatewaySettings], CallQueue] = getattr(importlib.import_module(module), name)
    return factory(settings)


def gateway_app(settings: GatewaySettings) -> FastAPI:
    """The gateway over the queue the settings select (with Redis and `local_worker`, a worker in
    this process too)."""
    from codeenv.api import create_app

    worker = None
    if queue_backend(settings) == "redis" and settings.local_worker:
        from codeenv.worker.redis import StreamWorker

        worker = StreamWorker(settings)
    return create_app(settings, build_queue(settings), worker=worker, freeze=True)


def app_from_env() -> FastAPI:
    """The gateway configured by CODEENV_* variables: what each `serve --processes N` process runs."""
    from codeenv import logs

    logs.setup(logs.from_env())  # a spawned process: its parent's logging is not inherited
    return gateway_app(GatewaySettings())


def prepare_jails(settings: SandboxSettings, progress: Progress | None = None) -> None:
    """Build (or find) the image, check that this host can hold the slots and start one jail,
    before binding anything: raises CodeenvError (or OSError) saying what is missing."""
    from codeenv.sandbox.image import ensure_image
    from codeenv.sandbox.jail import nsjail_binary
    from codeenv.sandbox.probe import probe_jail
    from codeenv.sandbox.sizing import preflight
    from codeenv.sandbox.uids import (
        check_uids_free,
        check_uids_mapped,
        check_user_namespace,
        claim_for,
        uids_needed,
    )

    image = ensure_image(settings, progress=progress)
    preflight(settings, image.spec)
    check_user_namespace(settings)
    if settings.uid_base is not None:
        check_uids_mapped(settings.uid_base, uids_needed(settings))
        check_uids_free(settings.uid_base, settings.slots)
        probe_jail(settings, image, nsjail_binary(settings), settings.uid_base)
        return
    block = claim_for(settings)  # the pool claims its own later
    try:
        probe_jail(settings, image, nsjail_binary(settings), block.base)
    finally:
        block.release()


def on_stop_signals(drain: Callable[[], None], force: Callable[[], None]) -> None:
    """In the running event loop: the first SIGTERM or SIGINT calls `drain`, any later one `force`."""
    signals = 0

    def received() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            logger.info("stopping (a second signal forces)")
            drain()
        else:
            logger.warning("second signal: stopping now")
            force()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, received)


# --- the roles -----------------------------------------------------------------------------------


def run_gateway(settings: GatewaySettings, given: Mapping[str, object], log_level: str, log_format: str) -> None:
    """``codeenv serve``. uvicorn stops in two stages itself: it stops accepting, waits for requests
    in flight (up to the grace period), then the app's lifespan closes the queue; a second signal
    forces."""
    import uvicorn

    if settings.processes == 1:
        # log_config=None: uvicorn's loggers keep the one handler and format of codeenv.logs.
        uvicorn.run(gateway_app(settings), host=settings.host, port=settings.port, log_level=log_level,
                    log_config=None, timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
                    limit_concurrency=settings.max_connections)
        return
    _serve_processes(settings, given, log_level, log_format)


#: A pool process that dies this many times within RESTART_WINDOW_S is given up on: `serve` exits.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: Lines of a pool process's stderr kept to say why it died.
STDERR_TAIL = 20


class PoolSupervisor:
    """Runs the pool process of ``serve --processes N`` and restarts it, with backoff, when it dies
    (the gateways reconnect by themselves). After MAX_RESTARTS deaths within RESTART_WINDOW_S it
    gives up: `failure` says why, and `on_give_up` is called (serve then stops, and exits non-zero)."""

    def __init__(self, cmd: list[str], on_give_up: Callable[[], None], env: Mapping[str, str] | None = None) -> None:
        self.cmd = cmd
        self.env = env
        self.on_give_up = on_give_up
        self.failure: str | None = None
        self.restarts = 0
        self.proc: subprocess.Popen[str] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="codeenv-pool-supervisor", daemon=True)

    def start(self) -> None:
        self._spawn()
        self._watcher.start()

    def _spawn(self) -> None:
        proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, text=True, errors="replace", env=self.env)
        self.proc = proc
        threading.Thread(target=self._forward, args=(proc,), name="codeenv-pool-stderr", daemon=True).start()

    def _forward(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:  # the pool process logs to stderr: pass it on, keep the end
            sys.stderr.write(line)
            if line.strip():
                self._tail.append(line.strip())

    def _watch(self) -> None:
        deaths: collections.deque[float] = collections.deque()
        while True:
            proc = self.proc
            assert proc is not None
            status = proc.wait()
            if self._stopping.is_set():
                return
            now = time.monotonic()
            deaths.append(now)
            while deaths and deaths[0] < now - RESTART_WINDOW_S:
                deaths.popleft()
            time.sleep(0.05)  # let the stderr forwarder catch up with the last words
            last = self._tail[-1] if self._tail else "no output"
            cause = f"the pool process exited with status {status} ({last[:300]})"
            if len(deaths) >= MAX_RESTARTS:
                self.failure = f"{cause}; it died {len(deaths)} times within {RESTART_WINDOW_S:g} s: giving up"
                logger.error("%s", self.failure, extra={"event": "pool_given_up"})
                self.on_give_up()
                return
            backoff = min(8.0, 0.5 * 2 ** (len(deaths) - 1))
            logger.error("%s; restarting it in %.1f s", cause, backoff, extra={"event": "pool_died"})
            if self._stopping.wait(backoff):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self.restarts += 1
                self._spawn()

    def stop(self, grace_s: float) -> None:
        with self._lock:
            self._stopping.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve_processes(settings: GatewaySettings, given: Mapping[str, object], log_level: str, log_format: str) -> None:
    """N uvicorn processes in front of one supervised pool process: `codeenv worker` with Redis,
    else a pool serving the gateways on a Unix socket. Settings reach the processes as CODEENV_*
    variables. Raises CodeenvError if the pool process had to be given up on."""
    import uvicorn

    for key, value in given.items():
        os.environ[f"CODEENV_{key.upper()}"] = str(value)
    pool_cmd: list[str] | None = None
    if settings.redis_url is not None:
        os.environ["CODEENV_LOCAL_WORKER"] = "false"  # the gateways; the worker runs once, below
        if settings.local_worker:
            pool_cmd = ["worker"]  # the Redis URL (and its password) from CODEENV_REDIS_URL, never argv
    else:
        socket_path = settings.state_dir / "sockets" / f"pool-{settings.port}.sock"
        os.environ["CODEENV_POOL_SOCKET"] = str(socket_path)
        pool_cmd = ["pool", "--socket", str(socket_path)]
    metrics_dir = tempfile.mkdtemp(prefix="codeenv-metrics-")
    supervisor = None
    try:
        if pool_cmd is not None:
            # On giving up, stop the gateways as a first SIGTERM would: serve then exits non-zero.
            # The pool process gets what it needs and no more: not the gateways' token.
            env = {k: v for k, v in os.environ.items() if k != "CODEENV_TOKEN"}
            supervisor = PoolSupervisor([sys.executable, "-m", "codeenv.cli", *pool_cmd, "--log-format", log_format],
                                        on_give_up=lambda: os.kill(os.getpid(), signal.SIGTERM), env=env)
            supervisor.start()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # for the gateways, set before they import it
        uvicorn.run("codeenv.topology:app_from_env", factory=True, workers=settings.processes, host=settings.host,
                    port=settings.port, log_level=log_level,
                    log_config=None, timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
                    limit_concurrency=settings.max_connections)
    finally:
        if supervisor is not None:
            supervisor.stop(settings.shutdown_grace_s + 30)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if supervisor is not None and supervisor.failure is not None:
        raise PoolFailed(supervisor.failure)


def run_pool(settings: GatewaySettings, socket_path: Path) -> None:
    """The host's slot pool behind `serve --processes N` (without Redis), until a stop signal."""
    from codeenv.queue import embedded
    from codeenv.queue.host_socket import HostSocketServer

    async def go() -> None:
        queue = embedded.from_settings(settings)
        server = HostSocketServer(queue, socket_path)
        await server.start()
        freeze_startup()
        stopping = asyncio.Event()

        def drain() -> None:  # its calls are answered to the gateways before their connections close
            queue.drain(answers_by(settings.shutdown_grace_s))
            stopping.set()

        on_stop_signals(drain, queue.force)  # a second signal stops the running calls at once
        await stopping.wait()
        await queue.drained()
        await server.close()

    asyncio.run(go())


def run_worker(settings: QueueSettings) -> None:
    """``codeenv worker``: a Redis worker until a stop signal (the first stops claiming, hands
    unstarted calls back and lets running ones finish within the grace period; the second kills)."""
    from codeenv.worker.redis import StreamWorker

    async def go() -> None:
        worker = StreamWorker(settings)
        await worker.start()
        freeze_startup()
        stopping: list[asyncio.Task[None]] = []
        on_stop_signals(lambda: stopping.append(asyncio.create_task(worker.stop())), worker.force)
        await worker.stopped()

    asyncio.run(go())
