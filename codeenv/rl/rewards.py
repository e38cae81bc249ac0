"""Code rewards from judge results (POST /v1/judge, client.judge).

A judge result is the program's doing (passed, failed, compile_error) or the service's
(internal_error, overloaded, rejected). A service fault says nothing about the rollout: it gets no
score (None) instead of a 0 that would teach the model a wrong lesson; drop it from the group or
judge it again.

Usage::

    result = await client.judge(code, tests)
    reward = code_reward(result)                          # pass rate, or None for a service fault
    reward = code_reward(result, all_or_nothing=True)     # 1.0 only if every test passed
"""

from __future__ import annotations

from codeenv.models import JudgeResult, JudgeStatus

#: Statuses that are the service's doing, not the program's.
SERVICE_FAULTS = frozenset({JudgeStatus.internal_error, JudgeStatus.overloaded, JudgeStatus.rejected})


def is_service_fault(result: JudgeResult) -> bool:
    """Whether the result says nothing about the program (the service failed to judge it)."""
    return result.status in SERVICE_FAULTS


def code_reward(result: JudgeResult, *, all_or_nothing: bool = False) -> float | None:
    """The fraction of tests passed (or 1.0/0.0 with `all_or_nothing`); None for a service fault."""
    if is_service_fault(result):
        return None
    if all_or_nothing:
        return 1.0 if result.status is JudgeStatus.passed else 0.0
    return result.passed / result.total if result.total else 0.0
