"""GRPO-RoC and GRPO advantages on hand-built groups (no server needed)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from codeenv.models import ExecResult, Status
from codeenv.rl import (
    Rollout,
    ToolLedger,
    grpo_advantages,
    ledger_of,
    ledgers_from_batch,
    resample_on_correct,
    roc_indices,
)

pytestmark = pytest.mark.unit


def rollout(reward: float, ok: int = 0, failed: int = 0, faults: int = 0, fmt: float = 0.0) -> Rollout:
    ledger = ToolLedger()
    for status, count in ((Status.ok, ok), (Status.error, failed), (Status.overloaded, faults)):
        for _ in range(count):
            ledger.record(ExecResult(status=status, started=status != Status.overloaded, wall_s=0.01))
    return Rollout(reward=reward, ledger=ledger, format_penalty=fmt)


def test_the_ledger_counts_program_failures_not_service_faults() -> None:
    ledger = ToolLedger()
    for status in (Status.ok, Status.timeout, Status.memory, Status.overloaded, Status.internal_error, Status.ok):
        ledger.record(ExecResult(status=status))
    assert (ledger.calls, ledger.tool_errors, ledger.service_faults) == (6, 2, 2)
    assert ledger.tool_error_ratio == 0.5
    assert ToolLedger().tool_error_ratio is None


def test_proportions_kept_and_cleanest_positives_chosen() -> None:
    # 8 rollouts, 4 positive: keep 4 -> 2 positives, 2 negatives.
    group = [rollout(1, ok=4), rollout(1, ok=1, failed=3), rollout(1, ok=2, failed=2), rollout(1, ok=3, failed=1),
             rollout(0, ok=1), rollout(0, failed=2), rollout(0, ok=2), rollout(0)]
    keep = resample_on_correct(group, 4, rng=np.random.default_rng(0))
    assert keep is not None and len(keep) == 4
    assert [i for i in keep if group[i].reward > 0] == [0, 3]  # penalties 0 and 0.25
    assert len([i for i in keep if group[i].reward == 0]) == 2


def test_k_pos_rounds_and_the_minimum_knobs_apply() -> None:
    group = [rollout(1, ok=1)] + [rollout(0, ok=1) for _ in range(7)]  # 1 of 8 positive, keep 4
    keep = resample_on_correct(group, 4, rng=np.random.default_rng(1))
    assert keep is not None and sum(group[i].reward > 0 for i in keep) == 1  # round(0.5) = 1
    keep = resample_on_correct(group, 2, rng=np.random.default_rng(1))
    assert keep is not None and sum(group[i].reward > 0 for i in keep) == 0  # round(0.25) = 0
    keep = resample_on_correct(group, 2, rng=np.random.default_rng(1), min_positives=1)
    assert keep is not None and sum(group[i].reward > 0 for i in keep) == 1
    group = [rollout(1, ok=1) for _ in range(7)] + [rollout(0, ok=1)]
    keep = resample_on_correct(group, 4, rng=np.random.default_rng(1), min_negatives=1)
    assert keep is not None and sum(group[i].reward == 0 for i in keep) == 1


def test_negatives_are_sampled_uniformly() -> None:
    group = [rollout(1, ok=1) for _ in range(4)] + [rollout(0, failed=i) for i in range(1, 9)]
    rng = np.random.default_rng(42)
    seen: Counter[int] = Counter()
    for _ in range(4000):
        keep = resample_on_correct(group, 6, rng=rng)  # 2 positives, 4 of the 8 negatives
        assert keep is not None
        seen.update(i for i in keep if i >= 4)
    # Each negative is kept with probability 1/2, whatever its tool errors.
    for i in range(4, 12):
        assert abs(seen[i] / 4000 - 0.5) < 0.04, seen


def test_ties_among_positives_are_broken_by_the_generator() -> None:
    group = [rollout(1, ok=1) for _ in range(6)] + [rollout(0) for _ in range(6)]
    picks = Counter()
    rng = np.random.default_rng(7)
    for _ in range(600):
        keep = resample_on_correct(group, 6, rng=rng)
        assert keep is not None
        picks.update(i for i in keep if i < 6)
    assert min(picks.values()) > 200  # not always the first three in batch order
    again = [resample_on_correct(group, 6, rng=np.random.default_rng(3)) for _ in range(2)]
    assert again[0] == again[1]  # seeded: reproducible


def test_edge_cases() -> None:
    rng = np.random.default_rng(0)
    assert resample_on_correct([rollout(1, ok=1)] * 8, 4, rng=rng) is None  # all equal: dropped
    all_equal = resample_on_correct([rollout(0)] * 8, 4, rng=rng, drop_uniform=False)
    assert all_equal is not None and len(all_equal) == 4
    assert resample_on_correct([rollout(1), rollout(0)], 4, rng=rng) == [0, 1]  # fewer than G: all kept
    # No tool calls: the configurable penalty ranks them after clean tool users.
    group = [rollout(1), rollout(1, ok=2), rollout(1, ok=1, failed=1), rollout(0), rollout(0), rollout(0)]
    keep = resample_on_correct(group, 2, rng=rng, no_tool_penalty=0.7)
    assert keep is not None and [i for i in keep if group[i].reward > 0] == [1]
    keep = resample_on_correct(group, 2, rng=rng, no_tool_penalty=0.0)
    assert keep is not None and [i for i in keep if group[i].reward > 0] in ([0], [1])
    # Service faults are not held against the model, but flag the rollout.
    faulty = rollout(1, ok=1, faults=3)
    assert faulty.penalty() == 0.0 and faulty.service_faults == 3
    assert rollout(1, ok=1, fmt=0.5).penalty() == 0.5


def test_advantages_match_a_hand_computation() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    mean = 0.6
    std = ((3 * 0.4**2 + 2 * 0.6**2) / 4) ** 0.5  # unbiased
    expected = [(r - mean) / (std + 1e-6) for r in rewards]
    assert grpo_advantages(rewards) == pytest.approx(expected)
    assert grpo_advantages(rewards, normalize_std=False) == pytest.approx([r - mean for r in rewards])
    assert grpo_advantages([0.7]) == pytest.approx([0.7 / (1 + 1e-6)])
    assert grpo_advantages([1.0, 1.0]) == pytest.approx([0.0, 0.0])


def test_a_ledger_crosses_processes_as_plain_fields() -> None:
    ledger = rollout(1, ok=2, failed=1, faults=1).ledger
    fields = ledger.as_dict()
    assert fields == {"calls": 4, "tool_errors": 1, "service_faults": 1, "run_s": 0.04, "cpu_s": 0.0,
                      "statuses": {"ok": 2, "error": 1, "overloaded": 1}}
    assert ToolLedger.from_dict(fields) == ledger and ToolLedger.from_dict(None) == ToolLedger()
    for bad in ({"calls": -1}, {"calls": "3"}, {"calls": True}, {"run_s": float("nan")}, {"calls": 1, "tool_errors": 2},
                {"statuses": {"ok": -1}}, {"statuses": ["ok"]}):
        with pytest.raises(ValueError, match="tool ledger"):
            ToolLedger.from_dict(bad)
    with pytest.raises(ValueError, match="mapping"):
        ToolLedger.from_dict([1])  # type: ignore[arg-type]


def test_ledgers_come_from_each_of_verls_batch_shapes() -> None:
    fields = [{"extras": {"codeenv_tool": rollout(1, ok=1, failed=k).ledger.as_dict()}} for k in range(3)]
    fields.append({"extras": None, "turn_scores": []})  # a trajectory without a tool call
    want = [1, 2, 3, 0]
    extras = np.empty(4, dtype=object)
    extras[:] = [f["extras"] for f in fields]
    tool_extra_fields = np.array(fields, dtype=object)

    class Batch:  # what verl's DataProto is to the helper: a non_tensor_batch of object columns
        non_tensor_batch = {"extras": extras}

    for batch in (Batch(), {"extras": extras}, {"tool_extra_fields": tool_extra_fields}, fields):
        assert [ledger.calls for ledger in ledgers_from_batch(batch)] == want
    assert ledger_of({"extras": {"other": 1}}) == ToolLedger() and ledger_of(None) == ToolLedger()
    with pytest.raises(ValueError, match="extras"):
        ledgers_from_batch({"uid": np.array(["a"])})
    with pytest.raises(ValueError, match="not a batch"):
        ledgers_from_batch(3)


def test_roc_over_a_batch_keeps_each_prompts_cleanest_successes() -> None:
    # Two prompts' samples, interleaved as a trainer's batch may be; a third whose rewards are all equal.
    batch = [("a", rollout(1, ok=1)), ("b", rollout(0, failed=1)), ("a", rollout(1, ok=1, failed=1)),
             ("b", rollout(1, ok=1)), ("a", rollout(0, failed=2)), ("b", rollout(1, ok=2, failed=2)),
             ("c", rollout(1, ok=1)), ("c", rollout(1, ok=1))]
    uids = np.array([uid for uid, _ in batch], dtype=object)
    keep = roc_indices(uids, [r.reward for _, r in batch], [r.ledger for _, r in batch], 2,
                       rng=np.random.default_rng(0))
    assert keep == [0, 1, 3, 4]  # a: the clean success and the failure; b: likewise; c: dropped
    with pytest.raises(ValueError, match="length"):
        roc_indices(uids, [1.0], [], 2, rng=np.random.default_rng(0))
