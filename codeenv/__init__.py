"""codeenv: run untrusted Python for agentic RL at the speed of the hardware.

Usage::

    from codeenv import ExecRequest, SlotPool, SandboxSettings

    async with SlotPool(SandboxSettings()) as pool:
        result = await pool.run(ExecRequest(code="print(1)"))
"""

from codeenv.errors import (
    CodeenvError,
    ImageError,
    InvalidRequest,
    LimitExceedsCap,
    PoolClosed,
    SandboxError,
)
from codeenv.models import ErrorInfo, ExecRequest, ExecResult, LimitName, Limits, Status
from codeenv.sandbox.pool import SlotPool
from codeenv.settings import SandboxSettings

__version__ = "0.1.0"

__all__ = [
    "CodeenvError",
    "ErrorInfo",
    "ExecRequest",
    "ExecResult",
    "ImageError",
    "InvalidRequest",
    "LimitExceedsCap",
    "LimitName",
    "Limits",
    "PoolClosed",
    "SandboxError",
    "SandboxSettings",
    "SlotPool",

    "Status",
]
