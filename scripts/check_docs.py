"""The docs run as written: every fenced `sh`, `bash` and `python` block of README.md and docs/*.md.

    python scripts/check_docs.py [--list] [FILE...]

Starts the service the docs talk to (`scripts/codeenv serve`, embedded mode, on a free port: every
`127.0.0.1:8000` and `localhost:8000` in a block is rewritten to it), then runs each block from the
repository root with a plain PATH (no virtual environment on it, as on a fresh clone): sh blocks
with `bash -e`, python blocks with the venv's python, each with a timeout. Any non-zero exit fails
the check. Sample output belongs in a `text` fence, which is not run.

A marker, an HTML comment on the line right before a fence, says how a block is run:

    <!-- docs-check: skip: REASON -->        not run, listed with its reason (at most one block in ten)
    <!-- docs-check: servers[: NAME=VALUE ... (REASON)] -->   every command starts a server: each is started, must get
                                             ready (a serve answers /readyz, anything else keeps
                                             running) and is then stopped by PID. Each serve gets a
                                             free port (CODEENV_PORT, or its --port rewritten),
                                             `--host 0.0.0.0` becomes 127.0.0.1, and a private
                                             redis-server stands in for the Redis URLs ($URL,
                                             $WORKER_URL, $GATEWAY_URL, 127.0.0.1:6379) with $TOKEN set.
                                             A command that is no server must exit 0.
    <!-- docs-check: env: NAME=VALUE ... (REASON) -->   run with these variables set (listed)

Everything it starts is stopped by PID at the end. It prints each block's outcome and time, the
skipped and adapted blocks with their reasons, and the total time.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from codeenv.bench.services import Service, free_port, http_ready, start_redis

ROOT = Path(__file__).resolve().parent.parent
DOCS_PORT = 8000
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*docs-check:\s*(skip|servers|env)\s*:?\s*(.*?)\s*-->\s*$")
RUN = {"sh", "bash", "python"}
#: A command's leading variable assignments, before which `exec` goes (its PID is then the server's).
EXEC = re.compile(r"^\s*((?:\w+=\S+\s+)*)")
BLOCK_TIMEOUT_S = 300
READY_TIMEOUT_S = 240


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    text: str
    marker: str | None = None
    argument: str = ""
    outcome: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
        if lang in RUN:
            block = Block(path, i + 1, lang, body + "\n")
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marked = MARKER.match(before)
            if marked:
                block.marker, block.argument = marked.groups()
            found.append(block)
        i = end + 1
    return found


def commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


class Check:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.started: list[Service] = []
        self.redis: Service | None = None

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {"PATH": PATH, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
        return {**env, **(extra or {})}

    def rewrite(self, text: str) -> str:
        return re.sub(rf"\b(127\.0\.0\.1|localhost):{DOCS_PORT}\b", rf"\1:{self.port}", text)

    def start_service(self) -> None:
        log = self.workdir / "service.log"
        service = Service("scripts/codeenv serve", [str(ROOT / "scripts/codeenv"), "serve", "--port", str(self.port)],
                          port=self.port, url=f"http://127.0.0.1:{self.port}", env=self.env(), log=log)
        self.started.append(service.start())
        service.wait_ready(READY_TIMEOUT_S)

    def run(self, block: Block) -> None:
        t0 = time.monotonic()
        try:
            if block.marker == "servers":
                self.run_servers(block)
            else:
                self.run_block(block)
        finally:
            block.seconds = time.monotonic() - t0

    def run_block(self, block: Block) -> None:
        extra = marker_env(block.argument) if block.marker == "env" else {}
        source = self.rewrite(block.text)
        script = self.workdir / f"block-{block.line}.{'py' if block.lang == 'python' else 'sh'}"
        script.write_text(source, encoding="utf-8")
        argv = [str(ROOT / ".venv/bin/python"), str(script)] if block.lang == "python" else ["bash", "-e", str(script)]
        try:
            done = subprocess.run(argv, cwd=ROOT, env=self.env(extra), capture_output=True, text=True,
                                  errors="replace", timeout=BLOCK_TIMEOUT_S, start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            block.outcome = f"FAILED: still running after {BLOCK_TIMEOUT_S} s"
            block.notes.append(str(exc.stderr or "")[-2000:])
            return
        if done.returncode != 0:
            block.outcome = f"FAILED: exit status {done.returncode}"
            block.notes.append((done.stdout[-1500:] + "\n" + done.stderr[-2500:]).strip())
        else:
            block.outcome = "ok"

    def run_servers(self, block: Block) -> None:
        """Each command starts; a serve gets ready (/readyz 200), anything else keeps running; all stop."""
        needs_redis = re.search(r"redis://127\.0\.0\.1:6379|\$(URL|WORKER_URL|GATEWAY_URL)\b", block.text)
        extra: dict[str, str] = {"TOKEN": secrets.token_hex(24), **marker_env(block.argument)}
        if needs_redis:
            if self.redis is None:
                self.redis = start_redis(log=self.workdir / "redis.log")
            extra.update(URL=self.redis.url, WORKER_URL=self.redis.url, GATEWAY_URL=self.redis.url)
        running: list[tuple[Service, bool]] = []
        try:
            for n, command in enumerate(commands(block.text)):
                port = free_port()
                command = re.sub(r"redis://127\.0\.0\.1:6379", self.redis.url.rsplit("/", 1)[0] if self.redis else "",
                                 command)
                command = re.sub(r"--port\s+\d+", f"--port {port}", command)
                command = re.sub(r"--host\s+0\.0\.0\.0", "--host 127.0.0.1", command)
                serve = " serve" in command
                argv = ["bash", "-ec", EXEC.sub(r"\1exec ", command, count=1)]
                service = Service(f"{block.where} #{n + 1}", argv, port=port, url=f"http://127.0.0.1:{port}",
                                  env=self.env({**extra, "CODEENV_PORT": str(port)}),
                                  log=self.workdir / f"block-{block.line}-{n + 1}.log")
                self.started.append(service.start())
                running.append((service, serve))
                block.notes.append(f"started: {command}")
            deadline = time.monotonic() + READY_TIMEOUT_S
            headers = {"Authorization": f"Bearer {extra['TOKEN']}"}
            for service, serve in running:
                while serve and not (http_ready(service.url) or _ready_with(service.url, headers)):
                    if service.returncode is not None or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
            # A gateway is ready once a worker is (with Redis); anything else must still be running.
            for service, serve in running:
                if service.returncode == 0 and not serve:
                    continue  # a command that is not a server, done
                if service.returncode is not None or (serve and time.monotonic() > deadline):
                    state = "was not ready" if service.returncode is None else f"exited ({service.returncode})"
                    block.outcome = f"FAILED: {service.name} {state}"
                    block.notes.append(service.log_tail(2500))
                    return
            block.outcome = "ok"
        finally:
            for service, _ in reversed(running):
                stop(service)


def marker_env(argument: str) -> dict[str, str]:
    """The NAME=VALUE settings of a marker's argument, before its parenthesised reason."""
    return dict(item.split("=", 1) for item in shlex.split(argument.split("(", 1)[0]) if "=" in item)


def _ready_with(url: str, headers: dict[str, str]) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/readyz", headers=headers, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def stop(service: Service, grace_s: float = 40) -> None:
    """SIGTERM to its process group, then SIGKILL: a server started through a shell leaves nothing."""
    if service.proc is None or service.proc.poll() is not None:
        return
    service.stop(grace_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--list", action="store_true", help="list the blocks and their markers, run nothing")
    args = parser.parse_args()
    files = [p.resolve() for p in args.files] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [b for f in files for b in blocks_of(f)]
    skipped = [b for b in blocks if b.marker == "skip"]
    if args.list:
        for b in blocks:
            print(f"{b.where:28} {b.lang:7} {b.marker or ''} {b.argument}")
        return 0
    t0 = time.monotonic()
    failed = False
    with tempfile.TemporaryDirectory(prefix="codeenv-docs-") as tmp:
        check = Check(Path(tmp))
        try:
            print(f"starting the service: scripts/codeenv serve --port {check.port} (the docs' {DOCS_PORT})",
                  flush=True)
            check.start_service()
            for block in blocks:
                if block.marker == "skip":
                    continue
                check.run(block)
                print(f"{block.outcome.split(':')[0]:6} {block.seconds:6.1f} s  {block.where} ({block.lang}"
                      f"{', ' + block.marker if block.marker else ''})", flush=True)
                if block.outcome != "ok":
                    failed = True
                    print(block.outcome)
                    for note in block.notes:
                        print("    " + note.replace("\n", "\n    "))
        finally:
            for service in reversed(check.started):
                stop(service)
            if check.redis is not None:
                check.redis.kill()
    ran = len(blocks) - len(skipped)
    print(f"\n{ran} blocks run, {len(skipped)} skipped, of {len(blocks)}, in {time.monotonic() - t0:.0f} s")
    for b in blocks:
        if b.marker == "skip":
            print(f"  skipped {b.where}: {b.argument}")
        elif b.marker in ("env", "servers"):
            print(f"  {b.marker} {b.where}: {b.argument or 'started, ready, stopped'}")
    if len(skipped) * 10 > len(blocks):
        print(f"error: {len(skipped)} of {len(blocks)} blocks skipped; at most one in ten may be")
        failed = True
    print("docs check: " + ("FAILED" if failed else "every block ran as written"))
    return 1 if failed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop what was started
    sys.exit(main())
