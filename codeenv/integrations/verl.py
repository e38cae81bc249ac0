"""codeenv as verl's code tool in multi-turn rollouts: `CodeenvTool`, a verl `BaseTool`.

verl (0.9) calls a tool's create, execute and release once per tool call, from its agent loop;
`execute` gets the trajectory as `agent_data` (its `request_id` keys the trajectory's ledger).
Every tool call of a rollout worker goes through one micro-batching client per event loop.

In `rollout.multi_turn.tool_config_path` (see the README)::

    tools:
      - class_name: codeenv.integrations.verl.CodeenvTool
        config: {type: native, url: "http://127.0.0.1:8000", limits: {wall_s: 5}, style: default,
                 max_output_chars: 4096}

The tool schema may be left out: the tool then offers `python(code: str)`. Importing this module
imports verl; `import codeenv` does not.
"""

from __future__ import annotations

import uuid
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from codeenv.integrations.tool import CodeTool, ToolSettings
from codeenv.rl import ToolLedger

#: The tool's schema when the config gives none.
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program in a sandbox and see its output (print what you want to see). "
                       "Each call starts fresh: define everything the program needs.",
        "parameters": {"type": "object", "required": ["code"],
                       "properties": {"code": {"type": "string", "description": "the Python program"}}},
    },
}


class CodeenvTool(BaseTool):  # type: ignore[misc]  # verl ships no type information
    """A verl tool that runs the model's code on codeenv and answers its feedback text.

    `execute` returns (ToolResponse(text=feedback), 0.0, metrics); metrics hold `status`, `cpu_s`,
    `tool_error` and `service_fault` (1 when the service, not the code, failed: the text says so).
    `pop_ledger(request_id)` gives a finished trajectory's tool calls for GRPO-RoC.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(PYTHON_TOOL))
        self.code = CodeTool(ToolSettings.from_mapping(config))

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        agent_data = kwargs.get("agent_data")
        trajectory = str(getattr(agent_data, "request_id", None) or instance_id)
        code = parameters.get("code") if isinstance(parameters, dict) else None
        outcome = await self.code.run(code, trajectory)
        return ToolResponse(text=outcome.text), 0.0, outcome.metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None

    def pop_ledger(self, request_id: str) -> ToolLedger:
        """The tool calls of a finished trajectory (verl's `agent_data.request_id`)."""
        return self.code.pop_ledger(request_id)
