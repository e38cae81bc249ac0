"""The ``codeenv`` command line.

Usage::

    codeenv serve [--host H] [--port P] [--slots N] [--token T] [--redis URL [--no-local-worker]]
    codeenv serve --processes N [...]   # N gateway processes, one slot pool per host
    codeenv worker --redis URL [--slots N]
    codeenv run FILE [--stdin TEXT] [--timeout S] [--memory MB]
    codeenv image build [NAME]
    codeenv bench --target URL|codeenv|codeenv-redis|naive|naive-jail [--api ...] [--mode ...] [--compare ...]
    codeenv bench --limit [--workload ...]   # the physical limit of a workload here
    codeenv doctor [--json] [--cgroup-root PATH]
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from codeenv import logs
from codeenv.admission import resolve_limits
from codeenv.errors import CodeenvError
from codeenv.models import ExecRequest, ExecResult, Limits, Status
from codeenv.settings import GatewaySettings, SandboxSettings, describe_invalid

app = typer.Typer(help="codeenv: fast, jailed Python execution for agentic RL.", no_args_is_help=True)
image_app = typer.Typer(help="Build and inspect sandbox images.", no_args_is_help=True)
app.add_typer(image_app, name="image")
err = Console(stderr=True, soft_wrap=True)  # a cause stays on one line, whatever the width
LOG_FORMAT_HELP = "json (one object per line) or plain (one text line), for codeenv's and uvicorn's logs alike"


def _setup_logging(log_format: str) -> None:
    try:
        logs.setup(logs.parse(log_format))
    except ValueError as exc:
        raise _fail(str(exc)) from exc


def _progress(message: str) -> None:
    err.print(f"[bold cyan]image[/] {message}")


def _log_progress(message: str) -> None:
    """Progress of a long-running role (serve, worker): a log line in the run's one format."""
    logging.getLogger("codeenv.image").info("%s", message)


def _fail(message: str | BaseException) -> typer.Exit:
    if isinstance(message, ValidationError):
        message = describe_invalid(message)
    err.print(f"[bold red]error:[/] {escape(str(message))}")
    return typer.Exit(2)


@app.command()
def run(
    file: Annotated[Path, typer.Argument(help="Python file to run ('-' reads standard input)")],
    stdin: Annotated[str, typer.Option(help="text fed to the program's standard input")] = "",
    timeout: Annotated[float | None, typer.Option(help="wall-clock limit in seconds")] = None,
    memory: Annotated[int | None, typer.Option(help="memory limit in MB")] = None,
    profile: Annotated[str | None, typer.Option(help="zygote profile (default: chosen from imports)")] = None,
    image: Annotated[str | None, typer.Option(help="sandbox image name")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run one program in a jail and print its result as JSON. Exits with the program's status: its
    exit code, 128 + the signal that ended it, 124 past its time limit, 1 past another limit."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = sys.stdin.read() if str(file) == "-" else file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f"cannot read {file}: {exc}") from exc
    try:
        settings = SandboxSettings(slots=1)
        if image:
            settings = settings.model_copy(update={"image": image})
        request = ExecRequest(code=code, stdin=stdin, profile=profile,
                              limits=Limits(wall_s=timeout, memory_mb=memory))
        resolve_limits(request.limits, settings.defaults, settings.caps)  # refuse before starting jails
    except ValueError as exc:
        raise _fail(exc) from exc

    async def go() -> ExecResult:
        from codeenv.sandbox.image import ensure_image
        from codeenv.sandbox.pool import SlotPool
        from codeenv.sandbox.routing import choose_profile

        # One program: start only the zygote of the profile it runs in (as the pool would route it).
        image = await asyncio.to_thread(ensure_image, settings, _progress)
        needed = profile or choose_profile(code.encode("utf-8", "surrogatepass"), image.spec.profiles).name
        async with SlotPool(settings, progress=_progress, profiles=[needed]) as pool:
            return await pool.run(request)

    try:
        result = asyncio.run(go())
    except CodeenvError as exc:
        raise _fail(str(exc)) from exc
    print(result.model_dump_json(indent=2))
    raise typer.Exit(_exit_status(result))


def _exit_status(result: ExecResult) -> int:
    """A shell's view of how the program ended (as `timeout` and the shell report it)."""
    if result.status is Status.internal_error:
        return 2
    if result.exit_code is not None and result.status in (Status.ok, Status.error):
        return result.exit_code
    if result.signal is not None and result.status is not Status.timeout:
        return 128 + result.signal
    if result.status is Status.timeout:
        return 124
    return 0 if result.status is Status.ok else 1


def _check_port(host: str, port: int) -> None:
    """Refuse a taken (or unbindable) address before any jail starts; uvicorn binds it again."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:
        raise _fail(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another process holds it? "
                    "choose another --port)") from exc


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="address to bind [default: 127.0.0.1; anything but "
                                                  "loopback needs --token]")] = None,
    port: Annotated[int | None, typer.Option(help="port to bind [default: 8000]")] = None,
    slots: Annotated[int | None, typer.Option(help="concurrent calls (default: one per core)")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token required on every endpoint",
                                              envvar="CODEENV_TOKEN")] = None,
    insecure: Annotated[bool | None, typer.Option(
        "--insecure", help="allow a non-loopback bind without a token")] = None,
    redis: Annotated[str | None, typer.Option(
        help="queue through Redis Streams at this URL (default: embedded, no Redis)")] = None,
    local_worker: Annotated[bool | None, typer.Option(
        "--local-worker/--no-local-worker", help="with --redis: also run a worker here [default: yes]")] = None,
    processes: Annotated[int | None, typer.Option(
        help="gateway (uvicorn) processes; the host keeps one slot pool whatever the number [default: 1]")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
    log_format: Annotated[str, typer.Option(help=LOG_FORMAT_HELP, envvar=logs.ENV)] = "json",
) -> None:
    """Start the service: the HTTP gateway with an embedded pool of jailed workers (no Redis), or
    with --redis, a gateway of the Redis Streams queue (with a local worker unless told otherwise)."""
    from codeenv.topology import prepare_jails, run_gateway

    _setup_logging(log_format)
    try:
        # Only what was given on the command line overrides CODEENV_* variables and defaults.
        given = {"host": host, "port": port, "token": token, "insecure": insecure, "slots": slots,
                 "redis_url": redis, "local_worker": local_worker, "processes": processes}
        given = {k: v for k, v in given.items() if v is not None}
        settings = GatewaySettings(**given)  # type: ignore[arg-type]
    except ValueError as exc:
        raise _fail(exc) from exc
    _check_port(settings.host, settings.port)
    if settings.redis_url is None or settings.local_worker:
        try:
            prepare_jails(settings, _log_progress)  # refuse before binding: no image, cgroups or memory for a slot
        except (CodeenvError, OSError) as exc:
            raise _fail(str(exc)) from exc
    try:
        run_gateway(settings, given, log_level, log_format)
    except CodeenvError as exc:
        raise _fail(str(exc)) from exc


@app.command()
def mcp(
    url: Annotated[str, typer.Option(help="the running service the tools call", envvar="CODEENV_URL")] =
        "http://127.0.0.1:8000",
    token: Annotated[str | None, typer.Option(help="its bearer token", envvar="CODEENV_TOKEN")] = None,
) -> None:
    """An MCP server on stdin and stdout (for clients that start their tools as processes) whose
    tools (python, python_session, stateful_python_code_exec) run on the service at --url."""
    from codeenv.api.mcp import run_stdio
    from codeenv.client._async import check_base_url

    try:
        check_base_url(url)
    except ValueError as exc:
        raise _fail(exc) from exc
    asyncio.run(run_stdio(url, token))


@app.command()
def bench(
    target: Annotated[str | None, typer.Option(help="URL of the service, or codeenv, codeenv-redis, naive, "
                                                    "naive-jail to have the bench start one on 127.0.0.1 "
                                                    "(and stop it)")] = None,
    api: Annotated[str, typer.Option(help="codeenv (POST /v1/execute), codeenv-client (codeenv's batching "
                                          "client), judge (POST /v1/judge; code workloads), code-judge "
                                          "(POST /run) or sandbox-fusion (POST /run_code)")] = "codeenv",
    compare: Annotated[str | None, typer.Option(help="a second target, run in alternation with the first")] = None,
    compare_api: Annotated[str | None, typer.Option(help="the second target's API [default: --api]")] = None,
    workload: Annotated[str, typer.Option(help="a shipped workload (math, print, sympy, code) or a JSONL file of "
                                               "{code, stdin, timeout, tag}, or of {code, tests, timeout} "
                                               "(code workloads)")] = "math",
    expect: Annotated[Path | None, typer.Option(help="expected outcome per call (JSONL of {status, stdout}); "
                                                     "shipped workloads bring their own")] = None,
    check: Annotated[bool, typer.Option("--check/--no-check", help="count wrong answers")] = True,
    mode: Annotated[str, typer.Option(help="grpo, concurrency (closed loop) or rate (open loop)")] = "grpo",
    prompts: Annotated[int, typer.Option(min=1, help="grpo: prompts per step")] = 8,
    samples: Annotated[int, typer.Option(min=1, help="grpo: samples (trajectories) per prompt")] = 8,
    turns: Annotated[int, typer.Option(min=1, help="grpo: most tool calls per trajectory")] = 4,
    steps: Annotated[int, typer.Option(min=1, help="grpo: training steps")] = 3,
    think: Annotated[str, typer.Option(help="grpo: thinking gap before each call: 2, 0-2 or exp:MEAN (s)")] = "0-2",
    concurrency: Annotated[int, typer.Option(min=1, help="concurrency: calls in flight")] = 32,
    calls: Annotated[int, typer.Option(min=1, help="concurrency, rate: calls to send")] = 400,
    rate: Annotated[float, typer.Option(min=0.001, help="rate: calls per second")] = 10.0,
    poisson: Annotated[bool, typer.Option(help="rate: Poisson arrivals instead of evenly spaced")] = False,
    seed: Annotated[int, typer.Option(help="seed of the traffic plan")] = 0,
    procs: Annotated[int, typer.Option(min=1, help="generator processes")] = 1,
    rounds: Annotated[int, typer.Option(min=1, help="rounds per target (alternating with --compare: A B, B A, "
                                                    "...)")] = 1,
    slots: Annotated[int | None, typer.Option(min=1, help="slots of the targets the bench starts")] = None,
    limit: Annotated[bool, typer.Option("--limit", help="measure the workload's physical limit here (its "
                                                        "programs' CPU time over this machine's cores), before and "
                                                        "after the rounds; or alone, with no --target")] = False,
    write_expect: Annotated[Path | None, typer.Option(help="with --limit: write each call's outcome here")] = None,
    out: Annotated[Path, typer.Option(help="where bench-TIME.json (every figure) and bench-TIME.png (latency "
                                           "CDF, throughput over time) go")] = Path("."),
    http_timeout: Annotated[float, typer.Option(min=1, help="seconds to wait for one answer")] = 300.0,
) -> None:
    """Load-test a sandbox with GRPO-shaped rollout traffic (--mode grpo), a fixed number of calls in
    flight (concurrency) or a fixed rate (rate), and report throughput (calls the service ran per
    second, from the round's first call: the progress bar shows the same figure so far), latency
    (queue wait, run time, overhead), step makespan and correctness. Exit status 1 if a call was
    answered wrongly or not run, 2 if the bench could not run."""
    from codeenv.bench.apis import APIS
    from codeenv.bench.main import Options, run_bench
    from codeenv.bench.traffic import Scenario, Think

    if target is None and not limit:
        raise _fail("give --target (a URL, or codeenv / naive / naive-jail / codeenv-redis), or --limit")
    for name in (api, compare_api or api):
        if name not in APIS:
            raise _fail(f"unknown API {name!r}: choose from {', '.join(APIS)}")
    if mode not in ("grpo", "concurrency", "rate"):
        raise _fail(f"unknown mode {mode!r}: choose from grpo, concurrency, rate")
    if write_expect and not limit:
        raise _fail("--write-expect needs --limit (the limit run records each call's outcome)")
    if mode == "grpo" and procs > prompts * samples:
        raise _fail(f"--procs {procs} is more than the {prompts * samples} trajectories of a step")
    if mode == "concurrency" and procs > concurrency:
        raise _fail(f"--procs {procs} is more than the {concurrency} calls in flight (--concurrency)")
    try:
        scenario = Scenario(mode, prompts, samples, turns, steps, Think.parse(think), concurrency, calls, rate,
                            poisson, seed)
    except ValueError as exc:
        raise _fail(exc) from exc
    options = Options(target, api, compare, compare_api, workload, expect, check, scenario, procs, rounds, slots,
                      limit, write_expect, out, http_timeout)
    console = Console()
    try:
        status = run_bench(options, console)
    except (CodeenvError, OSError) as exc:  # bench's own (errors.BenchError) included
        raise _fail(str(exc)) from exc
    except KeyboardInterrupt:
        raise _fail("interrupted") from None
    raise typer.Exit(status)


@app.command(hidden=True)
def baseline(
    design: Annotated[str, typer.Argument(help="naive (a fresh python3 per call) or naive-jail (nsjail + python3)")],
    port: Annotated[int, typer.Option(help="port to bind on 127.0.0.1")] = 8001,
    slots: Annotated[int | None, typer.Option(help="calls at once (default: one per core)")] = None,
) -> None:
    """A baseline design behind codeenv's gateway, for `codeenv bench` to compare against."""
    import uvicorn

    from codeenv.api import create_app
    from codeenv.bench.baseline import DESIGNS, BaselineQueue

    if design not in DESIGNS:
        raise _fail(f"unknown baseline {design!r}: choose from {', '.join(DESIGNS)}")
    settings = GatewaySettings(port=port)
    if slots:
        settings = settings.model_copy(update={"slots": slots})
    _setup_logging("text")
    logging.getLogger("codeenv").setLevel(logging.WARNING)
    uvicorn.run(create_app(settings, BaselineQueue(design, settings)), host="127.0.0.1", port=port,
                log_level="warning")


@app.command(hidden=True)
def pool(
    socket: Annotated[Path, typer.Option(help="Unix socket to serve the gateways on")],
    log_format: Annotated[str, typer.Option(help=LOG_FORMAT_HELP, envvar=logs.ENV)] = "json",
) -> None:
    """The host's slot pool behind `serve --processes N` (without Redis)."""
    from codeenv.topology import run_pool

    _setup_logging(log_format)
    try:
        run_pool(GatewaySettings(), socket)
    except (CodeenvError, OSError) as exc:
        raise _fail(str(exc)) from exc


@app.command()
def worker(
    redis: Annotated[str, typer.Option(help="Redis URL of the queue", envvar="CODEENV_REDIS_URL")],
    slots: Annotated[int | None, typer.Option(help="concurrent calls (default: one per core)")] = None,
    log_format: Annotated[str, typer.Option(help=LOG_FORMAT_HELP, envvar=logs.ENV)] = "json",
    log_level: Annotated[str, typer.Option(help="info, or debug: also one line per call started")] = "info",
) -> None:
    """Run a worker: claim calls from the Redis Streams queue and run them in a local slot pool.

    SIGTERM or SIGINT: stop claiming, hand unstarted calls back, let running ones finish within
    CODEENV_SHUTDOWN_GRACE_S; a second signal stops at once.
    """
    from codeenv.settings import QueueSettings
    from codeenv.topology import prepare_jails, run_worker

    _setup_logging(log_format)
    logging.getLogger("codeenv").setLevel(log_level.upper())
    try:
        given = {"redis_url": redis, "slots": slots}
        settings = QueueSettings(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
    except ValueError as exc:
        raise _fail(exc) from exc
    try:
        prepare_jails(settings, _log_progress)
        run_worker(settings)
    except (CodeenvError, OSError) as exc:
        raise _fail(str(exc)) from exc


@app.command()
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    cgroup_root: Annotated[Path | None, typer.Option(
        help="cgroup mount to judge [default: CODEENV_CGROUP_ROOT, else /sys/fs/cgroup]")] = None,
    slots: Annotated[int | None, typer.Option(help="slots to size for (default: CODEENV_SLOTS, else one per core)")]
    = None,
) -> None:
    """Check what this host offers a worker (namespaces, cgroups, seccomp, nsjail, image, memory for
    the slots, uids, swap, BPF) and say what is missing; exit status 1 if the worker could not run."""
    from codeenv.doctor import render, run_checks, to_json

    try:
        given = {"cgroup_root": cgroup_root, "slots": slots}
        settings = SandboxSettings(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
    except ValueError as exc:
        raise _fail(exc) from exc
    report = run_checks(settings)
    if as_json:
        print(to_json(report))
    else:
        render(report, Console())
    raise typer.Exit(0 if report.ok else 1)


@image_app.command("build")
def image_build(
    name: Annotated[str, typer.Argument(help="image or toolchain name, or path to its .toml")] = "python-math",
) -> None:
    """Build a sandbox image or a compiler toolchain (if its declaration changed since the last build)."""
    from codeenv.sandbox.image import ensure_image
    from codeenv.sandbox.toolchain import ensure_toolchain, is_toolchain

    settings = SandboxSettings(image=name, slots=1)
    try:
        if is_toolchain(name):
            toolchain = ensure_toolchain(name, settings.images_dir, progress=_progress)
            print(f"{toolchain.spec.name} {toolchain.content_hash} {toolchain.root}")
            return
        built = ensure_image(settings, progress=_progress)
    except CodeenvError as exc:
        raise _fail(str(exc)) from exc
    print(f"{built.name} {built.content_hash} {built.root}")


@image_app.command("syscalls")
def image_syscalls(
    name: Annotated[str, typer.Argument(help="image name")] = "python-math",
    program: Annotated[list[Path] | None, typer.Option(
        "--program", help="a program of your own to run as well (repeatable)")] = None,
    write: Annotated[bool, typer.Option("--write", help="add what was missing to the image's syscalls.txt")] = False,
) -> None:
    """Regenerate an image's seccomp allowlist: run the probes, the bench workloads and your programs
    in audit mode and print the system calls they made outside the list (needs the kernel log)."""
    from codeenv.sandbox import seccomp
    from codeenv.sandbox.syscall_audit import PROBES, audit, syscall_names, workload_programs

    try:
        programs = {**PROBES, **workload_programs(), **{str(p): p.read_text() for p in program or []}}
        logged, statuses = asyncio.run(audit(SandboxSettings(image=name), programs))
        path = seccomp.syscalls_file(name)
        allowed = set(seccomp.read_allowlist(path))
    except (CodeenvError, OSError) as exc:
        raise _fail(str(exc)) from exc
    for label, status in statuses.items():
        if status != "ok":
            err.print(f"[yellow]{escape(label)}[/]: {escape(status)}")
    names = syscall_names()
    refused = set(seccomp.KILLED) | set(seccomp.NEVER_ALLOWED)  # what no list may allow
    missing = sorted({names.get(number, f"SYSCALL[{number}]") for number in logged} - allowed - refused)
    print("\n".join(missing) if missing else f"# every call the programs made is in {path}")
    if write and missing:
        with path.open("a") as out:
            out.write("\n# added by `codeenv image syscalls`\n" + "".join(f"{n}\n" for n in missing))
        err.print(f"added {len(missing)} to {path}")


def main() -> None:
    try:
        app()
    except ValidationError as exc:  # settings from CODEENV_* variables, wherever a command reads them
        err.print(f"[bold red]error:[/] {escape(describe_invalid(exc))}")
        sys.exit(2)


if __name__ == "__main__":
    main()
