"""What every framework's code tool shares: its settings, one micro-batching client per event loop
(so the tool calls of every trajectory in a rollout worker become few HTTP requests), the feedback
text, a ToolLedger per trajectory, and service faults turned into feedback, never into a crash.

Usage::

    tool = CodeTool(ToolSettings.from_mapping({"url": "http://127.0.0.1:8000", "limits": {"wall_s": 5}}))
    outcome = await tool.run(code, trajectory="request-id")
    outcome.text, outcome.metrics        # what the model sees; what the framework logs
    tool.ledger("request-id")            # the trajectory's tool calls, for GRPO-RoC
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from codeenv.client import AsyncClient, AsyncSession, format_feedback
from codeenv.client._async import check_base_url
from codeenv.client.errors import ClientError, SessionLost
from codeenv.models import SERVICE_FAULTS, ExecResult, Status
from codeenv.rl import ToolLedger

#: Trajectories whose ledgers are kept (the oldest go first); a trainer takes each with pop_ledger.
MAX_LEDGERS = 100_000


@dataclass(frozen=True)
class ToolSettings:
    """How a code tool reaches codeenv and what the model sees. Unset: `CODEENV_URL`, `CODEENV_TOKEN`."""

    url: str = field(default_factory=lambda: os.environ.get("CODEENV_URL", "http://127.0.0.1:8000"))
    token: str | None = field(default_factory=lambda: os.environ.get("CODEENV_TOKEN"))
    limits: Mapping[str, Any] = field(default_factory=dict)  # per call, as /v1/execute's `limits`
    style: Literal["default", "rstar2"] = "default"  # format_feedback's style
    max_output_chars: int = 4096  # the feedback text's length (head and tail kept)
    client: Mapping[str, Any] = field(default_factory=dict)  # AsyncClient's options (max_in_flight, ...)
    stateful: bool = False  # each trajectory's calls run in a live session of its own (end() deletes it)
    snapshot: str | None = None  # stateful: each trajectory's session starts as a fork of this snapshot
    profile: str | None = None  # stateful: the sessions' profile (the service's default unless set)

    @classmethod
    def from_env(cls) -> ToolSettings:
        """From `CODEENV_URL`, `CODEENV_TOKEN`, `CODEENV_TOOL_LIMITS` (JSON), `CODEENV_TOOL_STYLE` and
        `CODEENV_TOOL_MAX_OUTPUT_CHARS` (for tools that get no config, e.g. verl's function tools)."""
        config: dict[str, Any] = {}
        if limits := os.environ.get("CODEENV_TOOL_LIMITS"):
            config["limits"] = json.loads(limits)
        if style := os.environ.get("CODEENV_TOOL_STYLE"):
            config["style"] = style
        if chars := os.environ.get("CODEENV_TOOL_MAX_OUTPUT_CHARS"):
            config["max_output_chars"] = int(chars)
        return cls.from_mapping(config)

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any] | None) -> ToolSettings:
        """From a framework's tool config; keys of the framework's own (e.g. verl's `type`) are left alone."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in (config or {}).items() if k in known}
        settings = cls(**values)
        if settings.style not in ("default", "rstar2"):
            raise ValueError(f"style must be 'default' or 'rstar2', not {settings.style!r}")
        if settings.max_output_chars < 16:
            raise ValueError("max_output_chars must be at least 16")
        check_base_url(settings.url)  # at the tool's creation, not at the rollout's first call
        if settings.snapshot is not None and not settings.stateful:
            raise ValueError("snapshot is for a stateful tool (stateful: true)")
        return settings


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call: the text for the model, the figures for the framework's logs, the result."""

    text: str
    metrics: dict[str, Any]
    result: ExecResult | None  # None when the service gave no result at all


#: Per event loop (weakly: a closed loop's clients go with it), one client per settings.
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str | None, str], AsyncClient]] = (
    weakref.WeakKeyDictionary())


def _client(settings: ToolSettings) -> AsyncClient:
    """The client of this event loop for these settings (created on first use)."""
    clients = _clients.setdefault(asyncio.get_running_loop(), {})
    key = (settings.url, settings.token, repr(sorted(settings.client.items())))
    client = clients.get(key)
    if client is None:
        client = clients[key] = AsyncClient(settings.url, token=settings.token, **dict(settings.client))
    return client


async def close_clients() -> None:
    """Close this event loop's clients (e.g. at a rollout worker's shutdown)."""
    for client in _clients.pop(asyncio.get_running_loop(), {}).values():
        await client.aclose()


class CodeTool:
    """A `python` tool for any framework: runs code on codeenv, answers text, keeps ledgers."""

    def __init__(self, settings: ToolSettings | None = None) -> None:
        self.settings = settings or ToolSettings()
        self._ledgers: collections.OrderedDict[str, ToolLedger] = collections.OrderedDict()
        self._sessions: dict[str, asyncio.Future[AsyncSession]] = {}  # stateful: each trajectory's live session

    def ledger(self, trajectory: str) -> ToolLedger:
        """The ledger of a trajectory (created empty on first use)."""
        ledger = self._ledgers.get(trajectory)
        if ledger is None:
            ledger = self._ledgers[trajectory] = ToolLedger()
            while len(self._ledgers) > MAX_LEDGERS:
                self._ledgers.popitem(last=False)
        return ledger

    def pop_ledger(self, trajectory: str) -> ToolLedger:
        """Take a finished trajectory's ledger (an empty one if it made no call)."""
        return self._ledgers.pop(trajectory, None) or ToolLedger()

    async def run(self, code: object, trajectory: str | None = None) -> ToolOutcome:
        """Run `code`; a service fault becomes feedback that says so, flagged in the metrics."""
        ledger = self.ledger(trajectory) if trajectory is not None else None
        if not isinstance(code, str) or not code.strip():
            text = "The python tool needs a non-empty `code` string."
            return ToolOutcome(text, {"status": "rejected", "tool_error": 1, "service_fault": 0, "cpu_s": 0.0}, None)
        try:
            if self.settings.stateful:
                result = await self._cell(code, trajectory, ledger)
            else:
                result = await _client(self.settings).run(code, limits=dict(self.settings.limits), ledger=ledger)
        except SessionLost as exc:  # its state is gone: the next call starts a new session
            if trajectory is not None:
                self._sessions.pop(trajectory, None)
            text = (f"The python session ended and its state is gone ({exc}); the next call starts a new "
                    "one: define again what later code needs.")[: self.settings.max_output_chars]
            return ToolOutcome(text, {"status": "session_lost", "tool_error": 0, "service_fault": 1, "cpu_s": 0.0},
                               exc.result if isinstance(exc.result, ExecResult) else None)
        except ClientError as exc:
            fault = ExecResult(status=Status.internal_error, message=f"{type(exc).__name__}: {exc}")
            if ledger is not None:
                ledger.record(fault)
            text = (f"The python tool failed for a service reason, not because of the code: {exc}. "
                    "The code may not have run.")[: self.settings.max_output_chars]
            return ToolOutcome(text, {"status": "service_error", "tool_error": 0, "service_fault": 1, "cpu_s": 0.0},
                               None)
        service_fault = result.status in SERVICE_FAULTS
        text = format_feedback(result, style=self.settings.style, max_chars=self.settings.max_output_chars)
        if service_fault:
            text = (f"The python tool failed for a service reason, not because of the code "
                    f"({result.status.value}).\n{text}")
        tool_error = result.status is not Status.ok and not service_fault
        metrics = {"status": result.status.value, "tool_error": int(tool_error), "service_fault": int(service_fault),
                   "cpu_s": result.cpu_s}
        return ToolOutcome(text, metrics, result)

    async def _cell(self, code: str, trajectory: str | None, ledger: ToolLedger | None) -> ExecResult:
        """A stateful tool's call: the next cell of the trajectory's session (started on first use;
        calls of one trajectory made at once share the one session the first of them starts)."""
        if trajectory is None:
            raise ValueError("a stateful tool's call belongs to a trajectory")
        starting = self._sessions.get(trajectory)
        if starting is None:
            client = _client(self.settings)
            starter = (client.from_snapshot(self.settings.snapshot) if self.settings.snapshot is not None
                       else client.session(profile=self.settings.profile))
            starting = self._sessions[trajectory] = asyncio.ensure_future(starter)
            starting.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, whoever waits
        try:
            session = await asyncio.shield(starting)
        except BaseException:
            if self._sessions.get(trajectory) is starting and starting.done():
                del self._sessions[trajectory]  # it did not start: the next call tries again
            raise
        return await session.run(code, limits=dict(self.settings.limits), ledger=ledger)

    async def end(self, trajectory: str) -> None:
        """A trajectory is over: its session (a stateful tool's) is deleted; nothing otherwise."""
        starting = self._sessions.pop(trajectory, None)
        if starting is None:
            return
        try:
            session = await asyncio.shield(starting)
        except Exception:  # it never started (its calls were told why)
            return
        with contextlib.suppress(ClientError):  # gone already, or the service unreachable: its TTL ends it
            await session.close()

    def holds_session(self, trajectory: str) -> bool:
        """Whether a trajectory has a live session (a stateful tool's, started and not ended)."""
        return trajectory in self._sessions

    @property
    def live_sessions(self) -> int:
        """A stateful tool's sessions not ended yet."""
        return len(self._sessions)

    def run_sync(self, code: object, trajectory: str | None = None) -> ToolOutcome:
        """run(), for frameworks whose tools are plain functions: every caller in this process shares
        one background event loop, so calls from many threads are micro-batched together."""
        return asyncio.run_coroutine_threadsafe(self.run(code, trajectory), _background_loop()).result()

    def end_sync(self, trajectory: str) -> None:
        """end(), on the background loop that run_sync() uses."""
        asyncio.run_coroutine_threadsafe(self.end(trajectory), _background_loop()).result()


_background: asyncio.AbstractEventLoop | None = None
_background_lock = threading.Lock()


def close_background_clients() -> None:
    """Close the clients of the background loop that run_sync() uses (e.g. at a process's shutdown)."""
    if _background is not None:
        asyncio.run_coroutine_threadsafe(close_clients(), _background).result()


def _background_loop() -> asyncio.AbstractEventLoop:
    global _background
    with _background_lock:
        if _background is None:
            _background = asyncio.new_event_loop()
            threading.Thread(target=_background.run_forever, name="codeenv-tool", daemon=True).start()
        return _background
