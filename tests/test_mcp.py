"""MCP, with the `mcp` package's own client, against a real service: streamable HTTP under two gateway
processes, SSE, and stdio (`codeenv mcp`), behind a token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from mcp import ClientSession, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from codeenv.bench.services import Service
from tests.conftest import start_service
from tests.test_problems import until_ready

pytestmark = [pytest.mark.jail, pytest.mark.slow]

TOKEN = "an-mcp-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# A cell's limit is 2 s here, so a runaway cell is stopped (and rolled back) quickly.
ENV = {"CODEENV_DEFAULTS__WALL_S": "2", "CODEENV_DEFAULTS__CPU_S": "2"}


async def served(tmp_path: Path, *args: str) -> Service:
    service = start_service("serve", "--slots", "2", "--token", TOKEN, "--log-level", "warning", *args,
                            log=tmp_path / "serve.log", PATH=os.environ.get("PATH", "/usr/bin"), **ENV)
    try:
        await until_ready(service.url, TOKEN, 120)
    except BaseException:
        await service.stop_async(10)
        raise
    return service


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def two_processes(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Service]:
    service = await served(tmp_path_factory.mktemp("mcp2"), "--processes", "2")
    try:
        yield service
    finally:
        await service.stop_async(60)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def one_process(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Service]:
    service = await served(tmp_path_factory.mktemp("mcp1"))
    try:
        yield service
    finally:
        await service.stop_async(60)


@contextlib.asynccontextmanager
async def streamable(url: str, headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP client (read, write, its session id) with these headers."""
    async with create_mcp_http_client(headers=headers) as http:
        async with streamable_http_client(url, http_client=http) as streams:
            yield streams


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


async def live_sessions(service: Service) -> float:
    async with httpx.AsyncClient(base_url=service.url, headers=AUTH) as http:
        found = re.search(r"^codeenv_sessions (\S+)$", (await http.get("/metrics")).text, re.MULTILINE)
    assert found is not None
    return float(found.group(1))


async def until_sessions(service: Service, count: float) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while (now := await live_sessions(service)) != count:
        assert asyncio.get_running_loop().time() < deadline, f"{now} live sessions, not {count}"
        await asyncio.sleep(0.1)


async def the_tools_work(session: ClientSession) -> None:
    """What every transport must do: the three tools, state kept in python_session, a timeout undone."""
    await session.initialize()
    tools = {t.name: t for t in (await session.list_tools()).tools}
    assert sorted(tools) == ["python", "python_session", "stateful_python_code_exec"]
    ran = await session.call_tool("python", {"code": "print(6 * 7)"})
    assert text(ran) == "42" and not ran.isError
    failed = await session.call_tool("python", {"code": "1 / 0"})
    assert failed.isError and "ZeroDivisionError" in text(failed)
    assert not (await session.call_tool("python_session", {"code": "x = 41\nimport math"})).isError
    assert text(await session.call_tool("python_session", {"code": "x += 1\nx"})) == "42"
    stopped = await session.call_tool("python_session", {"code": "x = 0\nwhile True: pass"})
    assert stopped.isError and "undone" in text(stopped) and "time limit" in text(stopped)
    assert text(await session.call_tool("python_session", {"code": "math.factorial(3) + x - 6"})) == "42"
    refused = await session.call_tool("python", {"stdin": "no code"})
    assert refused.isError and "code" in text(refused)


async def test_streamable_http_under_two_gateway_processes(two_processes: Service) -> None:
    url = f"{two_processes.url}/mcp"
    before = await live_sessions(two_processes)
    ids = []
    # "Connection: close": each request on a new connection, so both gateway processes answer some.
    headers = {**AUTH, "Connection": "close"}
    async with streamable(url, headers) as (read, write, session_id):
        async with ClientSession(read, write) as session:
            await the_tools_work(session)
            for i in range(8):  # the state is the session's, not a process's
                now = await session.call_tool("python_session", {"code": f"x += {i}\nx"})
                assert text(now) == str(42 + i * (i + 1) // 2)
            await until_sessions(two_processes, before + 1)  # the pool's figures reach gateways twice a second
            ids.append(session_id())
        # Another MCP session sees none of it.
    async with streamable(url, headers) as (read, write, session_id):
        async with ClientSession(read, write) as session:
            await session.initialize()
            other = await session.call_tool("python_session", {"code": "x"})
            assert other.isError and "NameError" in text(other)
            ids.append(session_id())
    assert len(set(ids)) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", i or "") for i in ids)
    await until_sessions(two_processes, before)  # each ended with its MCP session (the client's DELETE)
    # A turn's parallel calls, the session's first: one live session, made once, all of them in it.
    async with streamable(url, headers) as (read, write, session_id):
        async with ClientSession(read, write) as session:
            await session.initialize()
            firsts = await asyncio.gather(*(session.call_tool("python_session", {"code": f"v{i} = {i}"})
                                            for i in range(4)))
            assert not any(r.isError for r in firsts), [text(r) for r in firsts]
            assert text(await session.call_tool("python_session", {"code": "v0 + v1 + v2 + v3"})) == "6"
            await until_sessions(two_processes, before + 1)  # the pool's figures reach gateways twice a second
    await until_sessions(two_processes, before)


async def test_the_token_is_enforced_and_bad_requests_answered(two_processes: Service) -> None:
    url = f"{two_processes.url}/mcp"
    hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient() as http:
        for path in ("/mcp", "/mcp/sse", "/mcp/messages/?session_id=0"):
            assert (await http.post(f"{two_processes.url}{path}", json=hello, headers=accept)).status_code == 401
        assert (await http.get(f"{two_processes.url}/mcp/sse")).status_code == 401
        answer = await http.post(url, json=hello, headers={**AUTH, **accept})
        assert answer.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", answer.headers["mcp-session-id"])
        assert (await http.get(url, headers=AUTH)).status_code == 405
        assert (await http.delete(url, headers=AUTH)).status_code == 400
        short = {**AUTH, **accept, "Mcp-Session-Id": "abc"}  # no id the gateway gives: no session's
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "python_session", "arguments": {"code": "1"}}}
        refused = (await http.post(url, json=call, headers=short)).json()["result"]
        assert refused["isError"] and "Mcp-Session-Id" in refused["content"][0]["text"]
        broken = await http.post(url, content=b"{not json",
                                 headers={**AUTH, **accept, "Content-Type": "application/json"})
        assert 400 <= broken.status_code < 500


async def test_sse(one_process: Service) -> None:
    before = await live_sessions(one_process)
    async with sse_client(f"{one_process.url}/mcp/sse", headers=AUTH) as (read, write):
        async with ClientSession(read, write) as session:
            await the_tools_work(session)
            await until_sessions(one_process, before + 1)
    async with sse_client(f"{one_process.url}/mcp/sse", headers=AUTH) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            assert "NameError" in text(await session.call_tool("python_session", {"code": "x"}))
    await until_sessions(one_process, before)  # each stream's session ended with it


async def test_stdio_forwards_to_a_running_service(one_process: Service) -> None:
    params = StdioServerParameters(command=sys.executable, args=["-m", "codeenv", "mcp", "--url", one_process.url],
                                   env={"PATH": os.environ.get("PATH", "/usr/bin"), "CODEENV_TOKEN": TOKEN,
                                        "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    before = await live_sessions(one_process)
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await the_tools_work(session)
    await until_sessions(one_process, before)  # the process's session ended with it


async def test_nemo_skills_tool_as_their_server_defines_it(two_processes: Service) -> None:
    async with streamable(f"{two_processes.url}/mcp", AUTH) as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            [tool] = [t for t in (await session.list_tools()).tools if t.name == "stateful_python_code_exec"]
            # What their FastMCP server declares for its signature (mcp 1.27, read off their source).
            assert tool.inputSchema["required"] == ["code"]
            assert tool.inputSchema["properties"]["session_id"] == {
                "anyOf": [{"type": "string"}, {"type": "null"}], "default": None,
                "description": "Session id for session persistence", "title": "Session Id"}
            assert tool.inputSchema["properties"]["timeout"]["default"] == 10
            assert tool.outputSchema is not None and tool.outputSchema["required"] == ["output_dict", "session_id"]
            # Their client: session_id null on a conversation's first call, then the one returned.
            first = await session.call_tool("stateful_python_code_exec", {"code": "a = 6\na * 7", "session_id": None,
                                                                          "timeout": 10})
            assert first.structuredContent is not None and not first.isError
            sid = first.structuredContent["session_id"]
            assert first.structuredContent["output_dict"] == {"process_status": "completed", "stdout": "42\n",
                                                              "stderr": ""}
            assert json.loads(text(first)) == first.structuredContent  # the text is the same, as JSON
            late = await session.call_tool("stateful_python_code_exec", {
                "code": "a = 0\nimport time\ntime.sleep(30)", "session_id": sid, "timeout": 1})
            assert late.structuredContent is not None
            assert late.structuredContent["output_dict"]["process_status"] == "timeout"
            again = await session.call_tool("stateful_python_code_exec", {"code": "print(a)", "session_id": sid})
            assert again.structuredContent == {"output_dict": {"process_status": "completed", "stdout": "6\n",
                                                               "stderr": ""}, "session_id": sid}
            bad = await session.call_tool("stateful_python_code_exec", {"code": "1", "timeout": -1})
            assert bad.isError
    async with httpx.AsyncClient(base_url=two_processes.url, headers=AUTH) as http:  # their /sessions lists it
        assert sid in (await http.get("/sessions")).json()["sessions"]
        assert (await http.delete(f"/sessions/{sid}")).status_code == 200
