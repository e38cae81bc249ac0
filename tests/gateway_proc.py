"""A gateway over tests.fakes.FakeQueue in a process of its own, so that a test can watch its
memory: `python -m tests.gateway_proc PORT`. A call whose code starts with `# slow` takes 2 s."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

import uvicorn

from codeenv.api import create_app
from codeenv.models import ExecRequest, ExecResult
from codeenv.settings import GatewaySettings
from tests.fakes import FakeQueue

SLOW_S = 2.0


class SlowQueue(FakeQueue):
    async def submit(self, requests: Sequence[ExecRequest], *args: object, **kwargs: object) -> list[ExecResult]:
        if any(r.code.startswith("# slow") for r in requests):
            await asyncio.sleep(SLOW_S)
        return await super().submit(requests, *args, **kwargs)  # type: ignore[arg-type]

if __name__ == "__main__":  # the body parser's helpers import this module again: nothing runs then
    uvicorn.run(create_app(GatewaySettings(), SlowQueue()), host="127.0.0.1", port=int(sys.argv[1]),
                log_level="warning")
