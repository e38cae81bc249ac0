"""Workloads: the programs a bench sends, read from JSONL files, and the outputs they should give.

A workload file holds one call per line: ``{"code": ..., "stdin": "", "timeout": 3.0, "tag": "sympy"}``
(only ``code`` is required). A shipped workload is named without a path (``math``, ``print``,
``sympy``, ``code``); its expected outputs, where it has them, lie beside it as
``NAME.expect.jsonl``, one line per call: ``{"status": "ok" | "error" | "timeout", "stdout": ...}``.

A code workload's call is a submission with its tests: ``{"code": ..., "tests": [{"stdin": ...,
"expected_stdout": ...}, ...], "timeout": 1.0}`` (``timeout``: CPU seconds per test). It is judged
in one call (``--api judge``) or one request per test (every other API, the outputs compared by the
bench, as verl's and SkyRL's reward functions do); either way its outcome is ``ok`` with the stdout
``PASSED/TOTAL``. A call with ``"language": "cpp"`` is C++ (every API but the physical limit's runs it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from codeenv.errors import WorkloadError

SHIPPED = Path(__file__).parent / "workloads"

#: How a call ended, the same for every API: what a correctness check compares.
OUTCOMES = ("ok", "error", "timeout", "memory", "output_limit", "killed", "rejected", "overloaded",
            "internal_error", "http_error")


@dataclass(frozen=True, slots=True)
class Test:
    stdin: str
    expected_stdout: str


@dataclass(frozen=True, slots=True)
class Call:
    code: str
    stdin: str = ""
    timeout: float | None = None
    tag: str = ""
    tests: tuple[Test, ...] | None = None  # a code workload's submission
    language: str = "python"  # or "cpp"


@dataclass(frozen=True, slots=True)
class Expected:
    status: str
    stdout: str | None = None  # not compared for calls that end in a timeout

    def matches(self, status: str, stdout: str) -> bool:
        if status != self.status:
            return False
        return self.status == "timeout" or self.stdout is None or stdout.strip() == self.stdout.strip()


def workload_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.exists():
        return path
    shipped = SHIPPED / f"{name_or_path}.jsonl"
    if "/" not in name_or_path and shipped.exists():
        return shipped
    names = ", ".join(sorted(p.name.removesuffix(".jsonl") for p in SHIPPED.glob("*.jsonl") if ".expect" not in p.name))
    raise WorkloadError(f"no workload file {name_or_path!r} (shipped workloads: {names})")


def _lines(path: Path) -> list[dict[str, object]]:
    items = _lines_any(path)
    for number, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise WorkloadError(f"{path}: call {number}: expected a JSON object")
    if not items:
        raise WorkloadError(f"{path} holds no calls")
    return items  # type: ignore[return-value]


def load_workload(name_or_path: str) -> list[Call]:
    path = workload_path(name_or_path)
    calls = []
    for number, item in enumerate(_lines(path), 1):
        code, stdin, timeout, tag = item.get("code"), item.get("stdin", ""), item.get("timeout"), item.get("tag", "")
        if not isinstance(code, str) or not isinstance(stdin, str) or not isinstance(tag, str):
            raise WorkloadError(f"{path}: call {number}: 'code' (and 'stdin', 'tag' if given) must be strings")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise WorkloadError(f"{path}: call {number}: 'timeout' must be a positive number of seconds")
        language = item.get("language", "python")
        if language not in ("python", "cpp"):
            raise WorkloadError(f"{path}: call {number}: 'language' must be python or cpp")
        calls.append(Call(code, stdin, float(timeout) if timeout is not None else None, tag,
                          _tests(item.get("tests"), path, number), str(language)))
    return calls


def _tests(raw: object, path: Path, number: int) -> tuple[Test, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw or not all(
            isinstance(t, dict) and isinstance(t.get("stdin", ""), str) and isinstance(t.get("expected_stdout"), str)
            for t in raw):
        raise WorkloadError(f"{path}: call {number}: 'tests' must be a non-empty list of "
                            '{"stdin": str, "expected_stdout": str}')
    return tuple(Test(t.get("stdin", ""), t["expected_stdout"]) for t in raw)


def expect_path_for(name_or_path: str) -> Path | None:
    """The expectations shipped beside a workload, if any."""
    path = workload_path(name_or_path)
    candidate = path.with_name(path.name.removesuffix(".jsonl") + ".expect.jsonl")
    return candidate if candidate.exists() else None


def load_expected(path: Path, calls: int) -> list[Expected]:
    """One expectation per call: a JSON object per line, or a bare JSON string (the stdout of an ok call)."""
    out = []
    for number, item in enumerate(_lines_any(path), 1):
        if isinstance(item, str):
            out.append(Expected("ok", item))
        elif isinstance(item, dict) and isinstance(item.get("status", "ok"), str):
            status, stdout = item.get("status", "ok"), item.get("stdout")
            if status not in OUTCOMES or (stdout is not None and not isinstance(stdout, str)):
                raise WorkloadError(f"{path}: line {number}: 'status' must be one of {', '.join(OUTCOMES)} "
                                    "and 'stdout' a string")
            out.append(Expected(str(status), stdout))
        else:
            raise WorkloadError(f"{path}: line {number}: expected a JSON string or object")
    if len(out) != calls:
        raise WorkloadError(f"{path} holds {len(out)} expectations for a workload of {calls} calls")
    return out


def _lines_any(path: Path) -> list[object]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read {path}: {exc}") from exc
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}: not JSON lines ({exc})") from exc
