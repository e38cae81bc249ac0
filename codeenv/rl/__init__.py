"""RL helpers fed by codeenv's structured results: GRPO-RoC down-sampling, GRPO advantages, code rewards.

Pure Python and numpy: no torch, no server. See ``roc.py`` for the algorithm and its knobs.

Usage::

    from codeenv.rl import Rollout, ToolLedger, resample_on_correct, grpo_advantages

    ledger = ToolLedger()
    result = await client.run(code, ledger=ledger)       # the client fills it while a rollout runs
    rollout = Rollout(reward=1.0, ledger=ledger)
    keep = resample_on_correct(group_of_2G, G, rng=np.random.default_rng(step))
    advantages = grpo_advantages([group_of_2G[i].reward for i in keep])
"""

from codeenv.rl.rewards import code_reward, is_service_fault
from codeenv.rl.roc import (
    LEDGER_FIELD,
    Rollout,
    ToolLedger,
    grpo_advantages,
    ledger_of,
    ledgers_from_batch,
    resample_on_correct,
    roc_indices,
)

__all__ = ["LEDGER_FIELD", "Rollout", "ToolLedger", "code_reward", "grpo_advantages", "is_service_fault",
           "ledger_of", "ledgers_from_batch", "resample_on_correct", "roc_indices"]
