"""verl's tool agent loop that ends each trajectory's codeenv session when the trajectory ends.

verl calls a tool once per tool call and never tells it that a trajectory is over, so a stateful
`CodeenvTool` (`stateful: true`) would leave each trajectory's session to its idle TTL: at 1,024
trajectories a step, TTL alone fills the service's sessions within a few steps.
`CodeenvToolAgentLoop` is verl's `ToolAgentLoop` (0.8 to 0.9.1) whose `run()` marks the trajectory
its tool calls belong to and, when it returns or fails, deletes that trajectory's session in every
`CodeenvTool` it has. `examples/verl_config/codeenv_agent_loop.yaml` registers it with verl as
`tool_agent` (in place of verl's own, so datasets that name `tool_agent` get it) and as
`codeenv_tool_agent`::

    actor_rollout_ref.rollout.agent.agent_loop_config_path=examples/verl_config/codeenv_agent_loop.yaml

Importing this module imports verl's agent loop (torch, ray, transformers): only a rollout worker does.
"""

from __future__ import annotations

import uuid
from typing import Any

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from codeenv.integrations.verl import TRAJECTORY, CodeenvTool


@register("codeenv_tool_agent")
class CodeenvToolAgentLoop(ToolAgentLoop):  # type: ignore[misc]  # verl ships no type information
    """verl's `ToolAgentLoop`; a `CodeenvTool`'s session lives exactly as long as its trajectory."""

    async def run(self, sampling_params: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        trajectory = uuid.uuid4().hex
        token = TRAJECTORY.set(trajectory)  # copied into the tasks its tool calls run in
        try:
            return await super().run(sampling_params, *args, **kwargs)
        finally:
            TRAJECTORY.reset(token)
            for tool in self.tools.values():
                if isinstance(tool, CodeenvTool):
                    await tool.end_trajectory(trajectory)
