"""Counts that do not drift with the machine, per revision: what "no regression" is judged by.

- **syscalls per call**: the jail's processes (the zygote and each call's child) under
  `strace -f -c` while 1,000 `print(1)` calls run one after another on one slot, divided by the
  calls; the totals per syscall name come with it.
- **gateway instructions per request**: `valgrind --tool=callgrind` over the real app (`create_app`)
  with an in-memory queue behind it that answers every call `ok` at once, so only the gateway's own
  work is counted; two runs (N and 5N requests) and their difference per request, which leaves
  start-up out. For `/v1/execute`, `/run_code`, a `/v1/execute/batch` of 32 (per call), a session's
  cell and a `/v1/judge` of 10 stdin tests (per test; the fake queue says every test passed). Two
  clients: httpx's ASGI transport (`instructions ROUTE`, the figure reported since the house issue:
  it counts httpx's own work on both ends of the request too) and the app called with the ASGI
  messages a server sends (`gateway instructions ROUTE`: the gateway alone). Where the revision has
  it, the app's start is frozen out of the garbage collector's scans as `codeenv serve` does.

    python benchmarks/counts.py [REV ...] [--calls 1000] [--requests 50] [--json out.json]

Each revision (default: the working tree) runs from a worktree of its own with this environment's
packages (`PYTHONPATH`). Needs root, nsjail, strace and valgrind. About 3 minutes per revision.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from ab_revisions import ROOT, worktree  # this directory: run as a script

HERE = Path(__file__).resolve()
#: A session's id as the pool makes them (the fake queue below answers its cells).
SESSION = "0123456789a.1.AbCdEfGhIjKlMnOpQrStUvWx"
ROUTES = {
    "/v1/execute": {"code": "print(1)"},
    "/run_code": {"code": "print(1)", "language": "python"},
    "/v1/execute/batch": {"requests": [{"code": "print(1)"}] * 32},
    f"/v1/sessions/{SESSION}/execute": {"code": "x = 1\nx"},
    "/v1/judge": {"code": "print(int(input()) * 2)", "tests": [{"stdin": str(i), "expected_stdout": str(2 * i)}
                                                            for i in range(10)]},
}
#: Calls (or judged tests) per request of a route (its figure is per call, or per test).
CALLS_OF = {"/v1/execute/batch": 32, "/v1/judge": 10}
#: How a route's figure is named in the report.
NAMES = {f"/v1/sessions/{SESSION}/execute": "a session cell", "/v1/judge": "/v1/judge of 10 tests"}


# --- inside a revision's environment -------------------------------------------------------------

def descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += [int(child), *descendants(int(child))]
    return out


async def engine_syscalls(calls: int) -> dict[str, object]:
    from codeenv import ExecRequest, SandboxSettings, SlotPool

    pool = SlotPool(SandboxSettings(slots=1, session_spares=False))
    await pool.start()
    try:
        request = ExecRequest(code="print(1)", profile="light")
        for _ in range(20):  # warm: the spare child forked, every lazy path taken once
            assert (await pool.run(request)).stdout == "1\n"
        jailed = [p for p in descendants(os.getpid())
                  if Path(f"/proc/{p}/comm").read_text().strip() != "nsjail"]
        with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
            tracer = subprocess.Popen(["strace", "-f", "-c", "-o", out.name,
                                       *(arg for p in jailed for arg in ("-p", str(p)))],
                                      stderr=subprocess.DEVNULL)
            await asyncio.sleep(1.0)  # strace attaches
            for _ in range(calls):
                assert (await pool.run(request)).stdout == "1\n"
            tracer.send_signal(signal.SIGINT)
            tracer.wait(30)
            by_name = parse_strace(out.read())
    finally:
        await pool.close()
    total = sum(by_name.values())
    return {"calls": calls, "processes_traced": len(jailed), "per_call": round(total / calls, 2),
            "by_name_per_call": {k: round(v / calls, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])
                                 if v / calls >= 0.05}}


def parse_strace(summary: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in summary.splitlines():
        fields = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(fields) >= 5 and re.fullmatch(r"[\d.]+", fields[0]) and fields[-1] != "total":
            counts[fields[-1]] = int(fields[3])
    return counts


async def gateway_requests(route: str, requests: int, client: str = "httpx") -> None:
    import httpx

    from codeenv.api.app import create_app
    from codeenv.models import ExecRequest, ExecResult, JudgeOutcome, TestResult
    from codeenv.settings import GatewaySettings

    def answer(request: ExecRequest) -> ExecResult:
        if request.judge is not None:  # every test passed
            tests = [TestResult(status="passed", stdout=f"{2 * i}\n", exit_code=0) for i in range(10)]
            return ExecResult(status="ok", exit_code=0, started=True, judge=JudgeOutcome(passed=10, total=10,
                                                                                        tests=tests))
        if request.session is not None:
            return ExecResult(status="ok", exit_code=0, started=True, value="1", execution_count=1)
        return ExecResult(status="ok", stdout="1\n", exit_code=0, started=True)

    class AnswerAtOnce:
        """A queue that answers every call `ok` without running it (a judged call: every test passed)."""
        pool = None
        # Not None only for a session's cell: the other routes' figures stay those measured before.
        sessions = object() if "/v1/sessions/" in route else None

        async def start(self) -> None: ...
        async def close(self) -> None: ...

        async def submit(self, requests: list[ExecRequest], gone: object = None, accepted_at: float | None = None,
                         on_result: object = None) -> list[ExecResult]:
            results = [answer(r) for r in requests]
            if callable(on_result):
                for i, result in enumerate(results):
                    on_result(i, result)
            return results

        def ready(self) -> bool:
            return True

        def drain(self, until: float) -> None: ...
        def force(self) -> None: ...

        async def lookup(self, call_id: str) -> tuple[bool, ExecResult | None]:
            return False, None

        def stats(self) -> dict[str, float]:
            return {"slots": 1, "free_slots": 1, "slot_restarts": 0, "calls_run": 0, "waiting": 0,
                    "oldest_wait_s": 0.0, "workers": 1}

    queue = AnswerAtOnce()
    app = create_app(GatewaySettings(), queue)  # type: ignore[arg-type]
    try:
        from codeenv.stopping import freeze_startup  # as `codeenv serve` does once started
    except ImportError:
        pass
    else:
        freeze_startup()
    if client == "asgi":
        await asgi_requests(app, route, requests)
        return
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        for _ in range(requests):
            response = await client.post(route, json=ROUTES[route])
            assert response.status_code == 200, response.text
            assert b"\"passed\"" in response.content or "/judge" not in route, response.text


async def asgi_requests(app: object, route: str, requests: int) -> None:
    """`requests` POSTs to `route`, sent as the ASGI messages a server (uvicorn) sends: no client's work."""
    body = json.dumps(ROUTES[route]).encode()
    headers = [(b"host", b"localhost"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    for _ in range(requests):
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": route, "raw_path": route.encode(), "query_string": b"", "root_path": "",
                 "headers": headers, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
        messages: list[dict[str, object]] = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict[str, object]] = []

        async def receive(messages: list[dict[str, object]] = messages) -> dict[str, object]:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client stays
            raise AssertionError

        await app(scope, receive, _append_to(sent))  # type: ignore[operator]
        assert sent[0]["status"] == 200, sent


def _append_to(sent: list[dict[str, object]]) -> Callable[[dict[str, object]], Awaitable[None]]:
    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    return send


# --- driving the revisions -----------------------------------------------------------------------

def inner(tree: Path, *args: str, valgrind: Path | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    prefix = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={valgrind}"] if valgrind else []
    return subprocess.run([*prefix, sys.executable, str(HERE), "--inner", *args], env=env, cwd=tree, check=True,
                          capture_output=True, text=True).stdout


def instructions(tree: Path, route: str, requests: int, tmp: Path, client: str) -> int:
    out = tmp / "callgrind.out"
    inner(tree, "gateway", route, str(requests), client, valgrind=out)
    for line in out.read_text().splitlines():
        if line.startswith("summary:") or line.startswith("totals:"):
            return int(line.split()[1])
    raise SystemExit(f"no totals in {out}")


def measure(tree: Path, calls: int, requests: int, tmp: Path) -> dict[str, object]:
    figures: dict[str, object] = {"syscalls": json.loads(inner(tree, "engine", str(calls)))}
    for client, name in (("httpx", "instructions"), ("asgi", "gateway instructions")):
        for route in ROUTES:
            small = instructions(tree, route, requests, tmp, client)
            large = instructions(tree, route, 5 * requests, tmp, client)
            per = {"/v1/judge": " per test"}.get(route, " per call" if route in CALLS_OF else "")
            figures[f"{name} {NAMES.get(route, route)}{per}"] = round(
                (large - small) / (4 * requests * CALLS_OF.get(route, 1)))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revs", nargs="*", help="git revisions (default: the working tree as it is)")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--inner", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        kind, *rest = args.inner
        if kind == "engine":
            print(json.dumps(asyncio.run(engine_syscalls(int(rest[0])))))
        else:
            asyncio.run(gateway_requests(rest[0], int(rest[1]), rest[2] if len(rest) > 2 else "httpx"))
        return
    report: dict[str, object] = {"date": time.strftime("%Y-%m-%d"), "calls": args.calls, "requests": args.requests}
    with tempfile.TemporaryDirectory(prefix="codeenv-counts-") as tmp:
        for rev in args.revs or ["working tree"]:
            tree = ROOT if rev == "working tree" else worktree(rev, Path(tmp))
            try:
                report[rev] = measure(tree, args.calls, args.requests, Path(tmp))
            finally:
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
            print(json.dumps({rev: report[rev]}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
