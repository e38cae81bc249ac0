"""GRPO-RoC (Resample-on-Correct), as the rStar2-Agent report describes it, and GRPO advantages.

From an oversampled group (say 2G rollouts of one prompt) RoC keeps G: it keeps the group's
proportion of positive (correct) and negative rollouts; among positives it prefers those with the
lowest penalty (the share of their tool calls that failed, plus a format penalty), so the model
learns from clean successes; negatives are sampled uniformly, so it keeps seeing every way to fail.

Here a tool call's verdict comes from codeenv's structured status, not from searching the model's
text for "error": an error, timeout, memory, output-limit or kill verdict is a tool error; a
verdict that is the service's fault (overloaded, internal_error, rejected) is not held against the
model: it leaves the ratio and flags the rollout (`Rollout.service_faults`), so the trainer can
drop or redo it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from codeenv.models import PROGRAM_FAILURES, SERVICE_FAULTS, ExecResult


@dataclass
class ToolLedger:
    """One trajectory's tool calls, filled while it runs (pass it as `ledger=` to the client)."""

    calls: int = 0
    tool_errors: int = 0
    service_faults: int = 0
    run_s: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0

    def record(self, result: ExecResult) -> None:
        self.calls += 1
        self.statuses[result.status.value] = self.statuses.get(result.status.value, 0) + 1
        self.run_s += result.wall_s
        self.cpu_s += result.cpu_s
        if result.status in SERVICE_FAULTS:
            self.service_faults += 1
        elif result.status in PROGRAM_FAILURES:
            self.tool_errors += 1

    @property
    def tool_error_ratio(self) -> float | None:
        """Failed calls over the calls the model is answerable for; None without any such call."""
        answerable = self.calls - self.service_faults
        return self.tool_errors / answerable if answerable > 0 else None

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers and strings, for a batch column that crosses processes (verl's extra fields)."""
        return {"calls": self.calls, "tool_errors": self.tool_errors, "service_faults": self.service_faults,
                "run_s": round(self.run_s, 6), "cpu_s": round(self.cpu_s, 6), "statuses": dict(self.statuses)}

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any] | None) -> ToolLedger:
        """The ledger `as_dict()` wrote (None or {}: a trajectory without a tool call). A field that is
        not a count of the right type is a ValueError: a batch that carries something else under the
        ledger's key must not be read as a clean record."""
        if not fields:
            return cls()
        if not isinstance(fields, Mapping):
            raise ValueError(f"a tool ledger is a mapping, not {type(fields).__name__}")

        def count(name: str) -> int:
            value = fields.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise ValueError(f"a tool ledger's {name} must be a count, not {value!r}")
            return int(value)

        def seconds(name: str) -> float:
            value = fields.get(name, 0.0)
            if isinstance(value, bool) or not isinstance(value, int | float | np.number) or not value >= 0:
                raise ValueError(f"a tool ledger's {name} must be seconds, not {value!r}")
            return float(value)

        statuses = fields.get("statuses") or {}
        if not isinstance(statuses, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in statuses.items()):
            raise ValueError(f"a tool ledger's statuses must map statuses to counts, not {statuses!r}")
        ledger = cls(calls=count("calls"), tool_errors=count("tool_errors"), service_faults=count("service_faults"),
                     run_s=seconds("run_s"), statuses=dict(statuses), cpu_s=seconds("cpu_s"))
        if ledger.tool_errors + ledger.service_faults > ledger.calls:
            raise ValueError(f"a tool ledger with more failed calls than calls: {dict(fields)!r}")
        return ledger


@dataclass
class Rollout:
    """What RoC needs of one rollout: its reward and its tool-call record."""

    reward: float
    ledger: ToolLedger = field(default_factory=ToolLedger)
    format_penalty: float = 0.0
    data: Any = None  # anything the trainer wants to carry along

    @property
    def service_faults(self) -> int:
        return self.ledger.service_faults

    def penalty(self, no_tool_penalty: float = 0.5) -> float:
        """Tool-error ratio (or `no_tool_penalty` for a rollout without any answerable tool call)
        plus the format penalty."""
        ratio = self.ledger.tool_error_ratio
        return (no_tool_penalty if ratio is None else ratio) + self.format_penalty


def resample_on_correct(group: Sequence[Rollout], size: int, *, rng: np.random.Generator,
                        is_positive: Callable[[Rollout], bool] = lambda r: r.reward > 0,
                        no_tool_penalty: float = 0.5, drop_uniform: bool = True,
                        min_positives: int = 0, min_negatives: int = 0) -> list[int] | None:
    """Indices (into `group`) of the `size` rollouts to train on, or None to drop the group.

    - Groups whose rewards are all equal carry no GRPO signal: None when `drop_uniform`.
    - A group of `size` or fewer rollouts is kept whole.
    - k_pos = round(n_pos * size / n), k_neg = size - k_pos; then at least `min_positives`
      positives and `min_negatives` negatives where the group has them, and never more of a kind
      than it has (the other kind fills the rest).
    - Positives: lowest penalty first; ties broken by `rng`, never by order in the batch.
    - Negatives: uniformly at random (by `rng`).
    """
    n = len(group)
    if size <= 0:
        raise ValueError("size must be positive")
    if drop_uniform and n > 0 and len({r.reward for r in group}) == 1:
        return None
    if n <= size:
        return list(range(n))
    positives = [i for i, r in enumerate(group) if is_positive(r)]
    negatives = [i for i, r in enumerate(group) if not is_positive(r)]
    k_pos = int(np.floor(len(positives) * size / n + 0.5))  # round half up, not to even
    k_pos = max(k_pos, min(min_positives, len(positives), size))
    k_pos = min(k_pos, size - min(min_negatives, len(negatives), size))
    k_pos = min(max(k_pos, size - len(negatives)), len(positives))
    k_neg = size - k_pos
    # Positives by penalty, ties in a random order: shuffle, then a stable sort.
    shuffled = [positives[i] for i in rng.permutation(len(positives))]
    by_penalty = sorted(shuffled, key=lambda i: group[i].penalty(no_tool_penalty))
    chosen_neg = [negatives[i] for i in rng.choice(len(negatives), size=k_neg, replace=False)] if k_neg else []
    return sorted(by_penalty[:k_pos] + chosen_neg)


def grpo_advantages(rewards: Sequence[float], *, normalize_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    """Group-normalised advantages: (r - mean) / (std + eps), with the unbiased std (ddof=1);
    without `normalize_std`, just r - mean. A group of one has mean 0 and std 1, as verl has it."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return r
    if r.size == 1:
        mean, std = 0.0, 1.0
    else:
        mean, std = float(r.mean()), float(r.std(ddof=1))
    return (r - mean) / (std + eps) if normalize_std else r - mean


#: Where a trajectory's ledger is in verl's extra fields: `extra_fields["extras"]["codeenv_tool"]`
#: (`extras` is one of the fields verl gives every trajectory, so the batch's column is the same in
#: every rollout worker's part). `codeenv.integrations.verl.CodeenvTool` writes it.
LEDGER_FIELD = "codeenv_tool"


def ledger_of(extra_fields: Mapping[str, Any] | None) -> ToolLedger:
    """A trajectory's ToolLedger from its extra fields: verl's `agent_data.extra_fields`, an entry of a
    reward worker's `tool_extra_fields`, or the `extra_info` a reward function gets. Empty where the
    trajectory made no tool call."""
    extras = (extra_fields or {}).get("extras")
    return ToolLedger.from_dict(extras.get(LEDGER_FIELD) if isinstance(extras, Mapping) else None)


def ledgers_from_batch(batch: Any) -> list[ToolLedger]:
    """Each trajectory's ToolLedger, in the batch's order. `batch`: a verl `DataProto` or its
    `non_tensor_batch` (the trainer's rollout batch, whose `extras` column holds them; or a reward
    worker's, with `tool_extra_fields`), or a sequence of per-trajectory extra-field dicts."""
    columns = getattr(batch, "non_tensor_batch", batch)
    if isinstance(columns, Mapping):
        if "extras" in columns:
            return [ledger_of({"extras": extras}) for extras in columns["extras"]]
        if "tool_extra_fields" in columns:
            return [ledger_of(fields) for fields in columns["tool_extra_fields"]]
        raise ValueError("the batch has neither an 'extras' nor a 'tool_extra_fields' column: is it verl's "
                         "rollout batch (0.8 or later)?")
    if isinstance(columns, Iterable) and not isinstance(columns, str | bytes):
        return [ledger_of(fields) for fields in columns]
    raise ValueError(f"not a batch: {type(batch).__name__}")


def roc_indices(groups: Sequence[Any], rewards: Sequence[float], ledgers: Sequence[ToolLedger], size: int, *,
                rng: np.random.Generator, **knobs: Any) -> list[int]:
    """GRPO-RoC over a whole batch: the indices (into the batch, in its order) to train on. `groups`
    gives each trajectory's prompt (verl's `non_tensor_batch["uid"]`); each group of trajectories
    is down-sampled to `size` by `resample_on_correct` (its `knobs`), a dropped group gives none."""
    if not len(groups) == len(rewards) == len(ledgers):
        raise ValueError(f"groups, rewards and ledgers differ in length ({len(groups)}, {len(rewards)}, "
                         f"{len(ledgers)})")
    members: dict[Any, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    keep: list[int] = []
    for indices in members.values():
        chosen = resample_on_correct([Rollout(reward=float(rewards[i]), ledger=ledgers[i]) for i in indices], size,
                                     rng=rng, **knobs)
        keep.extend(indices[j] for j in chosen or ())
    return sorted(keep)
