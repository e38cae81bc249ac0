"""MCP (the Model Context Protocol): codeenv as the code tool of any agent framework, built on the
protocol's own SDK (the `mcp` package, 1.x: what the RL stacks' clients run).

Served by the gateway on its port, behind its token and its Guard (which leaves these bodies to the
SDK, unread):

- **Streamable HTTP** at ``/mcp``, stateless: each request stands alone, so any gateway process
  answers any of them (``serve --processes N``, Redis mode). The gateway gives each MCP session its
  id (``Mcp-Session-Id`` on the first response, which clients send back); ``DELETE /mcp`` with it
  (what a client sends when it closes) deletes that MCP session's python session. ``GET /mcp`` (a
  stream for the server's own requests, which this server never makes) is 405.
- **SSE** at ``/mcp/sse``, its posts at ``/mcp/messages/``: for the clients that still speak it
  (ROLL's ``MCPTool``, verl-tool). A stream and its posts must reach one gateway process, so under
  ``serve --processes N`` SSE clients need one process (or sticky routing); streamable HTTP does not.
- **stdio**: ``codeenv mcp --url URL`` (`run_stdio`), forwarding to a running service.

Tools:

- ``python(code, stdin?)``: a fresh program per call, the native call's default limits, the
  feedback ``format_feedback`` gives (``isError`` when the program failed or the service did).
- ``python_session(code)``: the next cell of this MCP session's live session (made on first use):
  variables and imports last, a last expression's value is shown, a cell stopped by a limit is
  rolled back. Ended when the MCP session ends (DELETE, the SSE stream closing, stdio's exit);
  the idle TTL is the backstop.
- ``stateful_python_code_exec(code, session_id?, timeout?)``: NeMo-Skills' MCP python tool with the
  name, schema and answer their server defines: an IPython session named by ``session_id`` (made,
  and its id returned, when it is null), as their sandbox's ``/execute`` (this gateway's NeMo route).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import httpx
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.sse import SseServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from pydantic import ValidationError
from starlette.routing import BaseRoute, Mount, Route

from codeenv.client import AsyncClient, format_feedback
from codeenv.client.errors import ClientError, SessionLost
from codeenv.errors import InvalidRequest, SandboxError, SessionError, SessionErrorKind
from codeenv.models import ExecRequest, ExecResult, Refusal, Status

#: Where the streamable HTTP endpoint, the SSE stream and the SSE posts are.
MCP_PATH, SSE_PATH, MESSAGES_PATH = "/mcp", "/mcp/sse", "/mcp/messages/"
#: The MCP session (its key) that a tool call belongs to where no header names it: an SSE stream's,
#: a stdio process's.
CONNECTION: contextvars.ContextVar[str] = contextvars.ContextVar("codeenv_mcp_connection")
#: What a client may send back as Mcp-Session-Id: what the gateway issues (32 hex digits) or another
#: server's long random id; a short or odd one is no session (whoever holds the id owns the session).
SESSION_ID = re.compile(r"[A-Za-z0-9_.:-]{32,128}")
#: A python_session's live session is named after its MCP session, apart from other callers' names.
PREFIX = "mcp:"
#: The text of a tool's answer, at most (head and tail kept).
MAX_CHARS = 16_000

CODE = {"type": "string", "description": "the Python code"}
PYTHON = types.Tool(
    name="python",
    description="Run a Python program in a fresh sandbox and see its output: print what you want to see. "
                "Nothing carries over between calls: define everything the program needs.",
    inputSchema={"type": "object", "properties": {"code": CODE, "stdin": {
        "type": "string", "description": "the program's standard input"}}, "required": ["code"]})
PYTHON_SESSION = types.Tool(
    name="python_session",
    description="Run Python code in this conversation's persistent session and see its output and the "
                "value of its last expression. Variables, functions and imports of earlier calls remain. A "
                "call stopped by a limit (time, memory, output) is undone: the session is as before it.",
    inputSchema={"type": "object", "properties": {"code": CODE}, "required": ["code"]})
#: NeMo-Skills' tool, as their server (FastMCP, from its signature) declares it.
NEMO = types.Tool(
    name="stateful_python_code_exec",
    description="Call this function to execute Python code in a stateful Jupyter notebook environment. Python "
                "will respond with the output of the execution or time out after 120.0 seconds.",
    inputSchema={
        "type": "object", "title": "stateful_python_code_execArguments", "required": ["code"],
        "properties": {
            "code": {"type": "string", "description": "Code to execute", "title": "Code"},
            "session_id": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None,
                           "description": "Session id for session persistence", "title": "Session Id"},
            "timeout": {"type": "number", "default": 10, "description": "Time in seconds to allow the job to run",
                        "title": "Timeout"}}},
    outputSchema={
        "type": "object", "title": "ExecutionResult", "required": ["output_dict", "session_id"],
        "properties": {"output_dict": {"type": "object", "additionalProperties": {"type": "string"},
                                       "title": "Output Dict"},
                       "session_id": {"anyOf": [{}, {"type": "null"}], "title": "Session Id"}}})
TOOLS = [PYTHON, PYTHON_SESSION, NEMO]


class Backend(Protocol):
    """How the tools reach codeenv: this gateway's own queue, or a service over HTTP (stdio)."""

    async def run(self, code: str, stdin: str, request: Any) -> ExecResult: ...

    async def cell(self, key: str, code: str, request: Any) -> tuple[ExecResult, bool]:
        """The next cell of MCP session `key`'s live session; True: it ran in a new one, the old
        one having ended."""
        ...

    async def end(self, key: str) -> None: ...

    async def nemo(self, session_id: str, code: str, timeout: float, request: Any) -> dict[str, str]: ...


def build_server(backend: Backend, key_of: Callable[[Any], str | None]) -> Server[Any, Any]:
    """The MCP server of the three tools over `backend`; `key_of(request)`: the MCP session a call
    belongs to (None: the client has none)."""
    server: Server[Any, Any] = Server("codeenv", instructions=(
        "python runs a fresh program per call; python_session keeps state through this MCP session; "
        "stateful_python_code_exec is NeMo-Skills' tool (a session per session_id)."))

    @server.list_tools()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_tools() -> list[types.Tool]:
        return TOOLS

    @server.call_tool()  # type: ignore[untyped-decorator]
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult | dict[str, Any]:
        request = server.request_context.request
        code = arguments.get("code")
        if not isinstance(code, str):
            return _text("the tool needs a `code` string", error=True)
        if name == PYTHON.name:
            stdin = arguments.get("stdin") or ""
            if not isinstance(stdin, str):
                return _text("`stdin` is a string", error=True)
            return _answer(await backend.run(code, stdin, request))
        if name == PYTHON_SESSION.name:
            key = CONNECTION.get(None) or key_of(request)
            if key is None:
                return _text("python_session keeps state through an MCP session, and this client has none (no "
                             "Mcp-Session-Id: a sessionless protocol version?): use python, or "
                             "stateful_python_code_exec with a session_id", error=True)
            result, renewed = await backend.cell(key, code, request)
            return _answer(result, session=True, renewed=renewed)
        if name == NEMO.name:
            session_id, timeout = arguments.get("session_id"), arguments.get("timeout", 10)
            if session_id is not None and not isinstance(session_id, str):
                return _text("`session_id` is a string or null", error=True)
            if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < float("inf"):
                return _text("`timeout` is a positive number of seconds", error=True)
            session_id = session_id or str(uuid.uuid4())
            output = await backend.nemo(session_id, code, float(timeout), request)
            return {"output_dict": output, "session_id": session_id}
        return _text(f"no tool {name!r}: the tools are {', '.join(t.name for t in TOOLS)}", error=True)

    return server


def _text(text: str, *, error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=error)


def _answer(result: ExecResult, *, session: bool = False, renewed: bool = False) -> types.CallToolResult:
    """What the model reads of a result: `format_feedback`'s text (a session's cell: with its last
    expression's value, and what became of the session)."""
    text = format_feedback(result, max_chars=MAX_CHARS)
    if session and result.value is not None and result.status is Status.ok:
        text = (text + "\n" if text != "(no output)" else "") + result.value
    if result.rolled_back:
        text += "\n(This call was undone: the session is as it was before it.)"
    if renewed:
        text = "(The earlier session had ended and its state is gone: this ran in a new one.)\n" + text
    if result.status is Status.session_lost:
        text += "\n(The session has ended and its state is gone: the next call starts a new one.)"
    return _text(text, error=result.status is not Status.ok)


def _owner(key: str) -> bytes:
    """Who a python_session's live session belongs to: whoever holds its MCP session's id."""
    return hashlib.sha256(b"codeenv-mcp/" + key.encode()).digest()


def _name(key: str) -> str:
    """The live session that stands for MCP session `key` (a name of this route's, of fixed size)."""
    return PREFIX + hashlib.sha256(key.encode()).hexdigest()[:40]


_background: set[asyncio.Task[Any]] = set()  # what outlives a cancelled tool call (ending, cleaning up)


def _keep(task: asyncio.Task[Any]) -> asyncio.Task[Any]:
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


def _header_key(request: Any) -> str | None:
    """The MCP session a streamable HTTP request names (its Mcp-Session-Id), if a valid one."""
    headers = getattr(request, "headers", None)
    value = headers.get("mcp-session-id") if headers is not None else None
    return value if value is not None and SESSION_ID.fullmatch(value) else None


# --- in the gateway ------------------------------------------------------------------------------


class GatewayBackend:
    """The tools on this gateway's own queue and sessions (what its routes do, without HTTP)."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway
        self._starting: dict[str, asyncio.Future[None]] = {}  # this process's sessions being made, by key

    async def _calls(self, calls: list[ExecRequest], request: Any) -> list[ExecResult]:
        """`calls` answered; a tool call cancelled meanwhile (its client gone, its stream closed)
        cancels those not started, as a client hanging up does on the native routes."""
        base_url = str(getattr(request, "base_url", "") or self.gateway.settings.public_url or "http://127.0.0.1/")
        gone = asyncio.Event()
        running = _keep(asyncio.ensure_future(self.gateway.run_calls(calls, lambda: base_url, gone, time.monotonic(),
                                                                     "mcp")))
        try:
            results: list[ExecResult] = await asyncio.shield(running)
        except asyncio.CancelledError:
            gone.set()
            raise
        return results

    async def run(self, code: str, stdin: str, request: Any) -> ExecResult:
        [result] = await self._calls([ExecRequest(code=code, stdin=stdin)], request)
        return result

    async def cell(self, key: str, code: str, request: Any) -> tuple[ExecResult, bool]:
        service = self.gateway.sessions
        if service is None:
            return ExecResult(status=Status.rejected, refusal=Refusal.invalid, started=False,
                              message="this service runs no sessions"), False
        who, name = _owner(key), _name(key)
        call = ExecRequest(code=code, session=name, display_last=True)
        call._owner = who
        renewed = False
        for attempt in range(4):
            [result] = await self._calls([call], request)
            if result.status is not Status.session_lost and result.refusal is not Refusal.no_session:
                return result, renewed
            renewed = renewed or result.status is Status.session_lost
            failed = await self._start(key, who, name, attempt)
            if failed is not None:
                return failed, renewed
        return result, renewed

    async def _start(self, key: str, who: bytes, name: str, attempt: int) -> ExecResult | None:
        """Make MCP session `key`'s live session (once in this process however many calls ask at
        once); a failure's result, or None. A session another process makes meanwhile (conflict)
        is waited for a moment, then used."""
        starting = self._starting.get(key)
        if starting is not None:
            await asyncio.shield(starting)
            return None
        starting = self._starting[key] = asyncio.get_running_loop().create_future()
        settings = self.gateway.settings
        try:
            await self.gateway.sessions.create(settings.session_profile, None, settings.session_idle_ttl_s, who, name)
        except SessionError as exc:
            if exc.kind is not SessionErrorKind.conflict:
                return _failed(f"a session could not start: {exc}")
            await asyncio.sleep(0.1 * (attempt + 1))  # made meanwhile elsewhere: it is ready soon
        except (InvalidRequest, SandboxError) as exc:
            return _failed(f"a session could not start: {exc}")
        finally:
            del self._starting[key]
            starting.set_result(None)
        return None

    async def end(self, key: str) -> None:
        if self.gateway.sessions is not None:
            with contextlib.suppress(SessionError):  # none was made, or it ended already
                await self.gateway.sessions.delete(_name(key), _owner(key))

    async def nemo(self, session_id: str, code: str, timeout: float, request: Any) -> dict[str, str]:
        from codeenv.api import nemo

        try:
            body = nemo.NemoExecute(generated_code=code, timeout=timeout, language="ipython")
        except ValidationError as exc:
            return {"process_status": "error", "stdout": "", "stderr": f"codeenv: {exc.errors()[0]['msg']}\n"}
        who = nemo.nemo_owner(request) if request is not None else _owner("stdio")
        answer = await nemo.ipython(self.gateway, lambda calls: self._calls(calls, request), who, body, session_id)
        return {key: str(answer[key]) for key in ("process_status", "stdout", "stderr")}


def _failed(why: str) -> ExecResult:
    return ExecResult(status=Status.internal_error, started=False, message=why)


class McpEndpoints:
    """The gateway's MCP routes (ASGI apps) and what they share: one server, the streamable HTTP
    manager (entered by the gateway's lifespan: `running()`), the SSE transport."""

    def __init__(self, gateway: Any) -> None:
        self.backend = GatewayBackend(gateway)
        self.server = build_server(self.backend, _header_key)
        # Stateless, JSON answers: no MCP state in this process, any process answers any request.
        self.manager = StreamableHTTPSessionManager(app=self.server, stateless=True, json_response=True)
        self.sse = SseServerTransport(MESSAGES_PATH)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self.manager.run():
            yield

    async def streamable(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """/mcp: POST to the SDK (the first request of an MCP session gets its id), DELETE ends one."""
        method = scope["method"]
        given = dict(scope["headers"]).get(b"mcp-session-id")
        key = given.decode("latin-1") if given is not None else None
        if method == "DELETE":
            if key is None or not SESSION_ID.fullmatch(key):
                await _json(send, 400, {"detail": "DELETE /mcp ends an MCP session: send its Mcp-Session-Id"})
                return
            await self.backend.end(key)
            await _json(send, 200, {})
            return
        if method != "POST":
            await _json(send, 405, {"detail": "this MCP endpoint takes POST (and DELETE to end a session); it "
                                              "sends no requests of its own, so it opens no GET stream"},
                        [(b"allow", b"POST, DELETE")])
            return
        if key is None:  # an MCP session begins: its id comes back with the answer
            issued = secrets.token_hex(16).encode()
            inner_send = send

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (b"mcp-session-id", issued)]}
                await inner_send(message)

        await self.manager.handle_request(scope, receive, send)

    async def sse_stream(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """/mcp/sse: one MCP session for as long as the stream lasts."""
        if scope["method"] != "GET":
            await _json(send, 405, {"detail": "the SSE stream is opened with GET"}, [(b"allow", b"GET")])
            return
        key = secrets.token_hex(16)
        token = CONNECTION.set(key)  # its tool calls run in tasks made within this context
        try:
            async with self.sse.connect_sse(scope, receive, send) as (read, write):
                await self.server.run(read, write, self.server.create_initialization_options())
        finally:
            CONNECTION.reset(token)
            # Not undone by a cancellation (a server shutting down): the delete goes on regardless.
            await asyncio.shield(_keep(asyncio.ensure_future(self.backend.end(key))))

    def routes(self) -> list[BaseRoute]:
        """/mcp, /mcp/sse and /mcp/messages/ (ASGI apps, not request handlers: the SDK answers)."""
        return [Route(MCP_PATH, _Asgi(self.streamable)), Route(SSE_PATH, _Asgi(self.sse_stream)),
                Mount(MESSAGES_PATH.rstrip("/"), app=self.sse.handle_post_message)]


class _Asgi:
    """An ASGI app of a coroutine function (Starlette takes a bare function for a request handler)."""

    def __init__(self, app: Callable[[dict[str, Any], Any, Any], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


async def _json(send: Any, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


# --- stdio, forwarding to a running service -------------------------------------------------------


class RemoteBackend:
    """The tools over a running service's HTTP API (for `codeenv mcp`, a stdio server)."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/")
        self.client = AsyncClient(url, token=token)
        self.headers = {"authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=httpx.Timeout(None, connect=10))
        self.sessions: dict[str, asyncio.Future[Any]] = {}  # by key: its session, made once

    async def run(self, code: str, stdin: str, request: Any) -> ExecResult:
        try:
            return await self.client.run(code, stdin=stdin)
        except ClientError as exc:
            return _failed(f"the service could not be reached: {exc}")

    async def cell(self, key: str, code: str, request: Any) -> tuple[ExecResult, bool]:
        renewed = False
        for _ in range(2):
            starting = self.sessions.get(key)
            if starting is None:
                starting = self.sessions[key] = _keep(asyncio.ensure_future(self.client.session()))
                starting.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, whoever waits
            try:
                session = await asyncio.shield(starting)
                return await session.run(code), renewed
            except SessionLost:
                if self.sessions.get(key) is starting:
                    del self.sessions[key]
                renewed = True
            except ClientError as exc:
                if self.sessions.get(key) is starting and starting.done() and starting.exception() is not None:
                    del self.sessions[key]  # it never started: the next call tries again
                return _failed(f"the service could not be reached: {exc}"), renewed
        return _failed("the session was lost twice in a row"), renewed

    async def end(self, key: str) -> None:
        starting = self.sessions.pop(key, None)
        if starting is not None:
            with contextlib.suppress(Exception):  # it never started, or it is gone already
                await (await asyncio.shield(starting)).close()

    async def nemo(self, session_id: str, code: str, timeout: float, request: Any) -> dict[str, str]:
        try:
            response = await self.http.post("/execute", headers={"x-session-id": session_id}, json={
                "generated_code": code, "timeout": timeout, "language": "ipython"})
            answer = response.json()
            return {key: str(answer[key]) for key in ("process_status", "stdout", "stderr")}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            return {"process_status": "fail", "stdout": "", "stderr": f"Error connecting to sandbox: {exc!r}\n"}

    async def close(self) -> None:
        for key in list(self.sessions):
            await self.end(key)
        await self.client.aclose()
        await self.http.aclose()


async def run_stdio(url: str, token: str | None) -> None:
    """An MCP server on this process's stdin and stdout whose tools run on the service at `url`;
    its python_session is this process's, deleted when it exits."""
    from mcp.server.stdio import stdio_server

    backend = RemoteBackend(url, token)
    server = build_server(backend, lambda request: None)
    CONNECTION.set(secrets.token_hex(16))
    try:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
    finally:
        await backend.close()

