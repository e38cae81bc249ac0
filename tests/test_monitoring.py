"""deploy/prometheus and deploy/grafana against a real service: a real Prometheus (Debian's, unpacked
by scripts/test) scrapes a service that ran calls of every kind, loads the alert rules and evaluates
them without error, and answers every dashboard panel's expression; every metric they name is one
/metrics really exports. (promtool's syntax check and the rules' unit tests: deploy/ci/check-monitoring.sh.)"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import shutil
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml

from codeenv.bench.services import Service, free_port
from codeenv.models import SESSION_KEY_HEADER
from tests.test_judge import ADD

pytestmark = [pytest.mark.jail, pytest.mark.slow]

DEPLOY = Path(__file__).parent.parent / "deploy"
METRIC = re.compile(r"\bcodeenv_[a-z_]+\b")


def dashboard() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboard", DEPLOY / "grafana" / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rule_expressions() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


async def calls_of_every_kind(url: str) -> None:
    """Calls (ok, error, timeout, a refused one), a judged submission and a session's cells."""
    key = {SESSION_KEY_HEADER: "the-monitoring-test-key"}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=key) as http:
        batch = [{"code": "print(1)"}, {"code": "1 / 0"}, {"code": "while True: pass", "limits": {"cpu_s": 0.3}},
                 {"code": "print(2)", "profile": "no-such-profile"}]
        answer = await http.post("/v1/execute/batch", json={"requests": batch})
        assert answer.status_code == 200, answer.text
        assert [r["status"] for r in answer.json()["results"]] == ["ok", "error", "timeout", "rejected"]
        tests = [{"stdin": "1 2", "expected_stdout": "3"}]
        assert (await http.post("/v1/judge", json={"code": ADD, "tests": tests})).json()["status"] == "passed"
        made = await http.post("/v1/sessions", json={})
        assert made.status_code == 201, made.text
        cell = f"/v1/sessions/{made.json()['session_id']}/execute"
        assert (await http.post(cell, json={"code": "x = 1"})).json()["status"] == "ok"


async def query(prometheus: httpx.AsyncClient, expr: str) -> list[dict[str, Any]]:
    answer = (await prometheus.get("/api/v1/query", params={"query": expr})).json()
    assert answer["status"] == "success", (expr, answer)
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


async def test_prometheus_evaluates_the_rules_and_the_dashboard_against_a_real_service(
        served_service: Service, tmp_path: Path) -> None:
    service = served_service
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("this test needs Prometheus's binary (scripts/test unpacks Debian's)", pytrace=False)
    await calls_of_every_kind(service.url)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
        "scrape_configs": [{"job_name": "codeenv", "static_configs": [
            {"targets": [service.url.removeprefix("http://")]}]}]}))
    port = free_port()
    prometheus = Service("prometheus", [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                         port=port, url=f"http://127.0.0.1:{port}", log=tmp_path / "prometheus.log").start()
    try:
        async with httpx.AsyncClient(base_url=prometheus.url, timeout=10) as http:
            deadline = time.monotonic() + 60
            while True:  # three scrapes (rate() needs two) and every rule evaluated
                try:
                    ready = (await http.get("/-/ready")).status_code == 200
                except httpx.TransportError:
                    ready = False
                scrapes = await query(http, "count_over_time(up[1m])") if ready else []
                groups = (await http.get("/api/v1/rules")).json()["data"]["groups"] if ready else []
                rules = [rule for group in groups for rule in group["rules"]]
                if scrapes and float(scrapes[0]["value"][1]) >= 3 and rules and all(
                        not r["lastEvaluation"].startswith("0001") for r in rules):
                    break
                assert time.monotonic() < deadline, prometheus.log_tail()
                await asyncio.sleep(0.5)
            assert (await query(http, "up"))[0]["value"][1] == "1"

            # The rules load and evaluate without error; none fires on a healthy service.
            assert len(rules) == len(rule_expressions()) == 7
            assert [(r["name"], r["health"], r.get("lastError", "")) for r in rules if r["health"] != "ok"] == []
            assert [r["name"] for r in rules if r["state"] != "inactive"] == []

            # Every metric the rules and the dashboard name is exported.
            module = dashboard()
            named = {m for expr in [*rule_expressions(), *module.expressions()] for m in METRIC.findall(expr)}
            missing = [name for name in sorted(named) if not await query(http, f'count({{__name__="{name}"}})')]
            assert missing == [], f"named but not exported by /metrics: {missing}"
            assert len(named) >= 30

            # Every panel's expression answers, with a series (the calls above made each one).
            empty = [expr for expr in module.expressions() if not await query(http, expr)]
            assert empty == [], f"panels with no data: {empty}"
    finally:
        prometheus.stop(10)
