"""Host functions: a session's code calls named functions that the worker forwards to an HTTP endpoint
on loopback (a real HTTP server in this process), over the session's own channels; the jail still
has no network. Embedded and Redis mode (the `client` fixture), and at the engine."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import pytest_asyncio

from codeenv import SlotPool
from codeenv.bench.services import free_port
from codeenv.errors import SessionError
from codeenv.models import HostFunctions

TOKEN = "Bearer the-endpoint's-own-token-0123456789"


class Endpoint:
    """An HTTP server on 127.0.0.1 that answers host calls by function name, and keeps what it got."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.got: list[dict[str, Any]] = []
        self.delay_s = 0.0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.got.append({**body, "authorization": self.headers.get("Authorization")})
                name, args = body["function"], body["args"]
                if name == "slow":
                    time.sleep(args[0] if args else endpoint.delay_s)
                if name == "fail":
                    self._answer(500, b"the model server is down")
                elif name == "big":
                    self._answer(200, json.dumps("x" * 70_000).encode())
                elif name == "llm_query":  # a fake model: answers with the prompt's length and its last word
                    prompt = args[0]
                    self._answer(200, json.dumps(f"{len(prompt)}:{prompt.split()[-1]}").encode())
                else:
                    self._answer(200, json.dumps({"args": args, "kwargs": body["kwargs"]}).encode())

            def _answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def functions(self, *names: str, **options: Any) -> dict[str, Any]:
        return {name: {"url": f"{self.url}/call", "headers": {"Authorization": TOKEN}, **options} for name in names}


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    served = Endpoint()
    served.thread.start()
    try:
        yield served
    finally:
        served.server.shutdown()
        served.server.server_close()


def key() -> dict[str, str]:
    return {"x-codeenv-session-key": f"host-functions-{uuid.uuid4().hex}"}


#: The sessions a test made, deleted when it ends (a Redis worker would serve them until its drain ends).
MADE: list[tuple[httpx.AsyncClient, str, dict[str, str]]] = []


@pytest_asyncio.fixture
async def deleting(client: httpx.AsyncClient) -> AsyncIterator[None]:
    """The sessions made through `client` deleted after the test, before `client` closes."""
    yield
    for client, sid, headers in MADE:
        await client.delete(f"/v1/sessions/{sid}", headers=headers)
    MADE.clear()


async def new_session(client: httpx.AsyncClient, headers: dict[str, str], **body: Any) -> str:
    made = await client.post("/v1/sessions", json=body, headers=headers)
    assert made.status_code == 201, made.text
    sid: str = made.json()["session_id"]
    MADE.append((client, sid, headers))
    return sid


async def cell(client: httpx.AsyncClient, sid: str, code: str, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    answer = await client.post(f"/v1/sessions/{sid}/execute", json={"code": code, **body}, headers=headers, timeout=60)
    assert answer.status_code in (200, 410), answer.text
    result: dict[str, Any] = answer.json()
    return result


@pytest.mark.jail
@pytest.mark.usefixtures("deleting")
async def test_a_cell_calls_host_functions_and_the_jail_still_has_no_network(
        client: httpx.AsyncClient, endpoint: Endpoint) -> None:
    mine = key()
    sid = await new_session(client, mine, profile="light", functions=endpoint.functions("echo", "fail", "big"))
    info = (await client.get(f"/v1/sessions/{sid}", headers=mine)).json()
    assert info["functions"] == ["big", "echo", "fail"]
    got = await cell(client, sid, "r = echo(1, 'two', k=[3]); r", mine)
    assert got["status"] == "ok" and json.loads(got["value"].replace("'", '"')) == {
        "args": [1, "two"], "kwargs": {"k": [3]}}, got
    [call] = got["host_calls"]
    assert (call["name"], call["status"], call["http_status"]) == ("echo", "ok", 200) and call["ms"] > 0
    assert got["host_s"] > 0
    # The endpoint got the creator's headers; the session never saw them.
    assert endpoint.got[-1]["authorization"] == TOKEN and endpoint.got[-1]["session_id"] == sid
    leak = await cell(client, sid, "import os, json\nprint(json.dumps(dict(os.environ)))\n"
                                   "print(open('/proc/self/cmdline').read())", mine)
    assert "the-endpoint's-own-token" not in leak["stdout"] + leak["stderr"]
    # State persists across cells, and host functions stay callable in later cells.
    assert (await cell(client, sid, "r['args'][1] + str(echo(x=1)['kwargs']['x'])", mine))["value"] == "'two1'"

    # Failures are exceptions in the cell, and reported.
    failed = await cell(client, sid, "try:\n    fail()\nexcept HostFunctionError as e:\n    print(type(e).__name__, e)",
                        mine)
    assert failed["status"] == "ok" and "HostFunctionError fail: the endpoint answered 500" in failed["stdout"]
    assert [(c["name"], c["status"], c["http_status"]) for c in failed["host_calls"]] == [("fail", "error", 500)]
    big = await cell(client, sid, "big()", mine)
    assert big["status"] == "error" and "70,002 bytes" in big["stderr"] and big["host_calls"][0]["status"] == "error"
    unknown = await cell(client, sid, "import sys; from codeenv_inside import hostcalls\n"
                                      "hostcalls.call('no_such', [], {})", mine)
    assert unknown["status"] == "error" and "no host function 'no_such'" in unknown["stderr"], unknown
    not_json = await cell(client, sid, "echo(object())", mine)
    assert not_json["status"] == "error" and "must be JSON" in not_json["stderr"] and not_json["host_calls"] == []

    # The endpoint itself is out of the jail's reach: no network at all.
    direct = await cell(client, sid, f"import urllib.request\nurllib.request.urlopen('{endpoint.url}/call', b'{{}}', "
                                     "timeout=3)", mine)
    assert direct["status"] == "error" and "URLError" in direct["stderr"], direct
    assert len(endpoint.got) == 4  # echo twice, fail and big: the unknown name was never sent


@pytest.mark.jail
@pytest.mark.usefixtures("deleting")
async def test_budgets_are_enforced_per_cell_and_per_session(client: httpx.AsyncClient, endpoint: Endpoint) -> None:
    mine = key()
    sid = await new_session(client, mine, profile="light", functions=endpoint.functions("echo"),
                            host_budget={"cell_calls": 3, "session_calls": 5, "cell_bytes": 100_000})
    loop = ("done = []\nfor i in range(10):\n    try:\n        done.append(echo(i))\n"
            "    except HostFunctionError as e:\n        print(e.status, e)\n        break\nlen(done)")
    first = await cell(client, sid, loop, mine)
    assert first["value"] == "3" and "refused" in first["stdout"] and "made its 3 host calls" in first["stdout"]
    assert [c["status"] for c in first["host_calls"]] == ["ok", "ok", "ok", "refused"]
    second = await cell(client, sid, loop, mine)
    assert second["value"] == "2" and "this session made its 5 host calls" in second["stdout"], second
    info = (await client.get(f"/v1/sessions/{sid}", headers=mine)).json()
    assert info["host_calls"] == 5
    # A flood without waiting for answers: refused in the jail past the cell's budget, counted.
    flood = await cell(client, sid, "from codeenv_inside import hostcalls, protocol\nimport socket\n"
                                    "ch = hostcalls._channel\nfor _ in range(200):\n"
                                    "    ch.send(protocol.encode({'op': 'host_call', 'name': 'echo', 'args': [], "
                                    "'kwargs': {}}))", mine)
    assert flood["status"] == "ok" and flood["host_calls"][-1]["name"] == "*", flood
    assert "more calls refused in the jail" in flood["host_calls"][-1]["message"]
    # Bytes: a cell's arguments past its budget.
    sid2 = await new_session(client, mine, profile="light", functions=endpoint.functions("echo"),
                             host_budget={"cell_bytes": 1000})
    heavy = await cell(client, sid2, "echo('a' * 600)\necho('b' * 600)", mine)
    assert heavy["status"] == "error" and "would pass 1,000 bytes" in heavy["stderr"], heavy


@pytest.mark.jail
@pytest.mark.usefixtures("deleting")
async def test_a_cell_that_times_out_mid_call_is_rolled_back_and_the_call_reported(
        client: httpx.AsyncClient, endpoint: Endpoint) -> None:
    mine = key()
    sid = await new_session(client, mine, profile="light", functions=endpoint.functions("slow", "echo"))
    assert (await cell(client, sid, "n = 1", mine))["status"] == "ok"
    stopped = await cell(client, sid, "n = 2\nslow(5)", mine, limits={"wall_s": 1})
    assert stopped["status"] == "timeout" and stopped["rolled_back"], stopped
    [call] = stopped["host_calls"]
    assert call["name"] == "slow" and call["status"] in ("cancelled", "timeout") and call["ms"] >= 500, call
    after = await cell(client, sid, "n, echo(n)['args']", mine)
    assert after["value"] == "(1, [1])", after  # the session as before the cell, its functions still there
    # A function's own timeout: the call fails, the cell goes on.
    sid2 = await new_session(client, mine, profile="light", functions=endpoint.functions("slow", timeout_s=0.3))
    late = await cell(client, sid2, "try:\n    slow(3)\nexcept HostFunctionError as e:\n    print(e.status)", mine)
    assert late["stdout"] == "timeout\n" and late["host_calls"][0]["status"] == "timeout", late


@pytest.mark.jail
@pytest.mark.usefixtures("deleting")
async def test_a_fork_after_host_calls_keeps_the_functions_with_a_budget_of_its_own(
        client: httpx.AsyncClient, endpoint: Endpoint) -> None:
    mine = key()
    sid = await new_session(client, mine, profile="light", functions=endpoint.functions("echo"),
                            host_budget={"session_calls": 2})
    assert (await cell(client, sid, "seen = [echo(1), echo(2)]", mine))["status"] == "ok"
    forked = await client.post(f"/v1/sessions/{sid}/fork", json={"count": 2}, headers=mine)
    assert forked.status_code == 201, forked.text
    MADE.extend((client, child, mine) for child in forked.json()["session_ids"])
    for i, child in enumerate(forked.json()["session_ids"]):
        got = await cell(client, child, f"len(seen), echo({i})['args']", mine)
        assert got["value"] == f"(2, [{i}])", got
        assert (await client.get(f"/v1/sessions/{child}", headers=mine)).json()["host_calls"] == 1
    spent = await cell(client, sid, "echo(3)", mine)  # the parent's own budget is spent
    assert spent["status"] == "error" and "made its 2 host calls" in spent["stderr"]


@pytest.mark.jail
@pytest.mark.usefixtures("deleting")
async def test_an_rlm_loop_calls_the_model_from_a_cell(client: httpx.AsyncClient, endpoint: Endpoint) -> None:
    """A recursive-language-model REPL: the cell splits a long context and asks the model about each part."""
    mine = key()
    sid = await new_session(client, mine, profile="light", functions=endpoint.functions("llm_query"))
    setup = await cell(client, sid, "context = ' '.join(f'word{i}' for i in range(1000))", mine)
    assert setup["status"] == "ok"
    loop = ("parts = [context[i:i + 500] for i in range(0, len(context), 500)]\n"
            "answers = [llm_query(f'summarize: {part}') for part in parts]\n"
            "final = llm_query('combine: ' + ' '.join(a.split(':')[1] for a in answers))\n"
            "len(answers), final")
    got = await cell(client, sid, loop, mine)
    assert got["status"] == "ok", got
    calls = got["host_calls"]
    parts = -(-len(" ".join(f"word{i}" for i in range(1000))) // 500)
    assert len(calls) == parts + 1 and all(c["status"] == "ok" for c in calls)  # each part and the combination
    assert got["value"].startswith(f"({parts}, '"), got["value"]


@pytest.mark.jail
@pytest.mark.usefixtures("deleting")
async def test_a_session_without_functions_passes_no_call_on(client: httpx.AsyncClient, endpoint: Endpoint) -> None:
    """Its code writes host calls on every socket it holds (its cell's channel is the one): refused.
    (It reads the answer blocking: a timeout would make its channel, which the session goes on
    with, non-blocking, and the code would have broken its own session.)"""
    mine = key()
    sid = await new_session(client, mine, profile="light")
    forged = ("import os, socket\nfrom codeenv_inside import protocol\nanswers = []\n"
              "for fd in map(int, os.listdir('/proc/self/fd')):\n"
              "    try:\n        copy = os.dup(fd)\n    except OSError:\n        continue\n"
              "    try:\n        s = socket.socket(fileno=copy)\n    except OSError:\n"
              "        os.close(copy)  # a pipe's copy kept open would hold the cell's output open\n        continue\n"
              "    call = {'op': 'host_call', 'name': 'echo', 'args': [], 'kwargs': {}}\n"
              "    try:\n        s.send(protocol.encode(call))\n"
              "        answers.append(protocol.decode(s.recv(65536)))\n"
              "    except OSError:\n        pass\n    s.close()\n"
              "[a.get('error') for a in answers if a]")
    got = await cell(client, sid, forged, mine)
    assert got["status"] == "ok" and "this session has no host functions" in got["value"], got
    assert got.get("host_calls") is None and endpoint.got == []
    again = await cell(client, sid, "1 + 1", mine)
    assert again["value"] == "2", again


@pytest.mark.unit
@pytest.mark.parametrize(("url", "allowed"), [
    ("http://127.0.0.1:8000/v1/chat", True),
    ("http://localhost/x", True),
    ("http://[::1]:9/x", True),
    ("http://10.0.0.1/x", False),
    ("https://127.0.0.1/x", False),
    ("http://127.0.0.1.evil.example/x", False),
])
def test_only_urls_the_operator_allows(url: str, allowed: bool) -> None:
    from codeenv.sandbox.host_functions import check_urls
    from codeenv.settings import SandboxSettings

    host = HostFunctions.model_validate({"functions": {"f": {"url": url}}})
    if allowed:
        check_urls(host, SandboxSettings().host_function_urls)
    else:
        with pytest.raises(SessionError, match="not a URL this worker may call"):
            check_urls(host, SandboxSettings().host_function_urls)
    if "10.0.0.1" in url:  # an operator's entry: its host and path
        check_urls(host, ["http://10.0.0.1/x"])
        with pytest.raises(SessionError):
            check_urls(host, ["http://10.0.0.1/y"])


@pytest.mark.jail
@pytest.mark.usefixtures("deleting")
async def test_a_url_the_worker_may_not_call_is_refused_at_creation(client: httpx.AsyncClient) -> None:
    made = await client.post("/v1/sessions", json={"functions": {"f": {"url": "http://10.1.2.3/x"}}}, headers=key())
    assert made.status_code == 403 and "not a URL this worker may call" in made.text, made.text
    bad = await client.post("/v1/sessions", json={"functions": {"not a name": {"url": "http://127.0.0.1/"}}},
                            headers=key())
    assert bad.status_code == 422 and "should match pattern" in bad.text


@pytest.mark.jail
async def test_the_engine_keeps_host_calls_of_a_session(pool: SlotPool, endpoint: Endpoint) -> None:
    from codeenv.models import ExecRequest

    manager = pool.sessions
    assert manager is not None
    host = HostFunctions.model_validate({"functions": endpoint.functions("echo")})
    session = await manager.create("light", host=host)
    try:
        result = await manager.execute(ExecRequest(code="echo('engine')['args']", session=session.id), time.monotonic())
        assert result.value == "['engine']" and result.host_calls is not None and result.host_calls[0].status == "ok"
    finally:
        await manager.delete(session.id)


@pytest.mark.unit
@pytest.mark.parametrize(("spec", "says"), [
    ({"url": "ftp://127.0.0.1/x"}, "should match pattern"),
    ({"url": "http://user:pw@127.0.0.1/x"}, "should match pattern"),
    ({"url": "http://127.0.0.1/", "headers": {"X Token": "a"}}, "should match pattern"),
    ({"url": "http://127.0.0.1/", "headers": {"X-Token": "a\nb"}}, "should match pattern"),
    ({"url": "http://127.0.0.1/", "timeout_s": 0}, "greater than 0"),
    ({"url": "http://127.0.0.1/", "method": "GET"}, "Extra inputs are not permitted"),
])
def test_a_function_is_checked_as_it_is_declared(spec: dict[str, Any], says: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=says):
        HostFunctions.model_validate({"functions": {"f": spec}})
    with pytest.raises(ValidationError, match="should match pattern"):
        HostFunctions.model_validate({"functions": {"no-dashes": {"url": "http://127.0.0.1/"}}})
