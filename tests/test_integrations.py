"""codeenv as the code tool of verl and SkyRL-gym, against their real classes (from their wheels,
see tests/frameworks.py) and a real codeenv over HTTP."""

from __future__ import annotations

import asyncio
import importlib
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from codeenv.bench.services import free_port
from codeenv.rl import ledgers_from_batch
from tests.conftest import Served
from tests.frameworks import load_skyrl_gym, load_verl

EXAMPLE_YAML = Path(__file__).resolve().parents[1] / "examples" / "verl_config" / "codeenv_tool.yaml"


@pytest_asyncio.fixture
async def service(served: Served) -> AsyncIterator[str]:
    async with served() as url:
        yield url


@pytest_asyncio.fixture(autouse=True)
async def closed_clients() -> AsyncIterator[None]:
    """The tools' client of this test's event loop is closed with it, as a rollout worker does."""
    from codeenv.integrations.tool import close_background_clients, close_clients

    yield
    await close_clients()
    await asyncio.to_thread(close_background_clients)


@pytest.fixture(scope="module")
def verl() -> None:
    load_verl()


class AgentData:
    """What verl's agent loop passes a tool as `agent_data` (a plain object, so weakly referable)."""

    def __init__(self, request_id: str | None = None) -> None:
        self.request_id = request_id
        self.extra_fields: dict[str, Any] = {}


def verl_tool(url: str, tmp_path: Path, **config: Any) -> Any:
    """The tool as verl builds it: its registry reading the README's YAML, pointed at `url`."""
    from verl.tools.tool_registry import initialize_tools_from_config

    text = EXAMPLE_YAML.read_text().replace("http://127.0.0.1:8000", url)
    for key, value in config.items():
        text, found = re.subn(rf"^      {key}:.*$", f"      {key}: {value}", text, count=1, flags=re.MULTILINE)
        if not found:
            text = text.replace("    config:\n", f"    config:\n      {key}: {value}\n", 1)
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    [tool] = initialize_tools_from_config(str(path))
    return tool


@pytest.mark.jail
async def test_verl_tool_create_execute_release(verl: None, service: str, tmp_path: Path) -> None:
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import ToolResponse

    tool = verl_tool(service, tmp_path)
    assert isinstance(tool, BaseTool) and tool.name == "python"
    assert tool.get_openai_tool_schema().function.parameters.required == ["code"]
    agent_data = AgentData("traj-1")  # what verl's agent loop passes

    async def call(code: Any, agent_data: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        # As verl's tool agent loop does it: create, execute, release per tool call.
        instance_id, _ = await tool.create(create_kwargs={})
        try:
            response: tuple[ToolResponse, float, dict[str, Any]] = await tool.execute(
                instance_id, {"code": code}, agent_data=agent_data)
            return response
        finally:
            await tool.release(instance_id)

    response, reward, metrics = await call("print(6 * 7)", agent_data)
    assert "42" in response.text and reward == 0.0
    assert metrics["status"] == "ok" and metrics["tool_error"] == 0 and metrics["service_fault"] == 0
    assert isinstance(metrics["cpu_s"], float)
    response, _, metrics = await call("1 / 0", agent_data)
    assert "ZeroDivisionError" in response.text and metrics["tool_error"] == 1
    response, _, metrics = await call(None, agent_data)
    assert "code" in response.text and metrics["tool_error"] == 1
    # The trajectory's calls so far, where verl carries them to the trainer (a stable column).
    [ledger] = ledgers_from_batch([agent_data.extra_fields])
    assert (ledger.calls, ledger.tool_errors, ledger.service_faults) == (2, 1, 0)
    assert ledger.statuses == {"ok": 1, "error": 1} and ledger.cpu_s > 0
    assert set(agent_data.extra_fields) == {"extras"}
    del agent_data  # the trajectory is over: the tool keeps nothing of it
    assert not tool.code._ledgers


@pytest.mark.jail
async def test_verl_tool_calls_of_many_trajectories_are_batched(verl: None, service: str, tmp_path: Path) -> None:
    from codeenv.integrations.tool import _client

    tool = verl_tool(service, tmp_path)
    client = _client(tool.code.settings)
    sent = client.requests_sent

    async def trajectory(k: int) -> str:
        instance_id, _ = await tool.create()
        response, _, _ = await tool.execute(instance_id, {"code": f"print({k} * 2)"}, agent_data=agent_data[k])
        await tool.release(instance_id)
        return str(response.text)

    agent_data = [AgentData(f"t{k}") for k in range(24)]
    texts = await asyncio.gather(*(trajectory(k) for k in range(24)))
    assert all(str(2 * k) in text for k, text in enumerate(texts))
    assert client.requests_sent - sent < 24  # micro-batched across trajectories
    assert [ledger.calls for ledger in ledgers_from_batch([a.extra_fields for a in agent_data])] == [1] * 24


@pytest.mark.unit
async def test_verl_tool_turns_service_faults_into_feedback(verl: None, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tool = verl_tool(url, tmp_path, client="{retries: 1, backoff_s: 0.01}")
    instance_id, _ = await tool.create()
    agent_data = AgentData("down")
    response, _, metrics = await tool.execute(instance_id, {"code": "print(1)"}, agent_data=agent_data)
    assert "service reason" in response.text and metrics["service_fault"] == 1 and metrics["tool_error"] == 0
    [ledger] = ledgers_from_batch([agent_data.extra_fields])
    assert (ledger.service_faults, ledger.tool_errors, ledger.tool_error_ratio) == (1, 0, None)


@pytest.mark.jail
async def test_verl_function_tool(verl: None, service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.tools.function_tool import load_function_tools_from_path, normalize_function_tool_return

    monkeypatch.setenv("CODEENV_URL", service)
    monkeypatch.setenv("CODEENV_TOOL_LIMITS", '{"wall_s": 5}')
    sys.modules.pop("codeenv.integrations.verl_functions", None)
    path = importlib.util.find_spec("codeenv.integrations.verl_functions").origin  # type: ignore[union-attr]
    [tool] = load_function_tools_from_path(str(path))
    schema = tool.tool_schema.function
    assert (tool.name, schema.parameters.required, list(schema.parameters.properties)) == ("python", ["code"], ["code"])
    response, _, _ = normalize_function_tool_return(await tool.call({"code": "print(sum(range(10)))"}))
    assert "45" in response.text


@pytest.mark.jail
async def test_skyrl_tool_group_in_a_real_environment(service: str) -> None:
    load_skyrl_gym()
    from skyrl_gym.tools.core import ToolGroup

    from codeenv.integrations.skyrl import CodeenvToolGroup

    group = CodeenvToolGroup(url=service, limits={"wall_s": 5})
    assert isinstance(group, ToolGroup) and group.get_tool_names() == ["python"]
    env = skyrl_env(group)
    observations = await asyncio.to_thread(lambda: [env.step("print(2 ** 10)"), env.step("import nope")])
    assert "1024" in observations[0] and "ModuleNotFoundError" in observations[1]
    assert group.metrics["tool_error"] == 1
    assert (group.ledger.calls, group.ledger.tool_errors) == (2, 1)


def skyrl_env(group: Any) -> Any:
    """A SkyRL-gym BaseTextEnv whose step runs its action with `group`'s python tool, and whose
    close() closes its tool groups (as the README tells an environment to)."""
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    class Env(BaseTextEnv):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.init_tool_groups([group])

        def step(self, action: str) -> Any:
            return self._execute_tool("CodeenvToolGroup", "python", [action])

        def close(self) -> None:
            for tool_group in self.tool_groups:
                tool_group.close()

    return Env()


async def live_sessions(service: str) -> float:
    async with httpx.AsyncClient(base_url=service) as http:
        text = (await http.get("/metrics")).text
    return float(re.search(r"^codeenv_sessions (\S+)$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]


@pytest.mark.jail
async def test_skyrl_stateful_tool_group_keeps_state_and_deletes_its_session(service: str) -> None:
    load_skyrl_gym()
    from codeenv.integrations.skyrl import CodeenvToolGroup

    group = CodeenvToolGroup(url=service, stateful=True, limits={"wall_s": 5})
    before = await live_sessions(service)
    env = skyrl_env(group)
    observations = await asyncio.to_thread(lambda: [env.step("x = 41"), env.step("x += 1\nprint(x)")])
    assert "42" in observations[1], observations
    assert await live_sessions(service) == before + 1
    await asyncio.to_thread(env.close)
    assert await live_sessions(service) == before and group.code.live_sessions == 0
    assert (group.ledger.calls, group.ledger.tool_errors) == (2, 0)


@pytest.mark.jail
async def test_a_stateful_tool_ends_every_trajectorys_session(service: str) -> None:
    from codeenv.integrations.tool import CodeTool, ToolSettings

    tool = CodeTool(ToolSettings.from_mapping({"url": service, "stateful": True, "limits": {"wall_s": 5}}))
    before = await live_sessions(service)

    async def trajectory(i: int) -> str:
        await tool.run(f"n = {i}", f"t{i}")
        outcome = await tool.run("print(n * 2)", f"t{i}")
        await tool.end(f"t{i}")
        return outcome.text

    texts = await asyncio.gather(*(trajectory(i) for i in range(64)))
    assert [t.strip() for t in texts] == [str(2 * i) for i in range(64)]
    assert tool.live_sessions == 0 and await live_sessions(service) == before
    with pytest.raises(ValueError, match="stateful"):
        ToolSettings.from_mapping({"url": service, "snapshot": "s"})


@pytest.mark.jail
async def test_verl_stateful_tool_keeps_a_trajectorys_state_and_ends_its_session(
        verl: None, service: str, tmp_path: Path) -> None:
    from codeenv.integrations.verl import TRAJECTORY, CodeenvTool

    tool = verl_tool(service, tmp_path, stateful="true")
    # Without a schema in its config, a stateful tool tells the model its state lasts.
    assert "persistent session" in CodeenvTool({"url": service, "stateful": True}).tool_schema.function.description
    before = await live_sessions(service)

    async def call(agent_data: Any, code: str, calls: int = 1) -> list[str]:
        async def one() -> str:
            instance_id, _ = await tool.create()
            response, _, _ = await tool.execute(instance_id, {"code": code}, agent_data=agent_data)
            await tool.release(instance_id)
            return str(response.text)

        return await asyncio.gather(*(one() for _ in range(calls)))

    # verl's own loop: a trajectory is its agent_data, and its session ends when that is freed.
    first, second = AgentData(), AgentData()
    await call(first, "x = 41")
    await call(second, "x = 1")
    assert await call(first, "x += 1\nprint(x)") == ["42"]
    assert "4" in (await call(second, "import os\nprint(x + 3)"))[0]
    assert tool.code.live_sessions == 2 and await live_sessions(service) == before + 2
    del first, second
    await until(lambda: tool.code.live_sessions == 0)
    await until_sessions(service, before)
    # Parallel calls of one trajectory's first turn share the one session they start.
    third = AgentData()
    assert len(await call(third, "y = 7", calls=4)) == 4
    assert tool.code.live_sessions == 1 and await live_sessions(service) == before + 1
    [ledger] = ledgers_from_batch([third.extra_fields])
    assert ledger.calls == 4
    del third
    await until_sessions(service, before)
    # codeenv's agent loop names the trajectory: its end ends the session, whatever agent_data is.
    token = TRAJECTORY.set("trajectory-1")
    try:
        await call(AgentData(), "z = 5")
        assert await call(AgentData(), "print(z)") == ["5"]
    finally:
        TRAJECTORY.reset(token)
    ledger = await tool.end_trajectory("trajectory-1")
    assert ledger.calls == 2 and await live_sessions(service) == before


async def until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not in time"
        await asyncio.sleep(0.01)


async def until_sessions(service: str, count: int, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (now := await live_sessions(service)) != count:
        assert asyncio.get_running_loop().time() < deadline, f"{now} live sessions, not {count}"
        await asyncio.sleep(0.05)
