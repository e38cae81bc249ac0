"""A real `codeenv serve` logs in one format per run (CODEENV_LOG_FORMAT=json or plain): codeenv's lines,
uvicorn's start-up lines and its access log (one line per request) alike, never a mix."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from codeenv import logs
from tests.conftest import start_service

PLAIN = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?:DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)$")


def parse(line: str, log_format: str) -> tuple[str, str]:
    """(logger, message) of one log line, which must be in `log_format`."""
    if log_format == "json":
        record = json.loads(line)
        assert isinstance(record, dict) and {"level", "logger", "message"} <= record.keys(), line
        return record["logger"], record["message"]
    match = PLAIN.match(line)
    assert match is not None, f"not a plain log line: {line!r}"
    return match[1], match[2]


LINES = """
import logging, warnings
from codeenv import logs
logs.setup(logs.parse({fmt!r}))
logging.getLogger("uvicorn.error").info("Started server process [%d]", 1, extra={{"color_message": "x"}})
logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/healthz", "1.1", 200)
logging.getLogger("codeenv.api").info("batch", extra={{"event": "batch", "calls": 2}})
warnings.warn("a warning")
"""


@pytest.mark.unit
@pytest.mark.parametrize("log_format", ["json", "plain", "text"])
def test_every_logger_writes_the_chosen_format(log_format: str) -> None:
    done = subprocess.run([sys.executable, "-c", LINES.format(fmt=log_format)], capture_output=True, text=True,
                          timeout=60, check=True)
    fmt = logs.parse(log_format)
    lines = done.stderr.splitlines()
    assert [parse(line, fmt)[0] for line in lines] == ["uvicorn.error", "uvicorn.access", "codeenv.api", "py.warnings"]
    if fmt == "json":
        access = json.loads(lines[1])
        assert (access["method"], access["path"], access["status"]) == ("GET", "/healthz", 200)
        assert "color_message" not in json.loads(lines[0])
        assert json.loads(lines[2])["calls"] == 2


@pytest.mark.unit
def test_an_unknown_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="CODEENV_LOG_FORMAT='xml': choose json or plain"):
        logs.parse("xml")


@pytest.mark.jail
@pytest.mark.parametrize(("log_format", "processes"), [
    ("json", 1), ("plain", 1), pytest.param("json", 2, marks=pytest.mark.slow)])
def test_one_log_format_per_run(tmp_path: Path, log_format: str, processes: int) -> None:
    log = tmp_path / "serve.log"
    service = start_service("serve", "--slots", "1", "--processes", str(processes), log=log,
                            CODEENV_LOG_FORMAT=log_format)
    try:
        service.wait_ready(120)
        answer = httpx.post(f"{service.url}/v1/execute/batch", json={"requests": [{"code": "print(1)"}] * 2},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        assert httpx.get(f"{service.url}/healthz", timeout=10).status_code == 200
    finally:
        service.stop()
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    parsed = [parse(line, log_format) for line in lines]  # every line, or the assertion names it
    loggers = {logger for logger, _ in parsed}
    assert {"uvicorn.error", "uvicorn.access", "codeenv.api", "codeenv.sandbox.pool"} <= loggers, loggers
    access = [message for logger, message in parsed if logger == "uvicorn.access"]
    assert sum('"POST /v1/execute/batch HTTP/1.1" 200' in m for m in access) == 1, access
    assert sum('"GET /healthz HTTP/1.1" 200' in m for m in access) == 1, access
    if log_format == "json":
        request = next(json.loads(line) for line in lines if '"/v1/execute/batch"' in line)
        assert (request["method"], request["path"], request["status"]) == ("POST", "/v1/execute/batch", 200)
