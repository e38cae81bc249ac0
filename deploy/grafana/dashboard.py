"""Writes codeenv.json, the Grafana dashboard: the live page's panels over Prometheus.

    python deploy/grafana/dashboard.py      # after changing a panel; tests/test_monitoring.py checks
                                            # that codeenv.json is what this writes, and queries every
                                            # panel's expression in a real Prometheus

Import codeenv.json in Grafana (Dashboards > New > Import) and pick the Prometheus data source that
scrapes the gateways; docker-compose.yml's `monitoring` profile provisions it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
FAULTS = "overloaded|internal_error|rejected|session_lost"
FAILURES = "error|timeout|memory|output_limit|killed"
LATENCIES = (("codeenv_queue_seconds", "Queue wait"), ("codeenv_run_seconds", "Run time"),
             ("codeenv_overhead_seconds", "Service overhead"), ("codeenv_end_to_end_seconds", "End to end"))


def quantiles(metric: str, by: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket[1m])))", f"{{{{{by}}}}} p{int(q * 100)}")
            for q in (0.5, 0.99)]


def per_worker(metric: str, legend: str = "{{worker}}", rate: bool = False) -> tuple[str, str]:
    inner = f"rate({metric}[1m])" if rate else metric
    return f"max by (worker) ({inner})", legend


#: Rows of panels: (row title, [(panel title, unit, [(expression, legend)], description)]).
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], str]]]] = [
    ("Is the sandbox the bottleneck?", [
        ("Calls/s in and done", "reqps", [("sum(rate(codeenv_calls_accepted_total[1m]))", "in"),
                                          ("sum(rate(codeenv_calls_total[1m]))", "done")], ""),
        ("Queue wait p99 against run time p99", "s", [
            ("histogram_quantile(0.99, sum by (le) (rate(codeenv_queue_seconds_bucket[1m])))", "queue wait p99"),
            ("histogram_quantile(0.99, sum by (le) (rate(codeenv_run_seconds_bucket[1m])))", "run time p99")],
         "The sandbox is the bottleneck when calls wait longer for a slot than they run."),
        ("In flight and waiting", "short", [("sum(codeenv_in_flight_calls)", "in flight"),
                                            ("max(codeenv_waiting)", "waiting for a slot")], ""),
        ("Oldest wait", "s", [("max(codeenv_oldest_wait_s)", "oldest wait")], ""),
        ("Free slots by worker", "short", [per_worker("codeenv_worker_free_slots", "{{worker}} free"),
                                           per_worker("codeenv_worker_slots", "{{worker}} total")], ""),
        ("Event-loop lag", "s", [("max(codeenv_event_loop_lag_seconds)", "lag")], ""),
    ]),
    ("Latency by API", [(f"{title} by API", "s", quantiles(metric, "api"), "") for metric, title in LATENCIES]),
    ("Latency by profile", [(f"{title} by profile", "s", quantiles(metric, "profile"), "")
                            for metric, title in LATENCIES]),
    ("Outcomes", [
        ("Calls/s by status", "reqps", [("sum by (status) (rate(codeenv_calls_total[1m]))", "{{status}}")], ""),
        ("Service faults/s", "reqps", [(f'sum by (status) (rate(codeenv_calls_total{{status=~"{FAULTS}"}}[1m]))',
                                        "{{status}}")], "The service's doing: not the program's."),
        ("Tool-error ratio", "percentunit", [
            (f'sum(rate(codeenv_calls_total{{status=~"{FAILURES}"}}[5m])) / '
             f'sum(rate(codeenv_calls_total{{status!~"{FAULTS}"}}[5m]))', "tool errors")],
         "What GRPO-RoC filters on: the program's failures among calls the service ran."),
        ("Judge verdicts/s", "reqps", [("sum by (verdict) (rate(codeenv_judge_submissions_total[1m]))",
                                        "{{verdict}}")], ""),
        ("Judged tests/s", "reqps", [("sum by (status) (rate(codeenv_judge_tests_total[1m]))", "{{status}}")], ""),
    ]),
    ("Sessions", [
        ("Live sessions", "short", [per_worker("codeenv_worker_sessions")], ""),
        ("Sessions created/s", "reqps", [per_worker("codeenv_worker_sessions_created", rate=True)], ""),
        ("Cells/s", "reqps", [per_worker("codeenv_worker_cells", rate=True)], ""),
        ("Rollbacks/s", "reqps", [per_worker("codeenv_worker_rollbacks", rate=True)], ""),
        ("Sessions lost and evicted", "short", [per_worker("codeenv_worker_sessions_lost", "{{worker}} lost"),
                                                per_worker("codeenv_worker_sessions_evicted", "{{worker}} evicted")],
         "Since each worker started."),
        ("Session memory", "bytes", [per_worker("codeenv_worker_session_memory_bytes")], ""),
    ]),
    ("Capacity and safety", [
        ("Memory used, allowed and the sizing rule's worst case", "bytes", [
            per_worker("codeenv_worker_memory_bytes", "{{worker}} used"),
            per_worker("codeenv_worker_memory_allowance_bytes", "{{worker}} allowed"),
            per_worker("codeenv_worker_memory_needed_bytes", "{{worker}} worst case")], ""),
        ("Memory headroom", "percentunit", [
            ("max by (worker) (1 - codeenv_worker_memory_bytes / codeenv_worker_memory_allowance_bytes)",
             "{{worker}}")], "Below 10% for 5 minutes: the CodeenvMemoryHeadroomLow alert."),
        ("OOM and seccomp kills/s", "reqps", [
            per_worker("codeenv_worker_oom_kills", "{{worker}} OOM", rate=True),
            per_worker("codeenv_worker_seccomp_kills", "{{worker}} seccomp", rate=True)],
         "Calls and cells the kernel's OOM killer or the seccomp filter ended."),
        ("Jail recycles/s", "reqps", [per_worker("codeenv_worker_slot_restarts", rate=True)], ""),
        ("Heartbeat age", "s", [per_worker("codeenv_worker_heartbeat_age_seconds")], ""),
        ("Workers up", "short", [per_worker("codeenv_worker_up"), ("max(codeenv_workers)", "live workers")],
         "1: the worker can run calls; 0: no zygote alive."),
    ]),
]


def dashboard() -> dict[str, Any]:
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels: list[dict[str, Any]] = []
    y = 0
    ident = 1
    for row, items in ROWS:
        panels.append({"type": "row", "title": row, "id": ident, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        ident, y = ident + 1, y + 1
        for n, (title, unit, targets, description) in enumerate(items):
            panels.append({
                "type": "timeseries", "title": title, "id": ident, "datasource": source,
                "description": description,
                "gridPos": {"h": 8, "w": 8, "x": 8 * (n % 3), "y": y + 8 * (n // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "none"}},
                "targets": [{"refId": chr(ord("A") + i), "datasource": source, "expr": expr, "legendFormat": legend}
                            for i, (expr, legend) in enumerate(targets)]})
            ident += 1
        y += 8 * ((len(items) + 2) // 3)
    panels.append({"type": "text", "title": "Training steps", "id": ident,
                   "gridPos": {"h": 3, "w": 24, "x": 0, "y": y},
                   "options": {"mode": "markdown", "content": (
                       "Per-step figures (calls, statuses, the slowest call) are not Prometheus labels (one per step "
                       "would grow without end): each gateway keeps the last 64 steps at `GET /v1/steps`, and its "
                       "live page at `/` shows them.")}})
    return {
        "title": "codeenv", "uid": "codeenv", "tags": ["codeenv"], "timezone": "browser", "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "5s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []}, "panels": panels,
    }


def expressions() -> list[str]:
    """Every panel's PromQL expression."""
    return [expr for _, items in ROWS for _, _, targets, _ in items for expr, _ in targets]


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    (HERE / "codeenv.json").write_text(render())
