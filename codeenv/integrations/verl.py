"""codeenv as verl's code tool in multi-turn rollouts: `CodeenvTool`, a verl `BaseTool`.

verl (0.8 to 0.9.1) calls a tool's create, execute and release once per tool call, from its agent
loop; `execute` gets the trajectory as `agent_data`. Every tool call of a rollout worker goes through
one micro-batching client per event loop. Each call's figures go into the trajectory's
`agent_data.extra_fields["extras"]["codeenv_tool"]` (a `ToolLedger.as_dict()`), which verl carries
to the trainer's batch (the `extras` column, one of its stable extra fields) and to the reward
function (`extra_info["extras"]`): `codeenv.rl.ledgers_from_batch(batch)` reads them back.

In `rollout.multi_turn.tool_config_path` (see the README)::

    tools:
      - class_name: codeenv.integrations.verl.CodeenvTool
        config: {type: native, url: "http://127.0.0.1:8000", limits: {wall_s: 5}, style: default,
                 max_output_chars: 4096}

The tool schema may be left out: the tool then offers `python(code: str)`. With `stateful: true`
a trajectory's calls run in one live session; verl's own loop never says when a trajectory ends, so
run the rollout with `codeenv.integrations.verl_agent.CodeenvToolAgentLoop` (it ends the session
when the trajectory ends); with verl's `tool_agent` a session ends when its trajectory's
`agent_data` is freed, and its idle TTL is the last backstop. Importing this module imports verl;
`import codeenv` does not.
"""

from __future__ import annotations

import asyncio
import contextvars
import uuid
import weakref
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from codeenv.integrations.tool import CodeTool, ToolSettings
from codeenv.rl import LEDGER_FIELD, ToolLedger

#: The trajectory a `CodeenvToolAgentLoop` is running (its key), seen by the tool calls it makes.
TRAJECTORY: contextvars.ContextVar[str] = contextvars.ContextVar("codeenv_verl_trajectory")

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

#: A stateful tool's schema when the config gives none: its state lasts through the trajectory.
PYTHON_SESSION_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a persistent session and see its output (print what you want to "
                       "see). Variables, functions and imports of earlier calls remain.",
        "parameters": PYTHON_TOOL["function"]["parameters"],  # type: ignore[index]
    },
}

_ending: set[asyncio.Task[None]] = set()  # sessions being ended by a freed trajectory


class CodeenvTool(BaseTool):  # type: ignore[misc]  # verl ships no type information
    """A verl tool that runs the model's code on codeenv and answers its feedback text.

    `execute` returns (ToolResponse(text=feedback), 0.0, metrics); metrics hold `status`, `cpu_s`,
    `tool_error` and `service_fault` (1 when the service, not the code, failed: the text says so).
    The trajectory's tool calls so far are in `agent_data.extra_fields["extras"]["codeenv_tool"]`.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        self.code = CodeTool(ToolSettings.from_mapping(config))
        default = PYTHON_SESSION_TOOL if self.code.settings.stateful else PYTHON_TOOL
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(default))
        self._keys: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        agent_data = kwargs.get("agent_data")
        trajectory = self._trajectory(agent_data, instance_id)
        code = parameters.get("code") if isinstance(parameters, dict) else None
        outcome = await self.code.run(code, trajectory)
        extra_fields = getattr(agent_data, "extra_fields", None)
        if isinstance(extra_fields, dict):
            extras = extra_fields.get("extras")
            if extras is None:
                extras = extra_fields["extras"] = {}
            if isinstance(extras, dict):  # (something else's: left alone)
                extras[LEDGER_FIELD] = self.code.ledger(trajectory).as_dict()
        return ToolResponse(text=outcome.text), 0.0, outcome.metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None

    async def end_trajectory(self, trajectory: str) -> ToolLedger:
        """A trajectory is over (`CodeenvToolAgentLoop` says so): its session, when stateful, is
        deleted; its ledger is taken."""
        await self.code.end(trajectory)
        return self.code.pop_ledger(trajectory)

    def _trajectory(self, agent_data: Any, instance_id: str) -> str:
        """The key of the trajectory a call belongs to: the one `CodeenvToolAgentLoop` runs, else one of
        the call's `agent_data` (whose end, when it is freed, ends its session), else the call's own."""
        key = TRAJECTORY.get(None)
        if key is not None:
            return key
        if agent_data is None:
            return instance_id
        try:
            key = self._keys.get(agent_data)
        except TypeError:  # not weakly referable: its own word, which may not be unique
            return str(getattr(agent_data, "request_id", None) or instance_id)
        if key is None:
            key = self._keys[agent_data] = uuid.uuid4().hex
            weakref.finalize(agent_data, _freed, weakref.ref(self), key, asyncio.get_running_loop())
        return key


def _freed(tool_ref: weakref.ref[CodeenvTool], key: str, loop: asyncio.AbstractEventLoop) -> None:
    """A trajectory's `agent_data` is gone: so are its ledger and (on its event loop) its session."""
    tool = tool_ref()
    if tool is None:
        return
    tool.code.pop_ledger(key)
    if tool.code.holds_session(key):
        def end() -> None:
            task = asyncio.ensure_future(tool.code.end(key))
            _ending.add(task)
            task.add_done_callback(_ending.discard)

        try:
            loop.call_soon_threadsafe(end)
        except RuntimeError:  # its loop is closed: the service's idle TTL ends the session
            pass
