"""Sessions whose pool runs in another process: the host's pool process behind `serve --processes N`
(over its Unix socket) and Redis workers (over their inboxes). A session lives in the pool that
created it; every request about it goes there, whichever gateway process received it.

One message shape for both transports. A request is a JSON object with ``op`` (``create``,
``lookup``, ``fork``, ``snapshot``, ``delete``, ``describe``), ``owner`` (the hash of the caller's
session key, hex) and the op's own fields (``id``; ``profile``, ``limits``, ``idle_ttl_s``,
``session_id``: one the caller chose; ``host``: its host functions, headers included (the
transport is the service's own); ``count``; ``snapshot``: ``id`` names a snapshot; ``ttl_s``).
The answer is
``{"ok": ...}`` (a session's description, a list of them, or null) or ``{"error": KIND, "message":
...}``, KIND a SessionErrorKind value, ``invalid`` (422) or ``failed`` (the host refused a family's
set-up: 503). A session's cells are calls (ExecRequest.session): each transport carries them as it
carries calls, with the caller's owner beside each.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from codeenv.errors import InvalidRequest, SandboxError, SessionError, SessionErrorKind
from codeenv.models import HostFunctions, Limits, SessionInfo
from codeenv.queue.base import SessionService

#: An answer of the pool's side.
Answer = dict[str, Any]


async def serve(sessions: SessionService, message: dict[str, Any]) -> Answer:
    """Answer one session request (the pool's side) from `sessions`, the pool's own."""
    owner = bytes.fromhex(message.get("owner") or "")
    try:
        op = message["op"]
        if op == "create":
            limits = None if message.get("limits") is None else Limits.model_validate(message["limits"])
            host = None if message.get("host") is None else HostFunctions.model_validate(message["host"])
            info = await sessions.create(message.get("profile"), limits, message.get("idle_ttl_s"), owner,
                                         message.get("session_id"), host)
            return {"ok": info.model_dump(exclude_none=True)}
        if op == "describe":
            return {"ok": [i.model_dump(exclude_none=True) for i in await sessions.describe(owner)]}
        session_id = str(message["id"])
        if op == "lookup":
            return {"ok": (await sessions.lookup(session_id, owner)).model_dump(exclude_none=True)}
        if op == "fork":
            count = message.get("count", 1)
            if not isinstance(count, int) or isinstance(count, bool):
                raise TypeError("count: an integer")
            forks = await sessions.fork(session_id, owner, count, message.get("snapshot") is True)
            return {"ok": [i.model_dump(exclude_none=True) for i in forks]}
        if op == "snapshot":
            ttl_s = message.get("ttl_s")
            if ttl_s is not None and (not isinstance(ttl_s, int | float) or isinstance(ttl_s, bool)):
                raise TypeError("ttl_s: a number")
            return {"ok": (await sessions.snapshot(session_id, owner, ttl_s)).model_dump(exclude_none=True)}
        if op == "delete":
            await sessions.delete(session_id, owner, message.get("snapshot") is True)
            return {"ok": None}
        return {"error": "invalid", "message": f"no session operation {op!r}"}
    except SessionError as exc:
        return {"error": exc.kind.value, "message": str(exc)}
    except (InvalidRequest, ValueError, KeyError, TypeError) as exc:  # a bad profile or limits; a bad message
        return {"error": "invalid", "message": str(exc)}
    except SandboxError as exc:
        return {"error": "failed", "message": str(exc)}


def raise_error(answer: Answer) -> None:
    """Raise what an answer with an ``error`` says, as the pool raised it."""
    kind, message = answer.get("error"), str(answer.get("message", ""))
    if kind is None:
        return
    if kind == "invalid":
        raise InvalidRequest(message)
    if kind == "failed" or kind not in SessionErrorKind._value2member_map_:
        raise SandboxError(message if kind == "failed" else f"the pool answered {kind!r}: {message}")
    raise SessionError(message, SessionErrorKind(kind))


#: Sends one request to the pool that holds session `id` (None: the pool a new session goes to) and
#: returns its answer; raises SessionError (ended) when that pool is gone.
Ask = Callable[[dict[str, Any], str | None], Awaitable[Answer]]
#: Sends one request to every pool, and returns their answers.
AskAll = Callable[[dict[str, Any]], Awaitable[list[Answer]]]


class RemoteSessions:
    """A gateway's SessionService over a transport to the pools that hold the sessions."""

    def __init__(self, ask: Ask, ask_all: AskAll) -> None:
        self._ask = ask
        self._ask_all = ask_all

    async def _info(self, message: dict[str, Any], session_id: str | None) -> SessionInfo:
        answer = await self._ask(message, session_id)
        raise_error(answer)
        return SessionInfo.model_validate(answer["ok"])

    async def create(self, profile: str | None, limits: Limits | None, idle_ttl_s: float | None,
                     owner: bytes, session_id: str | None = None, host: HostFunctions | None = None) -> SessionInfo:
        message: dict[str, Any] = {"op": "create", "owner": owner.hex(), "profile": profile, "idle_ttl_s": idle_ttl_s,
                                   "limits": None if limits is None else limits.model_dump(exclude_none=True),
                                   "session_id": session_id}
        if host is not None:
            message["host"] = host.model_dump()
        return await self._info(message, None)

    async def lookup(self, session_id: str, owner: bytes) -> SessionInfo:
        return await self._info({"op": "lookup", "owner": owner.hex(), "id": session_id}, session_id)

    async def fork(self, session_id: str, owner: bytes, count: int = 1, snapshot: bool = False) -> list[SessionInfo]:
        answer = await self._ask({"op": "fork", "owner": owner.hex(), "id": session_id, "count": count,
                                  "snapshot": snapshot}, session_id)
        raise_error(answer)
        return [SessionInfo.model_validate(i) for i in answer["ok"]]

    async def snapshot(self, session_id: str, owner: bytes, ttl_s: float | None) -> SessionInfo:
        return await self._info({"op": "snapshot", "owner": owner.hex(), "id": session_id, "ttl_s": ttl_s},
                                session_id)

    async def delete(self, session_id: str, owner: bytes, snapshot: bool = False) -> None:
        raise_error(await self._ask({"op": "delete", "owner": owner.hex(), "id": session_id, "snapshot": snapshot},
                                    session_id))

    async def describe(self, owner: bytes) -> list[SessionInfo]:
        infos: list[SessionInfo] = []
        for answer in await self._ask_all({"op": "describe", "owner": owner.hex()}):
            if "ok" in answer:  # a pool that cannot answer holds none the caller can reach now
                infos += [SessionInfo.model_validate(i) for i in answer["ok"]]
        return infos
