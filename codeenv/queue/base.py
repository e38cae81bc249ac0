"""The interface every queue backend offers the gateway."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from codeenv.models import ExecRequest, ExecResult


class CallQueue(Protocol):
    """Takes batches of calls and answers each with a result, in order."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...

    async def submit(self, requests: Sequence[ExecRequest]) -> list[ExecResult]:
        """One result per request, in request order; never raises for a single bad call."""
        ...

    def ready(self) -> bool:
        """Whether calls can be run now (started, with at least one healthy slot)."""
        ...
