"""`codeenv bench`: the real CLI against a real codeenv (all three APIs), the baselines, bad targets,
and the shipped workload's composition and outputs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from codeenv import SlotPool
from codeenv.bench.limit import measure_limit
from codeenv.bench.report import RunningThroughput, ratios, summarize, throughput_series
from codeenv.bench.runner import Record, RoundResult
from codeenv.bench.services import ServiceError, free_port, start_codeenv
from codeenv.bench.traffic import Scenario, Think, plan, split
from codeenv.bench.workload import SHIPPED, Expected, WorkloadError, load_expected, load_workload
from codeenv.sandbox.image import find_spec
from codeenv.sandbox.routing import choose_profile
from codeenv.settings import GatewaySettings, SandboxSettings
from tests.conftest import pool_app, serving

SETTINGS = GatewaySettings(slots=2, code_judge_wall_s=3)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(pool: SlotPool) -> AsyncIterator[str]:
    async with serving(pool_app(pool, SETTINGS)) as url:
        yield url


async def bench(tmp_path: Path, *args: str, timeout_s: float = 240) -> tuple[int, str, dict[str, Any] | None]:
    """Run `codeenv bench ARGS --out tmp_path` as a process (the test's server keeps serving meanwhile;
    the targets it starts claim uid blocks of their own)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "codeenv.cli", "bench", *args, "--out", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=dict(os.environ, COLUMNS="200"))
    out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    reports = sorted(tmp_path.glob("bench-*.json"))
    report = json.loads(reports[-1].read_text()) if reports else None
    return proc.returncode or 0, out.decode(), report


def only_target(report: dict[str, Any]) -> dict[str, Any]:
    [figures] = report["targets"].values()
    return figures


def check_adds_up(figures: dict[str, Any], calls: int) -> None:
    assert figures["calls_planned"] == figures["calls_answered"] == calls
    assert sum(figures["statuses"].values()) == calls
    assert figures["service_errors"] == 0
    assert figures["correctness"] == {"checked": calls, "mismatches": 0}
    assert figures["throughput_per_s"] > 0
    lat, run = figures["latency_ms"], figures["run_time_ms"]
    assert lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert run["p50"] <= lat["p50"] and figures["overhead_ms"]["p50"] >= 0


# --- the tool against a real codeenv, through each API ----------------------------------------


@pytest.mark.jail
@pytest.mark.parametrize("api", ["codeenv", "codeenv-client", "code-judge", "sandbox-fusion"])
async def test_grpo_scenario_through_each_api(server: str, tmp_path: Path, api: str) -> None:
    code, out, report = await bench(tmp_path, "--target", server, "--api", api, "--workload", "sympy",
                                    "--prompts", "2", "--samples", "3", "--turns", "3", "--steps", "2",
                                    "--think", "0-0.2")
    assert code == 0, out
    assert report is not None and (tmp_path / (sorted(tmp_path.glob("bench-*.json"))[-1].stem + ".png")).exists()
    assert report["workload"]["expectations"] == "shipped: sympy.expect.jsonl"
    calls = report["scenario"]["calls"]
    assert calls == len(plan(Scenario(prompts=2, samples=3, turns=3, steps=2, think=Think.parse("0-0.2")), 1))
    figures = only_target(report)
    check_adds_up(figures, calls)
    assert figures["statuses"] == {"ok": calls}
    # Two steps, each of 6 trajectories; a step's makespan covers its median trajectory.
    assert [s["trajectories"] for s in figures["steps"]] == [6, 6]
    assert all(s["makespan_s"] >= s["trajectory_p50_s"] for s in figures["steps"])
    native = api.startswith("codeenv")
    assert figures["queue_wait_ms"] is not None if native else figures["queue_wait_ms"] is None
    assert figures["overhead_includes_queue_wait"] is (not native)
    assert "calls/s" in out and "overhead" in out


@pytest.mark.jail
@pytest.mark.slow
async def test_saturation_and_open_loop_from_two_generator_processes(server: str, tmp_path: Path) -> None:
    code, out, report = await bench(tmp_path, "--target", server, "--workload", "print", "--mode", "concurrency",
                                    "--concurrency", "6", "--calls", "60", "--procs", "2")
    assert code == 0, out
    figures = only_target(report or {})
    check_adds_up(figures, 60)
    assert figures["generator"]["processes"] == 2 and figures["generator"]["cpu_s"] > 0

    code, out, report = await bench(tmp_path, "--target", server, "--workload", "print", "--mode", "rate",
                                    "--rate", "40", "--calls", "40", "--poisson")
    assert code == 0, out
    figures = only_target(report or {})
    check_adds_up(figures, 40)
    assert figures["send_lag_ms"]["p50"] < 1000
    assert figures["duration_s"] > 0.5  # 40 calls at 40/s are spread over about a second


@pytest.mark.jail
async def test_compare_alternates_and_reports_ratios(server: str, tmp_path: Path) -> None:
    code, out, report = await bench(tmp_path, "--target", server, "--compare", server, "--compare-api",
                                    "sandbox-fusion", "--workload", "print", "--mode", "concurrency",
                                    "--calls", "30", "--concurrency", "4", "--rounds", "2")
    assert code == 0, out
    assert report is not None and len(report["targets"]) == 2
    for figures in report["targets"].values():
        check_adds_up(figures, 60)  # two rounds of 30
    assert set(report["ratios"]["target_over_compare"]) >= {"throughput", "latency_p50", "latency_p99"}
    assert "round 2" in out


@pytest.mark.jail
async def test_wrong_answers_are_counted_and_fail_the_run(server: str, tmp_path: Path) -> None:
    expect = tmp_path / "wrong.expect.jsonl"
    expect.write_text(json.dumps("2") + "\n")
    code, out, report = await bench(tmp_path, "--target", server, "--workload", "print", "--expect", str(expect),
                                    "--mode", "concurrency", "--calls", "10", "--concurrency", "2")
    assert code == 1
    assert only_target(report or {})["correctness"] == {"checked": 10, "mismatches": 10}
    assert "wrong output" in out


@pytest.mark.jail
@pytest.mark.slow
async def test_shipped_math_workload_runs_true_on_codeenv(server: str, tmp_path: Path) -> None:
    """Every program of the math workload gives codeenv the outcome and output the physical-limit
    run recorded when the workload was made: the outputs are deterministic, and codeenv is right."""
    size = len(load_workload("math"))
    code, out, report = await bench(tmp_path, "--target", server, "--workload", "math", "--mode", "concurrency",
                                    "--calls", str(size), "--concurrency", "4")
    assert code == 0, out
    figures = only_target(report or {})
    assert figures["correctness"] == {"checked": size, "mismatches": 0}
    assert figures["statuses"]["timeout"] == sum(1 for c in load_workload("math") if c.tag == "timeout")


# --- baselines ---------------------------------------------------------------------------------


@pytest.mark.jail
@pytest.mark.slow
@pytest.mark.parametrize("design", ["naive", "naive-jail"])
async def test_baseline_targets_answer_through_the_same_api(tmp_path: Path, design: str) -> None:
    code, out, report = await bench(tmp_path, "--target", design, "--slots", "2", "--workload", "sympy",
                                    "--mode", "concurrency", "--calls", "6", "--concurrency", "2")
    assert code == 0, out
    figures = only_target(report or {})
    check_adds_up(figures, 6)


# --- bad targets and bad input -----------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    status = 404

    def _answer(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"nope\n")

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A plain HTTP server (not codeenv) on 127.0.0.1, in a thread, for the length of the block."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def other_server(request: pytest.FixtureRequest) -> Iterator[str]:
    with http_server(type("Handler", (_Handler,), {"status": request.param})) as url:
        yield url


class _FailsAfterOne(BaseHTTPRequestHandler):
    """Speaks code-judge well enough for the bench's trial call, then fails every call (HTTP 500)."""

    posts = 0

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200, b'"pong"')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts += 1
        if type(self).posts == 1:
            self._send(200, json.dumps({"success": True, "run_success": True, "stdout": "1\n", "stderr": "",
                                        "reason": "", "cost": 0.001}).encode())
        else:
            self._send(500, b"gone wrong")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.unit
async def test_calls_the_service_did_not_run_are_errors_not_throughput(tmp_path: Path) -> None:
    with http_server(type("H", (_FailsAfterOne,), {"posts": 0})) as url:
        code, out, report = await bench(tmp_path, "--target", url, "--api", "code-judge", "--workload", "print",
                                        "--mode", "concurrency", "--calls", "5", "--concurrency", "2")
    assert code == 1 and "5 calls were not run by the service" in out and "Traceback" not in out
    figures = only_target(report or {})
    assert figures["calls_answered"] == 5 and figures["calls_ran"] == 0 and figures["service_errors"] == 5
    assert figures["throughput_per_s"] == 0 and figures["correctness"] == {"checked": 0, "mismatches": 0}
    assert figures["top_errors"][0]["error"].startswith("HTTP 500")


@pytest.mark.unit
@pytest.mark.parametrize(("other_server", "message"), [(404, "does not speak the code-judge API"),
                                                       (503, "answered HTTP 503")], indirect=["other_server"])
async def test_a_server_of_another_kind_or_failing_gets_a_clear_message(other_server: str, message: str,
                                                                        tmp_path: Path) -> None:
    code, out, _ = await bench(tmp_path, "--target", other_server, "--api", "code-judge")
    assert code == 2 and message in out and "Traceback" not in out


@pytest.mark.unit
@pytest.mark.slow
async def test_bad_targets_and_options_get_clear_messages(tmp_path: Path) -> None:
    cases = [
        (["--target", f"http://127.0.0.1:{free_port()}"], "cannot reach"),
        (["--target", "ftp://example"], "give a URL"),
        (["--target", "http://[::1"], "give a URL"),
        (["--target", "http://127.0.0.1:99999"], "give a URL"),
        (["--target", "http://127.0.0.1:1", "--mode", "concurrency", "--concurrency", "2", "--procs", "3"],
         "more than the 2 calls in flight"),
        (["--target", "http://127.0.0.1:1", "--api", "grpc"], "unknown API"),
        (["--target", "http://127.0.0.1:1", "--think", "soon"], "think gap"),
        (["--target", "http://127.0.0.1:1", "--workload", "no-such-workload"], "no workload file"),
        ([], "give --target"),
    ]
    for args, message in cases:
        code, out, _ = await bench(tmp_path, *args)
        assert code == 2 and message in out and "Traceback" not in out, (args, out)


# --- the workload, the limit and the plan --------------------------------------------------------


@pytest.mark.unit
def test_shipped_math_workload_composition() -> None:
    """What the README says of the math workload: the shares of each kind of call, a tail over a
    second, imports the zygotes do not preload, and an expected outcome for every call."""
    calls = load_workload("math")
    tags = Counter(c.tag for c in calls)
    n = len(calls)
    assert n == 200
    assert 0.35 <= (tags["sympy"] + tags["sympy_submodule"]) / n <= 0.5
    assert 0.1 <= tags["numpy"] / n <= 0.2
    assert 0.2 <= (tags["pure"] + tags["stdin"]) / n <= 0.35
    assert 0.05 <= tags["error"] / n <= 0.12 and 0.01 <= tags["timeout"] / n <= 0.03
    assert 0.02 <= tags["slow"] / n <= 0.06
    assert all(c.timeout == 3.0 for c in calls)
    expected = load_expected(SHIPPED / "math.expect.jsonl", n)
    outcome = {c.tag: Counter() for c in calls}  # type: dict[str, Counter[str]]
    for call, exp in zip(calls, expected, strict=True):
        outcome[call.tag][exp.status] += 1
    assert set(outcome["error"]) == {"error"} and set(outcome["timeout"]) == {"timeout"}
    assert all(set(v) == {"ok"} for tag, v in outcome.items() if tag not in ("error", "timeout"))
    # Imports that no zygote of the math profile preloads: the call pays for them itself.
    spec, _ = find_spec(SandboxSettings().image)
    [math_profile] = [p for p in spec.profiles if p.name == "math"]
    submodules = [c for c in calls if c.tag == "sympy_submodule"]
    assert submodules and all(choose_profile(c.code.encode(), spec.profiles) is math_profile for c in submodules)
    assert all(not any(m in c.code for m in math_profile.preload if "." in m) for c in submodules)
    assert sum(1 for c in calls if choose_profile(c.code.encode(), spec.profiles).name == "scientific") >= 5


@pytest.mark.jail
def test_limit_runs_each_program_warm_and_records_outcomes() -> None:
    calls = load_workload("sympy") + [c for c in load_workload("math") if c.tag in ("error", "stdin")][:4]
    report = measure_limit(calls)
    assert report.statuses[0] == "ok" and report.stdouts[0].startswith("{3: 1, 5: 1")
    assert report.cpu_s[0] < 0.5  # sympy was imported before the fork: the child only factors
    assert all(cpu > 0 for cpu in report.cpu_s)
    assert report.limit_per_s == pytest.approx(len(calls) / (sum(report.cpu_s) / report.cores))
    expected = load_expected(SHIPPED / "math.expect.jsonl", 200)
    by_call = {(c.code, c.stdin): e for c, e in zip(load_workload("math"), expected, strict=True)}
    for call, status, stdout in zip(calls[1:], report.statuses[1:], report.stdouts[1:], strict=True):
        assert by_call[call.code, call.stdin].matches(status, stdout)


@pytest.mark.unit
def test_plan_is_deterministic_and_split_keeps_trajectories_whole() -> None:
    scenario = Scenario(prompts=3, samples=4, turns=5, steps=2, think=Think.parse("exp:0.5"), seed=7)
    items = plan(scenario, 10)
    assert items == plan(scenario, 10) and items != plan(Scenario(seed=8), 10)
    assert {i[0] for i in items} == {0, 1} and {i[1] for i in items} == set(range(12))
    parts = split(items, 3)
    assert sorted(x for p in parts for x in p) == sorted(items)
    for k, part in enumerate(parts):
        assert {i[1] % 3 for i in part} == {k}
    rate = plan(Scenario(mode="rate", calls=5, rate=10), 3)
    assert [round(i[4], 3) for i in rate] == [0, 0.1, 0.2, 0.3, 0.4]
    assert Think.parse("2").draw(__import__("random").Random()) == 2
    for bad in ("2-1", "x", "exp:"):
        with pytest.raises(ValueError):
            Think.parse(bad)


@pytest.mark.unit
def test_expectations_and_workload_files_are_checked(tmp_path: Path) -> None:
    bad = tmp_path / "w.jsonl"
    bad.write_text('{"code": 1}\n')
    with pytest.raises(WorkloadError, match="must be strings"):
        load_workload(str(bad))
    bad.write_text('{"code": "print(1)"}\n')
    assert load_workload(str(bad))[0].code == "print(1)"
    (tmp_path / "e.jsonl").write_text('"1"\n"2"\n')
    with pytest.raises(WorkloadError, match="2 expectations for a workload of 1"):
        load_expected(tmp_path / "e.jsonl", 1)
    assert Expected("timeout").matches("timeout", "anything")
    assert not Expected("ok", "1").matches("error", "1") and Expected("ok", "1\n").matches("ok", "1")
    assert ratios({"throughput_per_s": 20, "latency_ms": {"p50": 5, "p99": 10}},
                  {"throughput_per_s": 10, "latency_ms": {"p50": 10, "p99": 40}}) == \
        {"throughput": 2.0, "latency_p50": 2.0, "latency_p99": 4.0}


# --- what tests, benchmarks and the bench share: the service starter -------------------


@pytest.mark.unit
def test_a_service_that_exits_before_it_is_ready_says_why(tmp_path: Path) -> None:
    service = start_codeenv("serve", "--slots", "0", port=free_port(), log=tmp_path / "serve.log")
    with service, pytest.raises(ServiceError, match=r"(?s)^codeenv serve exited \(status 2\) before it was ready:.*"
                                                   r"invalid settings: CODEENV_SLOTS"):
        service.wait_ready()
    assert service.returncode == 2


# --- the report: live figures, the plot, the help ------------------------------------------------


def _records(n: int, start: float, span_s: float, errors: int = 0) -> list[Record]:
    """`n` answered calls of one round starting at `start`, the last one answered `span_s` later."""
    out: list[Record] = []
    for i in range(n):
        done = start + span_s * (i + 1) / n
        status = "overloaded" if i < errors else "ok"
        out.append((0, i, 0, start, start, start, done, status, 0.0, 0.001, -1, None))
    return out


@pytest.mark.unit
def test_the_progress_bar_shows_the_tables_throughput() -> None:
    """The live figure, fed as the generators flush, ends on the table's figure: both count the calls
    the service ran from the round's first call (the bar counted from the round's start-up)."""
    records = _records(290, start=1000.0, span_s=1.0, errors=10)
    live = RunningThroughput()
    for k in range(0, len(records), 37):  # flushed a few records at a time
        live.add(records[k:k + 37])
    table = summarize([RoundResult(records=records)], len(records), "concurrency", 2)["throughput_per_s"]
    assert table == pytest.approx(280.0) and live.per_s == pytest.approx(table, abs=1e-3)
    assert RunningThroughput().per_s == 0.0


@pytest.mark.unit
@pytest.mark.parametrize("span_s", [0.05, 0.4, 3.0, 600.0])
def test_the_throughput_plot_has_bins_however_short_the_run(span_s: float) -> None:
    records = _records(200, start=50.0, span_s=span_s)
    xs, ys = throughput_series(records)
    assert 20 <= len(xs) <= 41, len(xs)  # about 40 bins: a line, not one point
    width = xs[1] - xs[0]
    assert sum(y * width for y in ys) == pytest.approx(200)  # every answered call in a bin


@pytest.mark.unit
def test_bench_help_describes_the_current_options() -> None:
    from typer.testing import CliRunner

    from codeenv.bench.apis import APIS
    from codeenv.bench.targets import SPAWNABLE
    from codeenv.cli import app

    result = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"},
                                terminal_width=400)
    assert result.exit_code == 0, result.output
    help_text = " ".join(result.output.split())
    shipped = sorted(p.name.removesuffix(".jsonl") for p in SHIPPED.glob("*.jsonl") if ".expect" not in p.name)
    for word in [*APIS, *SPAWNABLE, *shipped, "grpo", "concurrency", "rate"]:  # each as a word of its own
        assert re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", help_text), word
