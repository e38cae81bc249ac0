"""The trainer side of codeenv: a micro-batching HTTP client and tool-feedback formatting.

Imports nothing of the server (no nsjail, FastAPI or Redis): ``pip install codeenv`` is enough.

Usage::

    from codeenv.client import AsyncClient, format_feedback

    async with AsyncClient("http://127.0.0.1:8000") as client:
        result = await client.run("import sympy; print(sympy.factorint(360))", limits={"wall_s": 5})
        text = format_feedback(result)            # what the model sees
"""

from codeenv.client._async import AsyncClient
from codeenv.client._problem import Problem
from codeenv.client._session import AsyncSession, AsyncSnapshot, Recorder
from codeenv.client._sync import Client, Session, Snapshot
from codeenv.client.errors import (
    ClientClosed,
    ClientError,
    RequestRejected,
    ServerError,
    SessionLost,
    TransportError,
)
from codeenv.client.feedback import format_feedback, neutralize, truncate_middle
from codeenv.models import ErrorInfo, ExecRequest, ExecResult, JudgeResult, Status

__all__ = [
    "AsyncClient",
    "AsyncSession",
    "AsyncSnapshot",
    "Client",
    "ClientClosed",
    "ClientError",
    "ErrorInfo",
    "ExecRequest",
    "ExecResult",
    "JudgeResult",
    "Problem",
    "Recorder",
    "RequestRejected",
    "ServerError",
    "Session",
    "SessionLost",
    "Snapshot",
    "Status",
    "TransportError",
    "format_feedback",
    "neutralize",
    "truncate_middle",
]
