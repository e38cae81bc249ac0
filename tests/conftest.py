"""Fixtures: a real slot pool (real nsjail, real cgroups) shared by the whole session, a private
redis-server, and the markers that sort tests into tiers (see the README): `unit` needs no root, no
nsjail and no Redis; `jail` needs root and the host's sandbox; `redis` starts redis-server."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import uvicorn

from codeenv import ExecRequest, ExecResult, SandboxSettings, SlotPool
from codeenv.api import create_app
from codeenv.bench.services import Service, ServiceError, free_port, start_codeenv, start_redis
from codeenv.queue.embedded import EmbeddedQueue
from codeenv.queue.redis import RedisQueue
from codeenv.sandbox.outside.calls import CallJail
from codeenv.settings import GatewaySettings
from codeenv.worker import StreamWorker

SLOTS = 2
#: The trainer side's tests run on other interpreters, without the service's packages (scripts/test-client).
collect_ignore = ["client"]
#: What each tier's tests may use: a `unit` test none of these fixtures, a `jail` test the pool.
TIERS = {"jail": {"pool"}, "redis": {"redis_server"}}


def jail_env(**extra: str) -> dict[str, str]:
    """The whole environment of a `codeenv` process a test starts: a plain PATH (its pool claims its own uids)."""
    return {"PATH": "/usr/bin:/bin", **extra}


def start_service(*args: str, log: Path | None = None, **env: str) -> Service:
    """`codeenv ARGS --port P` on a free port, in `jail_env`."""
    return start_codeenv(*args, port=free_port(), env=jail_env(**env), log=log)


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.fail(f"{what} needs root (codeenv's jail tests run real nsjail jails with cgroups): run it as "
                    "root, or run the tests that need none: scripts/test -m unit", pytrace=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test is `unit`, or `jail` and/or `redis` (matching the fixtures it uses), never both."""
    wrong = []
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        tiers = marks & {"unit", *TIERS}
        fixtures = set(getattr(item, "fixturenames", ()))
        if not tiers or ("unit" in tiers and len(tiers) > 1):
            wrong.append(f"{item.nodeid}: marked {sorted(tiers) or 'with no tier'}")
        for tier, needs in TIERS.items():
            if fixtures & needs and tier not in marks:
                wrong.append(f"{item.nodeid}: uses {', '.join(sorted(fixtures & needs))} but is not marked {tier}")
    if wrong:
        raise pytest.UsageError("tests with the wrong tier markers:\n  " + "\n  ".join(wrong))


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture: a clear message rather than a jail that fails to start.
    if item.get_closest_marker("jail") is not None:
        need_root(item.nodeid)


class Runner:
    """Runs calls on a shared pool, optionally pinned to one slot."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool

    async def __call__(self, code: str, *, stdin: str = "", slot: int | None = None,
                       profile: str | None = None, **limits: Any) -> ExecResult:
        request = ExecRequest(code=code, stdin=stdin, limits=limits, profile=profile)
        return await self.pool.run(request, slot_index=slot)

    async def healthy_after(self, slot: int, profile: str | None = None) -> ExecResult:
        """The next call on `slot` succeeds."""
        result = await self("print('still fine')", slot=slot, profile=profile)
        assert result.status == "ok", result
        assert result.stdout == "still fine\n"
        return result


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """Until `condition()` holds (a state seen from outside that offers no event to wait on),
    polled every 10 ms; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # noqa: ASYNC110 (what it polls offers no event)
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g}s")
        await asyncio.sleep(0.01)


#: A call that announces it is running by creating a file, then sleeps.
RUNNING_THEN_SLEEP = "open('running', 'w').close()\nimport time\ntime.sleep(60)"


async def wait_until_running(zygote: CallJail) -> None:
    """Until the call started with RUNNING_THEN_SLEEP has created its file (seen from outside)."""
    for _ in range(4000):
        if zygote._workdir_usage() != zygote.baseline_workdir:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the call never started")


@pytest_asyncio.fixture(scope="session")
async def pool() -> AsyncIterator[SlotPool]:
    need_root("the session's slot pool")
    async with SlotPool(SandboxSettings(slots=SLOTS)) as p:
        yield p


@pytest.fixture(scope="session")
def cpp_toolchain() -> None:
    """The C++ toolchain, built on this host if it is not yet (the pool finds it when a call needs it)."""
    need_root("the toolchain's build and its compile jail")
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get: the C++ toolchain is built from Debian's packages")
    from codeenv.sandbox.toolchain import ensure_toolchain

    ensure_toolchain(SandboxSettings().cpp_toolchain, SandboxSettings().images_dir)


@pytest.fixture
def run(pool: SlotPool) -> Runner:
    return Runner(pool)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Service]:
    """A private redis-server on a free port (never the machine's own), stopped by PID."""
    try:
        server = start_redis()
    except ServiceError as exc:
        raise pytest.UsageError(f"the Redis tests need redis-server (scripts/test installs it): {exc}") from exc
    yield server
    server.kill()


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """A real uvicorn server for `app` in this event loop (so it can share the session's pool)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn offers no event to wait on)
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        await task


@pytest_asyncio.fixture(loop_scope="session")
async def served_service(tmp_path: Path) -> AsyncIterator[Service]:
    """A `codeenv serve` of 2 slots in a process of its own (its PATH: this one's), stopped after the test."""
    served = start_service("serve", "--slots", "2", "--log-level", "warning", log=tmp_path / "serve.log",
                           PATH=os.environ.get("PATH", "/usr/bin"))
    try:
        await served.await_ready(120)
        yield served
    finally:
        await served.stop_async(60)


class SharedPoolQueue(EmbeddedQueue):
    """The session's pool, which the app must neither start nor close."""

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def pool_app(pool: SlotPool, config: GatewaySettings | None = None, **settings: Any) -> Any:
    """The gateway over the session's pool, with `config` or GatewaySettings(slots=2, **settings)
    (for a fixture of a wider scope than `gateway` and `served`)."""
    config = config or GatewaySettings(slots=SLOTS, **settings)
    return create_app(config, SharedPoolQueue(pool, config.max_queued))


def _app_of(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """How `gateway` and `served` make their app: over `queue` if given, else over the session's
    pool, for a `jail` test only (a `unit` test passes `queue=FakeQueue()`; it must not start a pool
    unseen: the tier hook sees only the fixtures a test names)."""
    pool = request.getfixturevalue("pool") if request.node.get_closest_marker("jail") is not None else None

    def make(queue: Any, settings: dict[str, Any]) -> Any:
        if queue is not None:
            return create_app(GatewaySettings(slots=SLOTS, **settings), queue)
        if pool is None:
            pytest.fail(f"{request.node.nodeid}: a gateway over the pool is for `jail` tests; a `unit` test "
                        "passes queue=tests.fakes.FakeQueue()", pytrace=False)
        return pool_app(pool, **settings)

    return make


#: `gateway(queue=None, base_url=..., headers=..., **settings)`, see the fixture.
GatewayClient = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]
#: `served(queue=None, **settings)`, see the fixture.
Served = Callable[..., AbstractAsyncContextManager[str]]


@pytest.fixture
def gateway(request: pytest.FixtureRequest) -> GatewayClient:
    """`async with gateway(**settings) as client`: an httpx client of the gateway in this process
    (ASGI) with GatewaySettings(slots=2, **settings), over `queue=` if given, else the session's pool."""
    app_of = _app_of(request)

    @asynccontextmanager
    async def make(queue: Any = None, base_url: str = "http://localhost", headers: dict[str, str] | None = None,
                   **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
        app = app_of(queue, settings)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url,
                                         headers=headers) as client:
                yield client
        finally:  # ASGITransport runs no lifespan: the body parser's helper processes end here
            await app.state.parser.close()

    return make


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Served:
    """`async with served(**settings) as url`: the gateway as `gateway` makes it, in a real uvicorn."""
    app_of = _app_of(request)

    @asynccontextmanager
    async def make(queue: Any = None, **settings: Any) -> AsyncIterator[str]:
        async with serving(app_of(queue, settings)) as url:
            yield url

    return make


@pytest_asyncio.fixture(params=["embedded", pytest.param("redis", marks=pytest.mark.redis)])
async def client(request: pytest.FixtureRequest, pool: SlotPool,
                 gateway: GatewayClient) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway in both queue modes: embedded, and Redis Streams with a worker on the same pool."""
    settings = GatewaySettings(slots=SLOTS, max_body_bytes=1 << 20, max_batch=64)
    if request.param == "embedded":
        async with gateway(max_body_bytes=1 << 20, max_batch=64) as c:
            yield c
        return
    redis_server: Service = request.getfixturevalue("redis_server")
    settings = settings.model_copy(update={"redis_url": redis_server.url, "redis_prefix": uuid.uuid4().hex})
    worker = StreamWorker(settings, pool=pool)
    queue = RedisQueue(settings)
    await worker.start()
    await queue.start()
    try:
        app = create_app(settings, queue)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            yield c
    finally:
        await queue.close()
        await worker.stop()
