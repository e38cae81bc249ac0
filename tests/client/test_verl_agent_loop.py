"""verl's own rollout code with codeenv's tool, against a running service: verl 0.9.1's
`AgentLoopWorker` (built from verl's trainer config, loading the tool and agent-loop YAMLs the README
gives), its `ToolAgentLoop`, the batch it builds (`_postprocess`, `tool_extra_fields`) and its reward
manager; then the trainer side (`codeenv.rl.ledgers_from_batch`, `roc_indices`).

scripts/test-client runs it in a Python 3.11 venv with verl (its own dependencies left out) and
the CPU build of torch, against `CODEENV_TEST_URL`. The policy is scripted, not a model: its turns are
token ids of a byte-level tokenizer made here, with a chat template in Hermes' tool-call format.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import verl
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from verl import DataProto
from verl.experimental.agent_loop import agent_loop as verl_agent_loop
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.workers.rollout.replica import TokenOutput

from codeenv.rl import ledger_of, ledgers_from_batch, roc_indices

URL = os.environ.get("CODEENV_TEST_URL", "http://127.0.0.1:8000")
EXAMPLES = Path(os.environ.get("CODEENV_EXAMPLES", Path(__file__).resolve().parents[2] / "examples"))
TOOL_YAML = EXAMPLES / "verl_config" / "codeenv_tool.yaml"
LOOP_YAML = EXAMPLES / "verl_config" / "codeenv_agent_loop.yaml"

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def model_dir(path: Path) -> Path:
    """A model directory verl's model config accepts: a byte-level tokenizer and a tiny config."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 300, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
        "max_position_embeddings": 8192}))
    return path


Script = Callable[[str, int, str], str]  # (the task's name, the turn, the last tool response) -> the reply


class ScriptedPolicy:
    """Stands in for verl's LLM server client: each reply is what `script` says for the prompt's task
    (`task <name>` in the user's message) at its turn (the tool responses so far)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.tokenizer: Any = None

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> TokenOutput:
        text = self.tokenizer.decode(prompt_ids)
        task = re.search(r"task (\S+)<\|im_end\|>", text)
        assert task is not None, text[-300:]
        responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
        reply = self.script(task.group(1), len(responses), responses[-1] if responses else "")
        ids = self.tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False)
        return TokenOutput(token_ids=ids, log_probs=[0.0] * len(ids), stop_reason="completed")


def call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


class RewardWorker:
    """Stands in for verl's reward loop actor handle (`handle.compute_score.remote(data)`): verl's own
    NaiveRewardManager scores each trajectory, with a reward function reading the tool's ledger."""

    def __init__(self, tokenizer: Any) -> None:
        self.seen: list[dict[str, Any]] = []
        manager = NaiveRewardManager(OmegaConf.create({}), tokenizer, self.score)

        class Method:
            @staticmethod
            def remote(data: DataProto) -> Any:
                return manager.run_single(data)

        self.compute_score = Method()

    def score(self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any]) -> dict:
        ledger = ledger_of(extra_info)  # what a custom reward function gets: extra_info["extras"]
        self.seen.append({"calls": ledger.calls, "tool_errors": ledger.tool_errors, "task": extra_info["task"]})
        return {"score": float(ground_truth in solution_str), "tool_calls": ledger.calls}


@pytest.fixture
def registry() -> Iterator[None]:
    """verl's agent-loop registry is global: a worker that loads codeenv's YAML changes it."""
    saved = dict(verl_agent_loop._agent_loop_registry)
    yield
    verl_agent_loop._agent_loop_registry.clear()
    verl_agent_loop._agent_loop_registry.update(saved)


def worker(tmp_path: Path, policy: ScriptedPolicy, *, stateful: bool = False, codeenv_loop: bool = True,
           reward: bool = False) -> tuple[AgentLoopWorker, RewardWorker | None]:
    """verl's AgentLoopWorker, built from verl's trainer config as a rollout worker builds it, with the
    README's tool YAML (pointed at the service) and, with `codeenv_loop`, its agent-loop YAML."""
    config = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    config.actor_rollout_ref.model.path = str(model_dir(tmp_path / "model"))
    rollout = config.actor_rollout_ref.rollout
    rollout.name, rollout.prompt_length, rollout.response_length = "vllm", 1024, 2048
    rollout.multi_turn.enable, rollout.multi_turn.max_tool_response_length = True, 1000
    tools = TOOL_YAML.read_text().replace("http://127.0.0.1:8000", URL)
    if stateful:
        tools = tools.replace("    config:\n", "    config:\n      stateful: true\n", 1)
    (tmp_path / "tools.yaml").write_text(tools)
    rollout.multi_turn.tool_config_path = str(tmp_path / "tools.yaml")
    if codeenv_loop:
        rollout.agent.agent_loop_config_path = str(LOOP_YAML)
    policy_tokenizer = PreTrainedTokenizerFast.from_pretrained(config.actor_rollout_ref.model.path)
    policy.tokenizer = policy_tokenizer
    rewards = RewardWorker(policy_tokenizer) if reward else None
    built = AgentLoopWorker(config, llm_client=policy, reward_loop_worker_handles=[rewards] if rewards else None)
    return built, rewards


def batch(tasks: list[str], groups: list[str]) -> DataProto:
    """The rollout input verl's trainer hands its workers: one row per trajectory."""
    n = len(tasks)
    column = lambda values: np.array(values, dtype=object)  # noqa: E731
    return DataProto.from_single_dict({
        "sample": torch.arange(n),  # a tensor column, as the trainer's batch has (its prompt's ids)
        "raw_prompt": column([[{"role": "user", "content": f"task {t}"}] for t in tasks]),
        "agent_name": column(["tool_agent"] * n),
        "uid": column(groups),
        "data_source": column(["codeenv"] * n),
        "reward_model": column([{"ground_truth": "42"}] * n),
        "extra_info": column([{"task": t} for t in tasks]),
    }, meta_info={"global_steps": 1, "validate": False})


def tool_responses(worker: AgentLoopWorker, output: DataProto) -> list[list[str]]:
    texts = worker.tokenizer.batch_decode(output.batch["responses"], skip_special_tokens=False)
    return [re.findall(r"<tool_response>\n(.*?)\n</tool_response>", t, re.DOTALL) for t in texts]


async def live_sessions() -> float:
    async with httpx.AsyncClient(base_url=URL) as http:
        text = (await http.get("/metrics")).text
    found = re.search(r"^codeenv_sessions (\S+)$", text, re.MULTILINE)
    assert found is not None
    return float(found.group(1))


# Three samples of each prompt: a clean success, a failure, a success after a tool error.
SAMPLES = {"0": ["print(6 * 7)"], "1": ["print(6 * 7"], "2": ["1 / 0", "print(42)"]}


def roc_script(task: str, turn: int, last: str) -> str:
    codes = SAMPLES[task.split(".")[1]]
    if turn < len(codes) and (turn == 0 or "42" not in last):
        return call(codes[turn])
    return "The answer is 42." if last.strip() == "42" else "I cannot tell."


async def test_the_batch_carries_each_trajectorys_tool_calls_to_the_trainer_and_the_reward(
        tmp_path: Path, registry: None) -> None:
    built, rewards = worker(tmp_path, ScriptedPolicy(roc_script), reward=True)
    tasks = [f"{p}.{s}" for p in range(4) for s in SAMPLES]
    inputs = batch(tasks, [f"prompt-{t.split('.')[0]}" for t in tasks])
    output = await built.generate_sequences(RayPPOTrainer._get_gen_batch(None, inputs))  # as verl's fit()

    assert len(output) == 12
    responses = tool_responses(built, output)
    ledgers = ledgers_from_batch(output)  # the trainer's batch: the `extras` column
    for task, seen, ledger in zip(tasks, responses, ledgers, strict=True):
        sample = task.split(".")[1]
        want = {"0": (1, 0), "1": (1, 1), "2": (2, 1)}[sample]
        assert (ledger.calls, ledger.tool_errors, ledger.service_faults) == (*want, 0), (task, ledger)
        assert ledger.statuses == {"0": {"ok": 1}, "1": {"error": 1}, "2": {"error": 1, "ok": 1}}[sample]
        assert len(seen) == want[0] and (sample == "1" or seen[-1].strip() == "42"), (task, seen)
    assert "SyntaxError" in responses[1][0] and "ZeroDivisionError" in responses[2][0]
    # The reward side: verl's reward manager hands the tool's fields to the reward function.
    assert rewards is not None
    by_task = {seen["task"]: seen for seen in rewards.seen}
    assert by_task["3.2"] == {"calls": 2, "tool_errors": 1, "task": "3.2"} and len(by_task) == 12
    assert list(output.non_tensor_batch["tool_calls"]) == [ledger.calls for ledger in ledgers]

    # GRPO-RoC as the README's recipe has it, in verl's trainer right after the rollout joined its
    # input: of each prompt's 3, keep 2: the clean success and the failure, not the success after a
    # tool error.
    step = inputs.union(output)
    scores = step.batch["rm_scores"].sum(-1).tolist()
    assert scores == [1.0, 0.0, 1.0] * 4
    keep = roc_indices(step.non_tensor_batch["uid"], scores, ledgers_from_batch(step), 2,
                       rng=np.random.default_rng(1))
    step = step.select_idxs(keep)
    kept = [info["task"] for info in step.non_tensor_batch["extra_info"]]
    assert kept == [f"{p}.{s}" for p in range(4) for s in "01"]


@pytest.mark.parametrize("codeenv_loop", [True, False], ids=["codeenv_loop", "verl_loop"])
async def test_a_stateful_tool_keeps_a_trajectorys_state_and_its_end_ends_the_session(
        tmp_path: Path, registry: None, codeenv_loop: bool) -> None:
    def script(task: str, turn: int, last: str) -> str:
        k = int(task)
        if turn == 0:
            return call(f"x = {k}\nimport math")
        if turn == 1:
            return call("print(math.factorial(3) * 7 + x - x)" if k % 2 else "print(x * 2)")
        return f"The tool said {last.strip()}."

    built, _ = worker(tmp_path, ScriptedPolicy(script), stateful=True, codeenv_loop=codeenv_loop)
    [tool] = built.tools
    if codeenv_loop:
        from codeenv.integrations.verl_agent import CodeenvToolAgentLoop

        assert verl_agent_loop._agent_loop_registry["tool_agent"]["_target_"] == \
            f"{CodeenvToolAgentLoop.__module__}.{CodeenvToolAgentLoop.__qualname__}"
    before = await live_sessions()
    tasks = [str(k) for k in range(64)]
    output = await built.generate_sequences(batch(tasks, tasks))

    for k, seen in enumerate(tool_responses(built, output)):
        assert seen[-1].strip() == str(42 if k % 2 else 2 * k), (k, seen)  # x and math lasted
    assert all((ledger.calls, ledger.tool_errors) == (2, 0) for ledger in ledgers_from_batch(output))
    if codeenv_loop:  # its run() returned once the sessions were deleted
        assert tool.code.live_sessions == 0
    # Every trajectory's session is gone within 1 s of the step's end (verl's own loop: once each
    # trajectory's agent_data is freed).
    deadline = asyncio.get_running_loop().time() + 1.0
    while (await live_sessions()) != before or tool.code.live_sessions:
        assert asyncio.get_running_loop().time() < deadline, (await live_sessions(), before)
        await asyncio.sleep(0.05)
