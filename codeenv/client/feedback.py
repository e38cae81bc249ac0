"""Turn a result into the text a model sees as its tool's answer.

Usage::

    text = format_feedback(result)                          # readable default
    text = format_feedback(result, style="rstar2")           # rStar2-Agent's "Tool call success" format
    text = format_feedback(result, formatter=my_function)    # your own, still truncated and neutralised

Tool output is untrusted text that lands inside a chat template: by default, chat-template tokens
(``<|im_end|>``), and the tags trajectories are parsed by (``</tool_response>``, ``<answer>``, ...)
are neutralised, so a program cannot close the tool response early or forge an answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Literal

from codeenv.models import ExecResult, Status

#: Tags whose opening or closing form is neutralised in tool output.
DEFAULT_TAGS = ("tool_response", "tool_call", "tool_result", "answer", "think", "result", "code", "interpreter",
                "output", "python", "im_start", "im_end", "search", "information")
#: Chat-template special tokens like <|im_end|>, <|eot_id|>, <|endoftext|>.
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_\-]{1,40}\|>")


def code_judge_reason(status: Status) -> str:
    """code-judge's `reason` for one of our verdicts ("" for a run that ended, however it ended): the
    vocabulary rStar2-Agent's tool reads, shared by this feedback and the code-judge endpoints."""
    return {Status.timeout: "worker_timeout", Status.overloaded: "queue_timeout",
            Status.internal_error: "internal_error", Status.rejected: "invalid_input"}.get(status, "")


def neutralize(text: str, tags: Iterable[str] = DEFAULT_TAGS) -> str:
    """Replace the angle brackets of special tokens and of the given tags with look-alikes
    (＜ ＞), so the text reads the same to the model but can no longer match a template."""
    text = _SPECIAL.sub(lambda m: "＜" + m.group(0)[1:-1] + "＞", text)
    names = "|".join(re.escape(t) for t in tags)
    if names:
        text = re.sub(rf"<(/?\s*(?:{names})\b[^<>]{{0,200}})>", r"＜\1＞", text, flags=re.IGNORECASE)
    return text


def truncate_middle(text: str, budget: int, head_share: float = 0.6) -> str:
    """Keep the head and the tail of `text` within `budget` characters, saying what was cut."""
    if len(text) <= budget:
        return text
    marker = "\n... [{} characters omitted] ...\n"
    room = max(0, budget - len(marker.format(len(text))))
    head = int(room * head_share)
    tail = room - head
    cut = len(text) - head - tail
    return text[:head] + marker.format(cut) + (text[-tail:] if tail else "")


def _default(result: ExecResult) -> str:
    parts: list[str] = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    status = result.status
    if status == Status.ok:
        if result.stderr:
            parts.append("stderr:\n" + result.stderr.rstrip("\n"))
        if not parts:
            parts.append("(no output)")
    elif status == Status.error:
        if result.error is not None:
            where = f" (line {result.error.line})" if result.error.line else ""
            tail = result.stderr.rstrip("\n").splitlines()[-6:] if result.stderr else []
            parts.append("\n".join(tail) if tail else f"{result.error.type}: {result.error.message}{where}")
        else:
            if result.stderr:
                parts.append(result.stderr.rstrip("\n"))
            parts.append(f"(exit code {result.exit_code})")
    elif status == Status.timeout:
        parts.append(f"Timed out: the program ran past its time limit ({result.wall_s:.1f}s) and was stopped.")
    elif status == Status.memory:
        parts.append("Memory limit exceeded: the program was stopped.")
    elif status == Status.output_limit:
        parts.append("Output limit exceeded: the program printed too much and was stopped.")
    elif status == Status.killed:
        parts.append(f"The program was killed by signal {result.signal}.")
    else:
        parts.append(f"[the tool could not run this call: {status.value}"
                     + (f": {result.message}" if result.message else "") + "]")
    return "\n".join(parts)


def _rstar2(result: ExecResult) -> str:
    """rStar2-Agent's tool text: success when the run exited 0, failure with code-judge's reason."""
    ok = result.status == Status.ok and result.exit_code == 0
    parts = ["Tool call success"] if ok else ["Tool call failure", f"reason: {code_judge_reason(result.status)}"]
    if result.stdout:
        parts.append(f"stdout: {result.stdout}")
    if result.stderr:
        parts.append(f"stderr: {result.stderr}")
    parts.append(f"execution time: {result.wall_s:.2f}s")
    return "\n".join(parts)


STYLES: dict[str, Callable[[ExecResult], str]] = {"default": _default, "rstar2": _rstar2}


def format_feedback(result: ExecResult, *, style: Literal["default", "rstar2"] = "default",
                    formatter: Callable[[ExecResult], str] | None = None, max_chars: int = 4096,
                    neutralize_tags: Iterable[str] | None = DEFAULT_TAGS) -> str:
    """The text a model sees for `result`: formatted, cut to `max_chars` (head and tail kept),
    and neutralised unless `neutralize_tags` is None."""
    text = (formatter or STYLES[style])(result)
    if neutralize_tags is not None:
        text = neutralize(text, neutralize_tags)
    return truncate_middle(text, max_chars)
