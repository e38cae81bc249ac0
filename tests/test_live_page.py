"""The live page at `/`, rendered by headless Chromium (Debian's package) against a real service that
ran a known number of calls; its data endpoint; its headers; a service with a token."""

from __future__ import annotations

import asyncio
import html
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from codeenv.api.metrics import LATENCY_BUCKETS, LIVE_BOUNDS
from codeenv.bench.services import Service
from codeenv.models import SESSION_KEY_HEADER
from tests.conftest import start_service
from tests.test_judge import ADD
from tests.test_problems import until_ready

pytestmark = [pytest.mark.jail, pytest.mark.slow]

TOKEN = "a-live-page-token-0123456789"


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("the live page's test needs Debian's chromium (scripts/test installs it)", pytrace=False)
    return found


def render(url: str, tmp_path: Path, screenshot: Path | None = None) -> str:
    """The page's DOM once its script has read /v1/live a few times (or a screenshot of it)."""
    what = [f"--screenshot={screenshot}", "--window-size=1100,1250"] if screenshot else ["--dump-dom"]
    done = subprocess.run([chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=6000", *what, url],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def text_of(dom: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}"[^>]*>(.*?)</', dom, re.DOTALL)
    assert found is not None, f"no #{element_id} in the page"
    return html.unescape(found.group(1)).strip()


def table(dom: str, element_id: str) -> list[list[str]]:
    body = re.search(rf'<table id="{element_id}">.*?<tbody>(.*?)</tbody>', dom, re.DOTALL)
    assert body is not None, f"no table #{element_id}"
    return [[html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", body.group(1), re.DOTALL)]


async def test_the_page_shows_the_calls_the_service_answered(served_service: Service, tmp_path: Path) -> None:
    service = served_service
    calls = [{"code": "print(1)", "step": 5}] * 7 + [{"code": "1 / 0", "step": 6}] * 2 + [
        {"code": "while True: pass", "limits": {"wall_s": 0.5, "cpu_s": 0.5}, "step": 6}]
    key = {SESSION_KEY_HEADER: "the-live-page-test's-key"}
    async with httpx.AsyncClient(base_url=service.url, timeout=60, headers=key) as http:
        answer = await http.post("/v1/execute/batch", json={"requests": calls})
        assert [r["status"] for r in answer.json()["results"]] == ["ok"] * 7 + ["error"] * 2 + ["timeout"]
        tests = [{"stdin": "1 2", "expected_stdout": "3"}, {"stdin": "2 2", "expected_stdout": "5"}]
        judged = await http.post("/v1/judge", json={"code": ADD, "tests": tests})
        assert judged.json()["status"] == "failed", judged.text
        made = await http.post("/v1/sessions", json={})
        assert made.status_code == 201, made.text
        cell = f"/v1/sessions/{made.json()['session_id']}/execute"
        assert (await http.post(cell, json={"code": "x = 1"})).json()["status"] == "ok"
        stopped = (await http.post(cell, json={"code": "while True: pass", "limits": {"cpu_s": 0.5}})).json()
        assert stopped["status"] == "timeout" and stopped["rolled_back"], stopped
        live = (await http.get("/v1/live")).json()
        page = await http.get("/")
    assert live["calls"] == {"ok": 9, "error": 2, "timeout": 2}  # the judged call's is ok: the program ran
    assert live["accepted"] == 13 and live["in_flight"] == 0
    run = live["latency"]["run"]
    assert live["le"] == LIVE_BOUNDS and run["total"] == 13 and run["count"][-1] <= 13 and len(run["count"]) == 29
    assert {api: h["run"]["total"] for api, h in live["by_api"].items()} == {"native": 10, "judge": 1, "session": 2}
    assert sum(h["end_to_end"]["total"] for h in live["by_profile"].values()) == 13
    assert live["judge"] == {"verdicts": {"failed": 1}, "tests": {"passed": 1, "wrong_answer": 1}}
    [worker] = live["workers"].values()
    assert (worker["up"], worker["slots"], worker["sessions_created"], worker["cells"], worker["rollbacks"]) == \
        (1, 2, 1, 2, 1)
    assert 0 < worker["memory_bytes"] < worker["memory_allowance_bytes"] and worker["memory_needed_bytes"] > 0
    assert worker["oom_kills"] == worker["seccomp_kills"] == worker["heartbeat_age_s"] == 0
    assert all(b / a <= 1.5 + 1e-9 for a, b in zip(LATENCY_BUCKETS, LATENCY_BUCKETS[1:], strict=False))
    assert [s["step"] for s in live["steps"]] == [6, 5] and live["steps"][0]["slowest"]["status"] == "timeout"
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "<script>" not in page.text and "http" not in re.sub(r'href="/[^"]*"', "", page.text).split("<footer>")[0]

    dom = await asyncio.to_thread(render, f"{service.url}/", tmp_path)
    assert text_of(dom, "calls-total") == "13"
    assert sorted(table(dom, "statuses")) == [["error", "2", "15.4%"], ["ok", "9", "69.2%"], ["timeout", "2", "15.4%"]]
    assert text_of(dom, "tool-error-ratio") == "0.308" and text_of(dom, "service-faults") == "0"
    assert text_of(dom, "judged-total") == "1" and text_of(dom, "tests-total") == "2"
    assert table(dom, "verdicts") == [["failed", "1", "100.0%"]]
    assert sorted(table(dom, "test-statuses")) == [["passed", "1", "50.0%"], ["wrong_answer", "1", "50.0%"]]
    [capacity] = table(dom, "capacity")
    assert capacity[1:3] == ["idle", "2 / 2"] and capacity[6:9] == ["0", "0", "0"], capacity
    [sessions] = table(dom, "workers")
    assert sessions[1] == "1" and sessions[5:8] == ["1", "0", "0"], sessions
    steps = table(dom, "steps")
    assert [row[:2] for row in steps] == [["6", "3"], ["5", "7"]] and "timeout" in steps[0][4]
    assert [row[0] for row in table(dom, "latency")] == ["queue wait", "run time", "service overhead", "end to end"]
    assert "print(1)" not in dom  # counts and statuses, never code or output


async def test_with_a_token_the_page_opens_and_asks_for_it(tmp_path: Path) -> None:
    served = start_service("serve", "--slots", "1", "--token", TOKEN, "--log-level", "warning",
                           log=tmp_path / "serve.log", PATH=os.environ.get("PATH", "/usr/bin"))
    try:
        await until_ready(served.url, TOKEN, 120)
        async with httpx.AsyncClient(base_url=served.url) as http:
            assert (await http.get("/")).status_code == 200  # the page holds no data
            assert (await http.get("/live.js")).status_code == 200
            assert (await http.get("/v1/live")).status_code == 401  # its data needs the token
            assert (await http.get("/v1/live", headers={"Authorization": f"Bearer {TOKEN}"})).status_code == 200
            assert (await http.get("/", headers={"Origin": "http://evil.example"})).status_code == 403
        dom = await asyncio.to_thread(render, f"{served.url}/", tmp_path)
        assert re.search(r'<form id="token-form"(?![^>]*hidden)', dom), "the page does not ask for the token"
        assert text_of(dom, "updated") == "this service needs its token"
    finally:
        await served.stop_async(60)
