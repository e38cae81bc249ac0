"""codeenv as the code tool of RL frameworks' multi-turn rollouts.

- `codeenv.integrations.verl`: `CodeenvTool`, a verl `BaseTool` (YAML `tool_config_path`);
  `codeenv.integrations.verl_functions`: a `python` function tool (`function_tool_path`).
- `codeenv.integrations.skyrl`: `CodeenvToolGroup`, a SkyRL-gym `ToolGroup` with a `python` tool.

Each imports its framework only when it is imported itself: `import codeenv` and the client never
need torch, verl or SkyRL. The shared part (settings, one micro-batching client per event loop,
feedback, ledgers, service faults as feedback) is `codeenv.integrations.tool`.
"""
