"""``codeenv bench``: run a scenario against one target (or two, in alternation) and report."""

from __future__ import annotations

import asyncio
import contextlib
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from codeenv.bench.apis import SERVICE_ERRORS, Http, api
from codeenv.bench.limit import LimitReport, cores, measure_limit
from codeenv.bench.report import RunningThroughput, plot, ratios, summarize, warnings
from codeenv.bench.runner import Part, Record, RoundResult, run_round
from codeenv.bench.targets import is_local, target
from codeenv.bench.traffic import Scenario, plan
from codeenv.bench.workload import Call, Expected, expect_path_for, load_expected, load_workload
from codeenv.errors import BenchError, BenchFailed, TargetError


@dataclass
class Options:
    target: str | None
    api: str = "codeenv"
    compare: str | None = None
    compare_api: str | None = None
    workload: str = "math"
    expect: Path | None = None
    check: bool = True
    scenario: Scenario = Scenario()
    procs: int = 1
    rounds: int = 1
    slots: int | None = None
    limit: bool = False
    write_expect: Path | None = None
    out: Path = Path(".")
    http_timeout_s: float = 300.0


def _expected(opts: Options, calls: list[Call]) -> tuple[list[Expected] | None, str | None]:
    if not opts.check:
        return None, None
    path = opts.expect or expect_path_for(opts.workload)
    if path is None:
        return None, None
    # A shipped file is named as shipped, so that a report says the same on every machine.
    source = str(path) if opts.expect else f"shipped: {path.name}"
    return load_expected(path, len(calls)), source


def _limit(opts: Options, calls: list[Call], console: Console, write_expect: bool = True) -> LimitReport:
    with Progress(TextColumn("physical limit"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("", total=len(calls))
        try:
            report = measure_limit(calls, progress=lambda n: bar.update(task, completed=n))
        except (OSError, BenchError, ValueError) as exc:
            raise BenchFailed(f"the physical limit could not be measured: {exc}") from exc
    s = report.summary()
    console.print(f"physical limit of [bold]{opts.workload}[/]: {s['calls']} programs, {s['total_cpu_s']} s of CPU "
                  f"(mean {s['mean_cpu_ms']} ms) on {s['cores']} cores: [bold]{s['limit_calls_per_s']} calls/s[/]")
    if opts.write_expect and write_expect:
        opts.write_expect.write_text("".join(json.dumps(e) + "\n" for e in report.expectations()))
        console.print(f"expected outputs written to {opts.write_expect}")
    return report


def _check(url: str, api_name: str) -> None:
    async def go() -> None:
        speaker = api(api_name)
        async with Http(url, timeout_s=60) as client:
            await speaker.start(url)
            try:
                await speaker.check(client)
            finally:
                await speaker.stop()
    try:
        asyncio.run(go())
    except TargetError:
        raise
    except Exception as exc:
        raise TargetError(f"cannot use {url} ({type(exc).__name__}: {exc})") from exc


def _round(label: str, url: str, api_name: str, opts: Options, items: list[Any], calls: list[Call],
           expected: list[Expected] | None, console: Console) -> RoundResult:
    latencies: list[float] = []
    counts = {"errors": 0, "wrong": 0}
    throughput = RunningThroughput()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(label, total=len(items), stats="")

        def seen(records: list[Record]) -> None:
            latencies.extend(1000 * (r[6] - r[4]) for r in records)
            counts["errors"] += sum(1 for r in records if r[7] in SERVICE_ERRORS)
            counts["wrong"] += sum(1 for r in records if r[10] == 0)
            throughput.add(records)
            p50, p99 = np.percentile(latencies, [50, 99]) if latencies else (0.0, 0.0)
            # The table's figure, so far: calls run per second since the round's first call.
            stats = f"{throughput.per_s:6.1f} calls/s  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  errors {counts['errors']}"
            if expected is not None:
                stats += f"  wrong {counts['wrong']}"
            bar.update(task, completed=len(latencies), stats=stats)

        part = Part(url, api_name, opts.scenario.mode, items, calls, expected, opts.scenario.concurrency,
                    opts.http_timeout_s, opts.scenario.steps)
        result = run_round(part, opts.procs, seen)
    if result.failure:
        raise BenchFailed(f"{label}: the generator failed:\n{result.failure}")
    return result


def _table(title: str, labels: list[str], targets: dict[str, dict[str, Any]]) -> Table:
    """Figures down, targets across: a table that fits a terminal whatever the number of figures."""
    def ms(f: dict[str, Any], key: str) -> str:
        v = f.get(key)
        return f"{v['p50']:.1f} / {v['p90']:.1f} / {v['p99']:.1f} / {v['max']:.0f}" if v else "-"

    rows: list[tuple[str, Any]] = [
        ("answered / sent", lambda f: f"{f['calls_answered']} / {f['calls_planned']}"),
        ("calls/s", lambda f: f"{f['throughput_per_s']:.1f}"),
        ("latency ms p50/p90/p99/max", lambda f: ms(f, "latency_ms")),
        ("queue wait ms", lambda f: ms(f, "queue_wait_ms")),
        ("run time ms", lambda f: ms(f, "run_time_ms")),
        ("overhead ms", lambda f: ms(f, "overhead_ms")),
        ("step makespan / tail s", lambda f: f"{f['makespan_s']:.2f} / {f['straggler_tail_s']:.2f}"
         if "makespan_s" in f else "-"),
        ("wrong / checked", lambda f: f"{f['correctness']['mismatches']} / {f['correctness']['checked']}"
         if f["correctness"]["checked"] else "-"),
        ("statuses", lambda f: " ".join(f"{k} {v}" for k, v in f["statuses"].items())),
        ("generator CPU s", lambda f: f"{f['generator']['cpu_s']:.2f}"),
    ]
    table = Table(title=title, title_style="bold")
    table.add_column("")
    for label in labels:
        table.add_column(label, justify="right")
    for name, cell in rows:
        table.add_row(name, *(cell(targets[label]) for label in labels))
    return table


def run_bench(opts: Options, console: Console) -> int:
    """Run what `opts` asks for; the exit status (1 if a call was answered wrongly or not run)."""
    calls = load_workload(opts.workload)
    expected, expect_source = _expected(opts, calls)
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": {"cores": cores(), "machine": platform.machine(),
                                                                  "python": platform.python_version()},
        "workload": {"name": opts.workload, "calls": len(calls), "expectations": expect_source},
    }
    limits = [_limit(opts, calls, console)] if opts.limit else []
    if limits:
        report["physical_limit"] = limits[0].summary()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    opts.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = opts.out / f"bench-{stamp}.json", opts.out / f"bench-{stamp}.png"
    if opts.target is None:
        json_path.write_text(json.dumps(report, indent=2))
        console.print(f"report: {json_path}")
        return 0

    scenario = opts.scenario
    items = plan(scenario, len(calls))
    report["scenario"] = {**asdict(scenario), "think": str(scenario.think), "calls": len(items),
                          "description": scenario.describe(), "procs": opts.procs, "rounds": opts.rounds}
    console.print(f"{scenario.describe()}: {len(items)} calls of [bold]{opts.workload}[/] per round")
    sides = [(opts.target, opts.api)] + ([(opts.compare, opts.compare_api or opts.api)] if opts.compare else [])
    labels = [spec if name == "codeenv" else f"{spec} ({name} API)" for spec, name in sides]
    if len(set(labels)) < len(labels):
        labels = [f"{label} #{i + 1}" for i, label in enumerate(labels)]
    runs: dict[str, list[RoundResult]] = {label: [] for label in labels}
    with contextlib.ExitStack() as stack:
        urls = []
        for spec, api_name in sides:
            if not spec.startswith(("http://", "https://")):
                console.print(f"starting {spec} ...")
            url = stack.enter_context(target(spec, opts.slots))
            _check(url, api_name)
            urls.append(url)
        for r in range(opts.rounds):
            order = list(range(len(sides)))
            if r % 2:
                order.reverse()  # A B, then B A: drift on a shared machine hits both alike
            for i in order:
                label = labels[i] + (f" round {r + 1}" if opts.rounds > 1 else "")
                runs[labels[i]].append(_round(label, urls[i], sides[i][1], opts, items, calls, expected, console))

    if limits:
        # The machine's speed drifts (shared cores): measure the limit again after the rounds, and
        # compare with the mean of the two.
        limits.append(_limit(opts, calls, console, write_expect=False))
        mean = sum(one.limit_per_s for one in limits) / len(limits)
        report["physical_limit"] = {**limits[0].summary(), "limit_calls_per_s": round(mean, 3),
                                    "measured_before_and_after": [round(one.limit_per_s, 3) for one in limits]}
    report["targets"] = {}
    for (spec, api_name), label, url in zip(sides, labels, urls, strict=True):
        figures = summarize(runs[label], len(items), scenario.mode, cores())
        if limits:
            figures["fraction_of_physical_limit"] = round(
                figures["throughput_per_s"] / report["physical_limit"]["limit_calls_per_s"], 3)
        figures["warnings"] = warnings(figures, is_local(url))
        report["targets"][label] = {"target": spec, "api": api_name, **figures}
    if opts.compare:
        report["ratios"] = {"target_over_compare": ratios(*[report["targets"][label] for label in labels])}

    table = _table(f"{opts.workload}: {scenario.describe()}", labels, report["targets"])
    console.print(table)
    for label in labels:
        figures = report["targets"][label]
        if "fraction_of_physical_limit" in figures:
            console.print(f"{label}: {figures['fraction_of_physical_limit']:.2f} of the physical limit "
                          f"({report['physical_limit']['limit_calls_per_s']:.1f} calls/s, the mean of "
                          "a measurement before and after the rounds)")
        if figures["overhead_includes_queue_wait"]:
            console.print(f"{label}: the {figures['api']} API reports no queue wait, so overhead includes it")
        for e in figures["top_errors"]:
            console.print(f"[yellow]{label}: {e['count']} x {e['error']}[/]")
        for w in figures["warnings"]:
            console.print(f"[yellow]warning ({label}):[/] {w}")
    if opts.compare:
        ratio_text = ", ".join(f"{k} {v:.2f}x" for k, v in report["ratios"]["target_over_compare"].items() if v)
        console.print(f"[bold]{labels[0]} over {labels[1]}[/] (>1: better): {ratio_text}")
    json_path.write_text(json.dumps(report, indent=2))
    drew = plot(png_path, runs, f"{opts.workload}: {scenario.describe()}")
    console.print(f"report: {json_path}" + (f", {png_path}" if drew else " (no figure: install matplotlib)"))
    wrong = sum(report["targets"][label]["correctness"]["mismatches"] for label in labels)
    if wrong:
        console.print(f"[bold red]{wrong} calls were answered with the wrong output or status[/]")
    failed = sum(report["targets"][label]["service_errors"] for label in labels)
    if failed:
        console.print(f"[bold red]{failed} calls were not run by the service[/]")
    return 1 if wrong or failed else 0
