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

TYPE_CHECKING = False
if TYPE_CHECKING:
    from codeenv.sandbox.pool import SlotPool
    from codeenv.settings import SandboxSettings

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The engine loads on first use, so that `codeenv.client` and `codeenv.rl` import nothing of
    # the server (nsjail, FastAPI, Redis, settings).
    if name == "SlotPool":
        from codeenv.sandbox.pool import SlotPool

        return SlotPool
    if name == "SandboxSettings":
        from codeenv.settings import SandboxSettings

        return SandboxSettings
    raise AttributeError(f"module 'codeenv' has no attribute {name!r}")

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
