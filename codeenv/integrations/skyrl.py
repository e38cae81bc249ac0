"""codeenv as SkyRL-gym's code tool: `CodeenvToolGroup`, a `ToolGroup` with a `python` tool.

SkyRL-gym's tools are plain (synchronous) methods called by an environment's step; every tool
group of a process sends its calls through one background event loop, so calls from many
environments (threads) are micro-batched together. Importing this module imports skyrl_gym.

Usage (in an environment)::

    self.init_tool_groups([CodeenvToolGroup(url="http://127.0.0.1:8000", limits={"wall_s": 5})])
    observation = self._execute_tool("CodeenvToolGroup", "python", [code])

    # stateful=True: one live session per environment, deleted by the environment's close():
    def close(self):
        for group in self.tool_groups:
            group.close()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skyrl_gym.tools.core import ToolGroup, tool

from codeenv.integrations.tool import CodeTool, ToolSettings
from codeenv.rl import ToolLedger


class CodeenvToolGroup(ToolGroup):  # type: ignore[misc]  # skyrl_gym ships no type information
    """A tool group whose `python(code)` runs on codeenv and answers the feedback text. One group
    serves one trajectory (one environment): its ledger is that trajectory's tool calls; `metrics`
    holds the last call's status, cpu_s, tool_error and service_fault. With `stateful=True` its calls
    run in one live session (variables and imports last from call to call), which `close()` deletes:
    call it from the environment's `close()`."""

    def __init__(self, config: Mapping[str, Any] | None = None, **options: Any) -> None:
        self.code = CodeTool(ToolSettings.from_mapping({**(config or {}), **options}))
        self._trajectory = f"skyrl-{id(self)}"
        self.metrics: dict[str, Any] = {}
        super().__init__(name="CodeenvToolGroup")

    @tool  # type: ignore[untyped-decorator]
    def python(self, code: str) -> str:
        outcome = self.code.run_sync(code, self._trajectory)
        self.metrics = outcome.metrics
        return outcome.text

    @property
    def ledger(self) -> ToolLedger:
        """This trajectory's tool calls, for GRPO-RoC."""
        return self.code.ledger(self._trajectory)

    def close(self) -> None:
        """The environment is done: a stateful group's session is deleted (nothing otherwise)."""
        self.code.end_sync(self._trajectory)
