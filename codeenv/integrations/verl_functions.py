"""A `python` function tool for verl's `rollout.multi_turn.function_tool_path`.

Point verl at this file (`python -c "import codeenv.integrations.verl_functions as m; print(m.__file__)"`).
Function tools get no config: the service is `CODEENV_URL` (default http://127.0.0.1:8000), with
`CODEENV_TOKEN`, `CODEENV_TOOL_LIMITS` (JSON, e.g. '{"wall_s": 5}'), `CODEENV_TOOL_STYLE` and
`CODEENV_TOOL_MAX_OUTPUT_CHARS`. Stateless: every call is a fresh program.
"""

from __future__ import annotations

from verl.tools.function_tool import function_tool

from codeenv.integrations.tool import CodeTool, ToolSettings

_tool = CodeTool(ToolSettings.from_env())


@function_tool  # type: ignore[untyped-decorator]
async def python(code: str) -> str:
    """Run a Python program in a sandbox and see its output (print what you want to see).

    Args:
        code: The Python program to run. Each call starts fresh: define everything it needs.
    """
    return (await _tool.run(code)).text
