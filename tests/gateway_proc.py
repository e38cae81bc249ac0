"""A gateway over tests.fakes.FakeQueue in a process of its own, so that a test can watch its
memory: `python -m tests.gateway_proc PORT`."""

from __future__ import annotations

import sys

import uvicorn

from codeenv.api import create_app
from codeenv.settings import GatewaySettings
from tests.fakes import FakeQueue

if __name__ == "__main__":  # the body parser's helpers import this module again: nothing runs then
    uvicorn.run(create_app(GatewaySettings(), FakeQueue()), host="127.0.0.1", port=int(sys.argv[1]),
                log_level="warning")
