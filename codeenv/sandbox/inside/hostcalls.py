"""Host functions in the jail: as a cell's code sees them (ordinary functions in the session's
namespace), and as the family's supervisor passes their calls on (`HostRelay`).

`bind` defines the cell's host functions (the worker names them in the cell's "host") and points
them at the cell's channel; a call sends its name and JSON arguments to the family's supervisor and
waits for the answer, which the worker got from the function's endpoint (host_functions.py, the
worker's side). The jail has no network: this channel is the only way out, and only for these
names. One call at a time (threads take turns). `unbind` when the cell ends.
"""

from __future__ import annotations

import _thread
import socket

from . import proc
from .protocol import MAX_MSG, Cell, Family, decode, encode

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: Not threading's: importing threading in a zygote makes each of its forks run threading's after-fork
#: hook (measured: print(1) calls/s 0.92x).
_lock = _thread.allocate_lock()
_channel: socket.socket | None = None
_bytes_max = 0


class HostFunctionError(RuntimeError):
    """A host function's call failed: refused (a budget, a size), or its endpoint failed or timed out."""

    def __init__(self, message: str, status: str = "error") -> None:
        super().__init__(message)
        self.status = status


def bind(ch: socket.socket, host: object, namespace: dict[str, Any]) -> None:
    """Define the cell's host functions in `namespace` (a name the session's code gave something else
    keeps it) and send their calls on `ch`."""
    global _channel, _bytes_max
    if not isinstance(host, dict) or not isinstance(host.get("names"), list):
        return
    _channel = ch
    bytes_max = host.get("bytes_max")
    _bytes_max = bytes_max if isinstance(bytes_max, int) else 0
    for name in host["names"]:
        if isinstance(name, str) and name.isidentifier():
            found = namespace.get(name)
            if found is None or getattr(found, "_codeenv_host_function", False):
                namespace[name] = _function(name)
    if "HostFunctionError" not in namespace:
        namespace["HostFunctionError"] = HostFunctionError


def unbind() -> None:
    global _channel
    _channel = None


def _function(name: str) -> Any:
    def host_function(*args: Any, **kwargs: Any) -> Any:
        return call(name, list(args), kwargs)

    host_function.__name__ = host_function.__qualname__ = name
    host_function.__doc__ = (f"{name}(*args, **kwargs): a host function. Its JSON arguments go to the endpoint its "
                             "session's creator set; it returns the endpoint's JSON answer, or raises "
                             "HostFunctionError.")
    host_function._codeenv_host_function = True  # type: ignore[attr-defined]
    return host_function


def call(name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    try:
        data = encode({"op": Cell.HOST_CALL, "name": name, "args": args, "kwargs": kwargs})
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: its arguments must be JSON values ({exc})") from None
    with _lock:
        ch = _channel
        if ch is None:
            raise HostFunctionError(f"{name}: host functions are called from a cell's code", "refused")
        if len(data) > _bytes_max + 1024:
            raise HostFunctionError(f"{name}: its arguments are {len(data):,} bytes of JSON; the most is "
                                    f"{_bytes_max:,}", "refused")
        ch.send(data)
        answer = decode(ch.recv(MAX_MSG))
    if answer is None or answer.get("op") != Cell.HOST_RESULT:
        raise HostFunctionError(f"{name}: no answer (the cell's channel closed)")
    if answer.get("ok"):
        return answer.get("value")
    raise HostFunctionError(str(answer.get("error")), str(answer.get("status", "error")))


class HostRelay:
    """A cell's host calls, passed from its channel to the worker and their answers back: one at a time,
    at most the cell's "host" calls_max (more are refused here and counted: a flood costs the jail's
    own CPU, not the worker's). Answers to the cell never block the supervisor (dropped if its socket
    is full: its code waits until the cell's deadline)."""

    def __init__(self, sock: socket.socket, ours: socket.socket, msg: dict[str, Any]) -> None:
        given = msg.get("host")
        host: dict[str, Any] = given if isinstance(given, dict) else {}
        self.sock, self.ours, self.seq = sock, ours, msg.get("seq")
        self.enabled = bool(host)  # a session without host functions passes nothing on
        self.calls_max = host.get("calls_max", 0) if isinstance(host.get("calls_max"), int) else 0
        self.bytes_max = host.get("bytes_max", 0) if isinstance(host.get("bytes_max"), int) else 0
        self.sent = 0
        self.out: int | None = None  # the call the worker has
        self.refused = 0

    def call(self, got: dict[str, Any], size: int) -> None:
        if not self.enabled:
            self._to_cell({"op": Cell.HOST_RESULT, "ok": False, "status": "refused",
                           "error": "this session has no host functions"})
            return
        if self.out is not None or self.sent > self.calls_max or size > self.bytes_max + 1024:
            self.refused += 1
            why = "one host call at a time" if self.out is not None else \
                "past this cell's host calls" if self.sent > self.calls_max else "its arguments are too large"
            self._to_cell({"op": Cell.HOST_RESULT, "ok": False, "status": "refused", "error": why})
            return
        self.sent += 1  # one past calls_max goes to the worker, which refuses it and says why
        self.out = self.sent
        proc.send(self.sock, {"op": Family.HOST_CALL, "seq": self.seq, "n": self.sent, "name": got.get("name"),
                              "args": got.get("args"), "kwargs": got.get("kwargs")})

    def answer(self, got: dict[str, Any]) -> None:
        if got.get("n") != self.out or got.get("seq") != self.seq:
            return  # a late answer to a call of an earlier cell
        self.out = None
        self._to_cell({k: v for k, v in got.items() if k not in ("n", "seq")})

    def _to_cell(self, msg: dict[str, Any]) -> None:
        try:
            self.ours.send(encode(msg), socket.MSG_DONTWAIT)
        except OSError:
            pass


__all__ = ["HostFunctionError", "HostRelay", "bind", "call", "unbind"]
