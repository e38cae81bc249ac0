"""Host functions: code in a session's cell calls a function by name, and the worker runs the call.

A session is created with named functions (`HostFunctions`: a URL, headers and a timeout each) and a
budget. Their names are defined in the session's namespace (the jail's side: inside/hostcalls.py); a
call travels over the cell's channel to the family's supervisor, which passes it to the worker over
the family socket (one call in flight per cell, at most the cell's budget of them: a flood costs the
jail its own CPU only). The worker checks it against the session's functions and budget, POSTs it to
the function's URL (`{"function", "args", "kwargs", "session_id"}`; the function's headers, which
never enter the jail), and answers the JSON it gets back. The jail itself still has no network.

What the worker checks, and the creator cannot get around: the URL is one the operator allows
(`host_function_urls`: loopback by default), redirects are not followed, no proxy from the
environment is used, arguments and results are at most HOST_CALL_BYTES_MAX bytes of JSON, and each
call counts against the cell's and the session's calls, seconds and bytes. Every call is reported
in the cell's result (`host_calls`, `host_s`), a rolled-back cell's too: a call cannot be undone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import httpx

from codeenv.errors import SessionError, SessionErrorKind
from codeenv.models import HEADERS_OF_THE_REQUEST, HOST_CALL_BYTES_MAX, ExecResult, HostCall, HostFunctions
from codeenv.sandbox.inside.protocol import Family

#: An answer's message, where the endpoint said why it failed (its body's start, printable).
MESSAGE_CHARS = 300


def check_urls(host: HostFunctions, allowed: list[str]) -> None:
    """SessionError (forbidden: 403) unless every function's URL is one `allowed` (the operator's list) allows."""
    for name, function in host.functions.items():
        if not any(_allows(entry, function.url) for entry in allowed):
            raise SessionError(
                f"host function {name!r}: {function.url[:200]!r} is not a URL this worker may call (its operator's "
                f"CODEENV_HOST_FUNCTION_URLS allows {', '.join(allowed) or 'none'})", SessionErrorKind.forbidden)


def _allows(entry: str, url: str) -> bool:
    """Whether `url` has `entry`'s scheme and host, its port (any, if it names none), and begins with its path."""
    try:
        want, got = urllib.parse.urlsplit(entry), urllib.parse.urlsplit(url)
        want_port, got_port = want.port, got.port
    except ValueError:
        return False
    if (want.scheme.lower(), (want.hostname or "").lower()) != (got.scheme.lower(), (got.hostname or "").lower()):
        return False
    if want_port is not None and want_port != (got_port or {"http": 80, "https": 443}.get(got.scheme.lower())):
        return False
    return (got.path or "/").startswith(want.path or "/")


class HostSession:
    """A session's host functions, and its totals against their budget (a fork starts its own)."""

    def __init__(self, spec: HostFunctions) -> None:
        self.spec = spec
        self.calls = 0
        self.seconds = 0.0
        self.bytes = 0

    def fork(self) -> HostSession:
        return HostSession(self.spec)

    def cell_message(self) -> dict[str, Any]:
        """What the jail's side of a cell needs: the names to define, the most calls and bytes."""
        budget = self.spec.budget
        left = max(0, min(budget.cell_calls, budget.session_calls - self.calls))
        return {"names": sorted(self.spec.functions), "calls_max": left, "bytes_max": HOST_CALL_BYTES_MAX}


class CellCalls:
    """One cell's host calls: each answered over the family socket (`send`), each reported."""

    def __init__(self, session: HostSession, session_id: str, seq: int, http: httpx.AsyncClient,
                 send: Callable[[dict[str, Any]], None]) -> None:
        self.session = session
        self.seq = seq  # the cell's, which its answers carry
        self.session_id = session_id
        self.http = http
        self.send = send
        self.calls: list[HostCall] = []
        self.seconds = 0.0
        self.bytes = 0
        self._running: dict[int, tuple[asyncio.Task[None], HostCall, float]] = {}

    def take(self, msg: dict[str, Any]) -> None:
        """A call from the jail (`{"op": "host_call", "n", "name", "args", "kwargs"}`): answered later."""
        n = msg.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or n in self._running:
            return
        name = msg.get("name")
        args, kwargs = msg.get("args"), msg.get("kwargs")
        size = len(json.dumps([args, kwargs], separators=(",", ":")))
        call = HostCall(name=str(name)[:64], status="refused", ms=0.0, bytes_in=size)
        self.calls.append(call)
        why = self._refusal(name, args, kwargs, size)
        if why is not None:
            call.message = why
            self._answer(n, call, error=why)
            return
        assert isinstance(name, str) and isinstance(args, list) and isinstance(kwargs, dict)
        self._count(0.0, size)
        t0 = time.monotonic()
        task = asyncio.create_task(self._run(n, name, args, kwargs, call, t0), name="codeenv-host-call")
        self._running[n] = (task, call, t0)

    def _refusal(self, name: object, args: object, kwargs: object, size: int) -> str | None:
        spec, budget = self.session.spec, self.session.spec.budget
        if not isinstance(name, str) or name not in spec.functions:
            return f"no host function {str(name)[:64]!r} in this session"
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            return "a host call's arguments must be JSON values"
        if size > HOST_CALL_BYTES_MAX:
            return f"its arguments are {size:,} bytes of JSON; the most is {HOST_CALL_BYTES_MAX:,}"
        if len(self.calls) > budget.cell_calls:
            return f"this cell made its {budget.cell_calls} host calls (host_budget.cell_calls)"
        if self.session.calls >= budget.session_calls:
            return f"this session made its {budget.session_calls} host calls (host_budget.session_calls)"
        if self.seconds >= budget.cell_s:
            return f"this cell's host calls took their {budget.cell_s:g} s (host_budget.cell_s)"
        if self.session.seconds >= budget.session_s:
            return f"this session's host calls took their {budget.session_s:g} s (host_budget.session_s)"
        if self.bytes + size > budget.cell_bytes:
            return f"this cell's host calls would pass {budget.cell_bytes:,} bytes (host_budget.cell_bytes)"
        if self.session.bytes + size > budget.session_bytes:
            return f"this session's host calls would pass {budget.session_bytes:,} bytes (host_budget.session_bytes)"
        return None

    def _count(self, seconds: float, size: int, new_call: bool = True) -> None:
        self.seconds += seconds
        self.bytes += size
        self.session.seconds += seconds
        self.session.bytes += size
        self.session.calls += new_call

    async def _run(self, n: int, name: str, args: list[Any], kwargs: dict[str, Any], call: HostCall,
                   t0: float) -> None:
        function = self.session.spec.functions[name]
        budget = self.session.spec.budget
        # The call may take what is left of the cell's and the session's seconds, and its own timeout.
        timeout = max(0.001, min(function.timeout_s, budget.cell_s - self.seconds,
                                 budget.session_s - self.session.seconds))
        body = {"function": name, "args": args, "kwargs": kwargs, "session_id": self.session_id}
        value: Any = None
        try:
            headers = {k: v for k, v in function.headers.items() if k.lower() not in HEADERS_OF_THE_REQUEST}
            answer = await asyncio.wait_for(self.http.post(function.url, json=body, headers=headers), timeout)
            call.http_status = answer.status_code
            text = answer.content
            if not answer.is_success:
                call.status = "error"
                call.message = f"the endpoint answered {answer.status_code}: {_printable(text)}"
            elif len(text) > HOST_CALL_BYTES_MAX:
                call.status = "error"
                call.message = f"the endpoint's answer is {len(text):,} bytes; the most is {HOST_CALL_BYTES_MAX:,}"
            else:
                try:
                    value = json.loads(text)
                    call.status = "ok"
                    call.bytes_out = len(text)
                except ValueError:
                    call.status = "error"
                    call.message = f"the endpoint's answer is not JSON: {_printable(text)}"
        except TimeoutError:
            call.status, call.message = "timeout", f"no answer within {timeout:g} s"
        except httpx.HTTPError as exc:
            call.status, call.message = "error", f"the endpoint could not be reached: {type(exc).__name__}"
        except Exception as exc:  # the call could not even be made (say, a URL httpx cannot encode): answered
            call.status, call.message = "error", f"the call could not be made: {type(exc).__name__}: {exc}"[:300]
        elapsed = time.monotonic() - t0
        call.ms = round(1000 * elapsed, 3)
        self._count(elapsed, call.bytes_out, new_call=False)
        self._running.pop(n, None)
        if call.status == "ok":
            self._answer(n, call, value=value)
        else:
            self._answer(n, call, error=f"{name}: {call.message}")

    def _answer(self, n: int, call: HostCall, value: Any = None, error: str | None = None) -> None:
        reply: dict[str, Any] = {"op": Family.HOST_RESULT, "seq": self.seq, "n": n, "ok": error is None}
        if error is None:
            reply["value"] = value
        else:
            reply["error"] = error
            reply["status"] = call.status
        with contextlib.suppress(OSError):
            self.send(reply)

    def close(self) -> None:
        """The cell is over: calls still out are cancelled (reported so; the endpoint may have had
        them)."""
        now = time.monotonic()
        for task, call, t0 in self._running.values():
            task.cancel()
            call.status, call.ms = "cancelled", round(1000 * (now - t0), 3)
            call.message = "the cell ended before its answer"
            self._count(now - t0, 0, new_call=False)
        self._running.clear()

    def report(self, result: ExecResult, refused_in_jail: int) -> None:
        """Its calls and their seconds in the cell's `result` (after `close`), and those the jail's
        supervisor refused itself, counted in one entry named `*`."""
        result.host_calls, result.host_s = self.calls, round(self.seconds, 6)
        if refused_in_jail:
            self.calls.append(HostCall(name="*", status="refused", ms=0.0, bytes_in=0, message=(
                f"{refused_in_jail} more calls refused in the jail (sent while one was out, or past the cell's "
                "budget)")))


def host_client() -> httpx.AsyncClient:
    """The client host function calls go out with: no proxy from the environment, no redirect."""
    return httpx.AsyncClient(trust_env=False, follow_redirects=False,
                             limits=httpx.Limits(max_connections=256, max_keepalive_connections=32))


def _printable(data: bytes) -> str:
    text = data[:MESSAGE_CHARS].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else " " for c in text)
