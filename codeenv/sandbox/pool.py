"""The slot pool: N slots, each one call at a time, each with a warm zygote per image profile.

A slot owns one unprivileged host uid and, per profile, one jail with its own cgroup. A call takes
any free slot and runs in that slot's zygote of the lightest profile that covers its imports. After
the call the slot is wiped and verified from outside before it serves again; a slot that fails a
check, or whose zygote dies, is recycled.

Usage::

    async with SlotPool(SandboxSettings()) as pool:
        result = await pool.run(ExecRequest(code="print(1)"))
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import resource
import shutil
import signal
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

from codeenv.admission import admit, decoded_files, judge_limits
from codeenv.errors import ImageError, InvalidRequest, PoolClosed, ProblemUnavailable, SandboxError, ZygoteDied
from codeenv.models import (
    CheckerSpec,
    CompileInfo,
    ExecRequest,
    ExecResult,
    JudgeOutcome,
    Language,
    LimitValues,
    Status,
    TestResult,
    TestStatus,
)
from codeenv.problems import ProblemStore
from codeenv.sandbox import inside
from codeenv.sandbox.budget import session_budget
from codeenv.sandbox.cgroups import CgroupTree, JailCgroup, owner_alive
from codeenv.sandbox.checker import Check, Checkers, Interaction, Prepared
from codeenv.sandbox.compiler import Compiled, Compiler
from codeenv.sandbox.image import Image, Profile, Progress, ensure_image
from codeenv.sandbox.jail import JAIL_PACKAGE, ZYGOTE_PROC, check_traversable, nsjail_binary
from codeenv.sandbox.judge import judge
from codeenv.sandbox.outside.call_io import Outcome
from codeenv.sandbox.outside.calls import NETWORK_USED, CallJail
from codeenv.sandbox.probe import probe_jail
from codeenv.sandbox.routing import choose_profile
from codeenv.sandbox.sessions import SessionManager, cells_at_once
from codeenv.sandbox.sizing import SlotPlan, apply_plan, memory_allowance, plan_slots
from codeenv.sandbox.uids import (
    CHECKER_UIDS,
    FAMILY_UIDS,
    SESSION_ROOT_UIDS,
    UidBlock,
    check_uids_free,
    check_uids_mapped,
    check_user_namespace,
    claim_for,
    uids_needed,
)
from codeenv.sandbox.verdict import classify
from codeenv.settings import SandboxSettings

logger = logging.getLogger(__name__)

#: How often idle zygotes are pinged; a silent one is replaced.
SUPERVISE_EVERY_S = 5.0
_pool_ids = itertools.count()
#: Attempts for a call whose zygote died before it started (it is safe to run it elsewhere).
MAX_DISPATCH = 3


class Slot:
    """One concurrency unit: an unprivileged uid and a zygote per profile."""

    def __init__(self, index: int, zygotes: dict[str, CallJail], worker: str) -> None:
        self.index = index
        self.zygotes = zygotes
        self.worker = f"{worker}/slot{index}"
        self.restarts = 0

    async def start(self) -> None:
        await asyncio.gather(*(z.start() for z in self.zygotes.values()))

    async def stop(self) -> None:
        await asyncio.gather(*(z.stop() for z in self.zygotes.values()))

    async def recycle(self, zygote: CallJail, reason: str) -> None:
        logger.warning("recycling %s (%s): %s", self.worker, zygote.profile.name, reason)
        self.restarts += 1
        await zygote.stop()
        await zygote.start()


class _DeadlinePassed(Exception):
    """A call's start deadline passed after it got its slot (the slot needed a new zygote first)."""


@dataclasses.dataclass
class _Ran:
    """What a call did on its slot: compiled (C++), then judged or run, or neither if it did not compile."""
    compiled: Compiled | None = None
    judged: JudgeOutcome | None = None
    problem: str | None = None  # why the judged jail must be recycled
    outcome: Outcome | None = None
    checker_failed: CompileInfo | None = None  # the problem's checker does not compile: nothing ran
    helper: str = "checker"  # or its interactor


class _SlotBroker:
    """Hands free slots to waiting calls in FIFO order; a call may ask for one particular slot."""

    def __init__(self) -> None:
        self._free: list[Slot] = []
        self._waiters: collections.deque[asyncio.Future[Slot]] = collections.deque()
        self._pinned: dict[int, collections.deque[asyncio.Future[Slot]]] = {}
        self.closed = False

    def close(self) -> None:
        """Fail every waiting call: the pool is going away."""
        self.closed = True
        for queue in (self._waiters, *self._pinned.values()):
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_exception(PoolClosed("the slot pool is shutting down"))

    def __len__(self) -> int:
        return len(self._free)

    async def acquire(self, index: int | None = None) -> Slot:
        if self.closed:
            raise PoolClosed("the slot pool is shutting down")
        for slot in self._free:
            if index is None or slot.index == index:
                self._free.remove(slot)
                return slot
        fut: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        queue = self._waiters if index is None else self._pinned.setdefault(index, collections.deque())
        queue.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # handed a slot just as we were cancelled: pass it on
            raise

    def release(self, slot: Slot) -> None:
        for queue in (self._pinned.get(slot.index), self._waiters):
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(slot)
                    return
        self._free.append(slot)


class SlotPool:
    """A pool of warm, jailed zygotes that runs calls with hard limits and structured results."""

    def __init__(self, settings: SandboxSettings | None = None, progress: Progress | None = None,
                 profiles: Collection[str] | None = None) -> None:
        """`profiles`: start only these profiles' zygotes (all the image declares when None), and
        route calls among them; `codeenv run` starts the one profile its program needs."""
        self.settings = settings or SandboxSettings()
        self.progress = progress
        self._wanted = None if profiles is None else list(profiles)
        #: The profiles whose zygotes run (set at start).
        self.profiles: list[Profile] = []
        self.image: Image | None = None
        self.slots: list[Slot] = []
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self._free = _SlotBroker()
        self._tree: CgroupTree | None = None
        self._runtime: Path | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._supervisor: asyncio.Task[None] | None = None
        self._open = False
        self.stats: Counter[str] = Counter()  # results by status
        self.calls_started = 0  # calls that reached a zygote (what "ran once" is counted by)
        self.seccomp_kills = 0  # calls and cells ended by the seccomp filter (SIGSYS)
        self.plan: SlotPlan | None = None  # the sizing rule's arithmetic at start
        #: Slot i runs as host uid uid_base + i: settings.uid_base, or the block claimed at start.
        self.uid_base = self.settings.uid_base or 0
        self._uids: UidBlock | None = None
        self.sessions: SessionManager | None = None
        self.compiler: Compiler | None = None
        self.checkers: Checkers | None = None
        self.problems = ProblemStore.from_settings(self.settings)  # packages judged by reference
        self._side_groups: dict[tuple[int, str], JailCgroup] = {}  # (slot, "compile" or "check")

    # --- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> SlotPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        settings = self.settings
        _raise_open_files()  # each session family holds a socket, a pidfd and its cgroup's files
        self.image = await asyncio.to_thread(ensure_image, settings, self.progress)
        nsjail = nsjail_binary(settings)
        _remove_stale_runtime(settings.runtime_dir)
        tag = f"codeenv-{os.getpid()}-{next(_pool_ids)}"
        self.profiles = ([self.image.profile(name) for name in dict.fromkeys(self._wanted)]
                         if self._wanted is not None else list(self.image.spec.profiles))
        if not self.profiles:
            raise ImageError("a pool needs at least one profile")
        self._tree = CgroupTree.create(settings.cgroup_root, tag)  # also kills dead workers' jails
        try:
            spec = self.image.spec.model_copy(update={"profiles": self.profiles})
            plan = plan_slots(settings, spec, memory_allowance(self._tree.layout))
            slots = apply_plan(plan)  # fewer slots than asked if they would not fit in memory
            self.plan = plan
            sessions_max = _sessions_max(settings, len(self.image.spec.profiles), slots)
            check_user_namespace(settings)
            if settings.uid_base is None:
                self._uids = await asyncio.to_thread(claim_for, settings)
                self.uid_base = self._uids.base
            else:
                check_uids_mapped(settings.uid_base, uids_needed(settings))
                check_uids_free(settings.uid_base, slots)
                self.uid_base = settings.uid_base
            # One jail first: a host that cannot run jails gets one line saying why (StartFailure).
            await asyncio.to_thread(probe_jail, settings, self.image, nsjail, self.uid_base)
        except SandboxError:
            self._tree.remove()
            self._tree = None
            if self._uids is not None:
                self._uids.release()
                self._uids = None
            raise
        self._runtime = settings.runtime_dir / tag
        zygote_dir = self._runtime / "zygote"
        zygote_dir.mkdir(parents=True, exist_ok=True)
        for d in (settings.state_dir, settings.runtime_dir, self._runtime, zygote_dir):
            os.chmod(d, 0o755)
        _copy_jail_package(zygote_dir / JAIL_PACKAGE)
        (zygote_dir / ZYGOTE_PROC).mkdir(mode=0o755, exist_ok=True)  # a call jail's zygote mounts a /proc there
        check_traversable(self.image.root)
        check_traversable(zygote_dir)
        for i in range(slots):
            zygotes = {
                profile.name: CallJail(
                    settings, self.image, profile, self.uid_base + i,
                    self._tree.group(f"slot{i}-{profile.name}"), nsjail, self._runtime, zygote_dir,
                )
                for profile in self.profiles
            }
            for z in zygotes.values():
                z.on_death = self._zygote_died
            self.slots.append(Slot(i, zygotes, self.worker))
        try:
            await asyncio.gather(*(slot.start() for slot in self.slots))
        except BaseException:
            await self.close()
            raise
        for slot in self.slots:
            self._free.release(slot)
        self.compiler = Compiler(settings, self._runtime)
        self.checkers = Checkers(settings, self.compiler, self.image, self._runtime)
        self.sessions = SessionManager(
            settings, self.image, self._tree, self.uid_base + SESSION_ROOT_UIDS, self.uid_base + FAMILY_UIDS, nsjail,
            self._runtime, zygote_dir, self.worker,
            lambda request, result, profile: self._finish(request, result, None, profile, 0.0),
            sessions_max=sessions_max, cells_at_once=cells_at_once(slots))
        self.sessions.start()
        self._check_measured_memory(plan)
        self._open = True
        self._supervisor = asyncio.create_task(self._supervise(), name="codeenv-supervisor")
        logger.info("slot pool ready: %d slots x %d profiles, image %s (%s), host uids from %d%s", len(self.slots),
                    len(self.profiles), self.image.name, self.image.short_hash, self.uid_base,
                    f" (block {self._uids.path.name})" if self._uids is not None else " (CODEENV_UID_BASE)")

    def _check_measured_memory(self, plan: SlotPlan) -> None:
        """Warn if the zygotes turned out heavier than estimated and the slots no longer fit."""
        measured_mb = max(sum(z.baseline_memory for z in s.zygotes.values()) for s in self.slots) >> 20
        if measured_mb <= plan.zygote_mb:
            return
        actual = SlotPlan(len(self.slots), len(self.slots), measured_mb, plan.call_mb, plan.allowance)
        if actual.needed_mb > actual.allowance.limit_mb:
            logger.warning("memory: a slot's zygotes take %d MB, not the %d MB estimated: %s exceeds %s; set "
                           "CODEENV_ZYGOTE_MEMORY_MB=%d, and the pool starts only the slots that fit",
                           measured_mb, plan.zygote_mb, actual.arithmetic, actual.room, measured_mb)

    async def close(self) -> None:
        self._open = False
        self._free.close()
        if self.sessions is not None:
            await self.sessions.close()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(BaseException):
                await self._supervisor
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(slot.stop() for slot in self.slots), return_exceptions=True)
        for slot in self.slots:
            for z in slot.zygotes.values():
                await asyncio.to_thread(z.cgroup.remove)
        for group in self._side_groups.values():
            await asyncio.to_thread(group.remove)
        self._side_groups = {}
        await self.problems.close()
        if self._tree is not None:
            self._tree.remove()
        if self._runtime is not None:
            shutil.rmtree(self._runtime, ignore_errors=True)
        if self._uids is not None:  # after the last jail is gone: its uids are free now
            self._uids.release()
            self._uids = None
        logger.info("slot pool closed: %s; %d slot restarts",
                    dict(self.stats) or "no calls", self.restarts)
        self.slots = []

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def healthy(self) -> bool:
        """Open, and a zygote is alive to run calls."""
        return self._open and any(not z.dead for s in self.slots for z in s.zygotes.values())

    def figures(self, taking: bool = True) -> dict[str, float]:
        """Its capacity and safety figures for the live page and /metrics: up, slots, free slots, jail
        recycles, calls run, OOM kills (calls and cells ended `memory`: only the kernel's OOM event says
        so), seccomp kills (ended by SIGSYS), memory its jails and sessions use now against the memory
        the sizing rule allowed and the rule's worst case (slots x (zygotes + largest call)), and its
        sessions' figures (none taken unless `taking`)."""
        memory = 0
        with contextlib.suppress(OSError, ValueError):
            memory = self._tree.memory_usage() if self._tree is not None else 0
        plan = self.plan
        out: dict[str, float] = {
            "up": float(self.healthy), "slots": len(self.slots), "free_slots": self.free_slots,
            "slot_restarts": self.restarts, "calls_run": self.calls_started, "oom_kills": self.stats["memory"],
            "seccomp_kills": self.seccomp_kills, "memory_bytes": memory,
            "memory_allowance_bytes": plan.allowance.limit_mb << 20 if plan is not None else 0,
            "memory_needed_bytes": len(self.slots) * plan.slot_mb << 20 if plan is not None else 0}
        if self.sessions is not None:
            out.update(self.sessions.figures(taking))
        return out

    @property
    def restarts(self) -> int:
        return sum(slot.restarts for slot in self.slots)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # --- calls ----------------------------------------------------------------------------------

    def resolve(self, request: ExecRequest) -> tuple[bytes, bytes, LimitValues, Profile]:
        """Validate a request against the server's caps; raise InvalidRequest saying what to fix."""
        assert self.image is not None
        if request.judge is not None:
            limits, _ = judge_limits(request, self.settings)
            code, stdin = request.code.encode(), b""
        else:
            admitted = admit(request, self.settings)
            code, stdin, limits = admitted.code, admitted.stdin, admitted.limits
        if request.language is Language.cpp:
            assert self.compiler is not None
            try:
                self.compiler.flags(request.preset, request.std)  # the toolchain is here
            except ImageError as exc:
                raise InvalidRequest(f"language cpp: {exc}") from None
            return code, stdin, limits, self._lightest()
        if request.profile is not None:
            try:
                profile = self.image.profile(request.profile)
            except ImageError as exc:
                raise InvalidRequest(str(exc)) from None
            if profile not in self.profiles:
                raise InvalidRequest(f"profile {request.profile!r} is not started in this pool (started: "
                                     f"{', '.join(p.name for p in self.profiles)})")
        else:
            profile = choose_profile(code, self.profiles)
        return code, stdin, limits, profile

    def _lightest(self) -> Profile:
        """The profile a compiled program's jail runs in: any serves (the binary is static); the
        lightest zygote is the cheapest to fork from."""
        return min(self.profiles, key=lambda p: (len(p.preload), p.name))

    async def run(self, request: ExecRequest, *, slot_index: int | None = None,
                  on_dispatch: Callable[[], None] | None = None,
                  before_start: Callable[[], Awaitable[None]] | None = None,
                  accepted_at: float | None = None) -> ExecResult:
        """Run one program. Bad requests raise InvalidRequest; everything else is a result.

        `slot_index` pins the call to one slot (for tests and diagnostics). `on_dispatch` is called
        when the call gets its slot: until then, cancelling it provably runs nothing. `accepted_at`
        (time.monotonic() when the call was accepted upstream) is where its queue wait and deadline
        start. `before_start` is awaited next, with the slot held: it may veto the call by raising
        (the slot is released and the exception propagates): a distributed worker marks the job
        started there, or learns that it must not run.
        """
        if not self._open:
            raise PoolClosed("the slot pool is not running")
        if request.session is not None:
            return await self._cell(request, on_dispatch, accepted_at)
        if request.judge is not None and request.judge.problem is not None and not request.judge.tests:
            try:
                request = await self.problems.resolve(request)  # before a slot: a fetch holds none
            except ProblemUnavailable as exc:
                return self._finish(request, ExecResult(status=Status.internal_error, started=False,
                                                        message=str(exc)), None, self._lightest(), 0.0)
        code, stdin, limits, profile = self.resolve(request)
        files = decoded_files(request, self.settings) if request.files else None
        fetch = list(dict.fromkeys(request.fetch_files)) or None
        # The queue wait (and the deadline) count from when the call was accepted upstream.
        queued = time.monotonic() if accepted_at is None else accepted_at
        for attempt in range(1, MAX_DISPATCH + 1):
            slot = await self._acquire(request, slot_index, queued)
            if slot is None:
                return self._finish(request, ExecResult(
                    status=Status.overloaded, started=False,
                    message=f"no slot became free within the deadline of {request.deadline_s:g}s; not run",
                ), None, profile, time.monotonic() - queued)
            queue_s = time.monotonic() - queued
            if on_dispatch is not None:
                on_dispatch()
            if before_start is not None:
                try:
                    await before_start()
                except BaseException:  # a veto: the call must not run here
                    self._free.release(slot)
                    raise
            zygote = slot.zygotes[profile.name]
            zygote.busy = True
            try:
                ran = await self._run_in(slot, zygote, request, code, stdin, limits, files, fetch, queued)
            except _DeadlinePassed:
                self._give_back(slot, zygote)  # nothing ran: the slot goes back as it is
                return self._finish(request, ExecResult(
                    status=Status.overloaded, started=False,
                    message=f"the call could not start within its deadline of {request.deadline_s:g}s; not run",
                ), slot, profile, time.monotonic() - queued)
            except ZygoteDied as exc:
                # Provably never started: safe to hand to another slot.
                logger.warning("%s: call not started (%s); attempt %d", slot.worker, exc, attempt)
                self._release(slot, zygote, "the zygote died before the call started")
                continue
            except SandboxError as exc:
                self._release(slot, zygote, str(exc))
                return self._finish(request, ExecResult(
                    status=Status.internal_error, started=False, message=str(exc)), slot, profile, queue_s)
            except Exception as exc:  # our own fault (e.g. out of fds): say so, recycle the jail
                logger.exception("%s failed on a call", slot.worker)
                self._release(slot, zygote, f"the worker failed on a call: {exc!r}")
                return self._finish(request, ExecResult(
                    status=Status.internal_error, started=True,  # it may have reached the zygote
                    message=f"the worker failed on this call: {exc!r}"), slot, profile, queue_s)
            except BaseException:
                self._release(slot, zygote, "the call was cancelled")
                raise
            return self._finish(request, self._answer(slot, zygote, request, ran, limits, fetch,
                                                      time.monotonic() - queued - queue_s), slot, profile, queue_s)
        return self._finish(request, ExecResult(
            status=Status.internal_error, started=False,
            message=f"no slot could start the call after {MAX_DISPATCH} attempts"), None, profile, 0.0)

    async def _run_in(self, slot: Slot, zygote: CallJail, request: ExecRequest, code: bytes, stdin: bytes,
                      limits: LimitValues, files: list[tuple[str, bytes]] | None, fetch: list[str] | None,
                      queued: float) -> _Ran:
        """The call on its slot, under its zygote's lock: compiled first if it is C++, then run or judged."""
        async with zygote.lock:
            if zygote.dead:
                await slot.recycle(zygote, "its zygote had died")
            if request.deadline_s is not None and time.monotonic() - queued > request.deadline_s:
                raise _DeadlinePassed  # e.g. replacing a dead zygote took too long
            ran, program = _Ran(), code
            if request.language is Language.cpp:  # compiled again only if the slot changes
                ran.compiled = await self._compile(slot, code, request)
                if ran.compiled.binary is None:
                    return ran  # answered by _answer: nothing runs in the jail
                program = ran.compiled.binary
            if request.judge is not None:
                helpers: list[Prepared | None] = []  # the problem's checker and interactor, compiled once
                for spec in (request.judge.checker, request.judge.interactor):
                    prepared = None if spec is None else await self._checker(
                        slot, spec if isinstance(spec, CheckerSpec) else spec.as_checker())
                    if isinstance(prepared, CompileInfo):
                        ran.checker_failed, ran.helper = prepared, "checker" if spec is request.judge.checker \
                            else "interactor"
                        return ran
                    helpers.append(prepared)
                ran.judged, ran.problem = await self._judge(slot, zygote, program, request, limits, *helpers)
            else:
                # Always pre-fork the next child: a child forked on demand must wait for the
                # worker to raise its OOM score (a round trip per call), which costs more at
                # saturation than handing the call to a spare (measured: benchmarks/README.md).
                ran.outcome = await zygote.run(program, stdin, limits, prefork_next=True, files=files, fetch=fetch,
                                               display_last=request.display_last, binary=ran.compiled is not None)
            return ran

    def _answer(self, slot: Slot, zygote: CallJail, request: ExecRequest, ran: _Ran, limits: LimitValues,
                fetch: list[str] | None, wall_s: float) -> ExecResult:
        """The result of a call that ran on its slot (or failed to compile there); the slot goes back."""
        compile_info = ran.compiled.info if ran.compiled is not None else None
        if ran.checker_failed is not None:
            self._give_back(slot, zygote)
            return ExecResult(status=Status.internal_error, started=False, wall_s=round(wall_s, 6),
                              message=f"the problem's {ran.helper} does not compile (no test ran): "
                                      f"{ran.checker_failed.message or ''} {ran.checker_failed.stderr[-4000:]}".strip())
        if ran.compiled is not None and ran.compiled.binary is None:
            self._give_back(slot, zygote)
            assert compile_info is not None
            return _not_compiled(request, compile_info, wall_s)
        if ran.judged is not None:  # its jail is checked already
            self._release_checked(slot, zygote, ran.problem)
            if compile_info is not None:
                ran.judged.compile = compile_info
            return self._judged(ran.judged, wall_s)
        assert ran.outcome is not None
        self._release(slot, zygote, None if ran.outcome.exited is not None else "the call ended abnormally")
        result = _call_result(ran.outcome, limits, fetch)
        result.compile = compile_info
        return result

    async def _cell(self, request: ExecRequest, on_dispatch: Callable[[], None] | None,
                    accepted_at: float | None) -> ExecResult:
        """A session's cell: its session's family runs it, not a slot."""
        assert self.sessions is not None
        if on_dispatch is not None:
            on_dispatch()
        return await self.sessions.execute(request, time.monotonic() if accepted_at is None else accepted_at)

    async def _acquire(self, request: ExecRequest, slot_index: int | None, queued: float) -> Slot | None:
        """A free slot (`slot_index`, if given), or None once the call's deadline has passed."""
        if request.deadline_s is None:
            return await self._free.acquire(slot_index)
        remaining = request.deadline_s - (time.monotonic() - queued)
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                return await self._free.acquire(slot_index)
        except TimeoutError:
            return None

    def _group(self, slot: Slot, kind: str) -> JailCgroup:
        """A cgroup of the slot's own beside its jail's: "compile" or "check"."""
        assert self._tree is not None
        group = self._side_groups.get((slot.index, kind))
        if group is None:
            group = self._side_groups[slot.index, kind] = self._tree.group(f"slot{slot.index}-{kind}")
        return group

    async def _compile(self, slot: Slot, source: bytes, request: ExecRequest) -> Compiled:
        """`source` compiled for this slot's call: from the cache, or in a compile jail running as the
        slot's uid in a cgroup of the slot's own."""
        assert self.compiler is not None
        graders = {name: text.encode() for name, text in request.graders.items()} or None
        return await self.compiler.compile(source, request.preset, request.std, self.uid_base + slot.index,
                                           self._group(slot, "compile"), graders)

    def _checker_uid(self, slot: Slot) -> int:
        return self.uid_base + CHECKER_UIDS + slot.index % (FAMILY_UIDS - CHECKER_UIDS)

    async def _checker(self, slot: Slot, spec: CheckerSpec) -> Prepared | CompileInfo:
        """The problem's checker, ready to run for this slot's call (compiled once if it is C++)."""
        assert self.checkers is not None
        return await self.checkers.prepare(spec, self._checker_uid(slot), self._group(slot, "compile"))

    async def _judge(self, slot: Slot, zygote: CallJail, code: bytes, request: ExecRequest, limits: LimitValues,
                     checker: Prepared | None = None,
                     interactor: Prepared | None = None) -> tuple[JudgeOutcome, str | None]:
        """Judge a submission in this slot: its tests one by one, the submission prepared once
        (again only after a test that ended its process). Returns why the jail must be recycled."""
        assert request.judge is not None
        _, total_wall_s = judge_limits(request, self.settings)

        async def restart(reason: str) -> CallJail:
            await slot.recycle(zygote, reason)
            return zygote

        check = None
        if checker is not None:
            checkers, uid, group = self.checkers, self._checker_uid(slot), self._group(slot, "check")
            assert checkers is not None

            async def check(stdin: bytes, output: bytes, answer: bytes) -> Check:
                return await checkers.check(checker, stdin, output, answer, uid, group)

        interact = None
        if interactor is not None:
            helpers, helper_uid, helper_group = self.checkers, self._checker_uid(slot), self._group(slot, "check")
            assert helpers is not None

            spec = request.judge
            manager = spec.interactor is not None and spec.interactor.protocol == "manager"

            async def interact(stdin: bytes, answer: bytes, talk: list[int], wall_s: float) -> Interaction:
                return await helpers.interact(interactor, stdin, answer, talk, wall_s, helper_uid, helper_group,
                                              manager=manager, checked=spec.checker is not None,
                                              manager_args=spec.interactor.manager_args if spec.interactor else None)

        return await judge(zygote, code, request.judge, limits, total_wall_s, restart, check, interact)

    @staticmethod
    def _judged(judged: JudgeOutcome, wall_s: float) -> ExecResult:
        return ExecResult(status=Status.ok, started=True, judge=judged, wall_s=round(wall_s, 6),
                          cpu_s=round(sum(t.cpu_s for t in judged.tests), 6))

    def _release_checked(self, slot: Slot, zygote: CallJail, problem: str | None) -> None:
        """Return a slot whose jail was checked already (None), or recycle it first."""
        if problem is None:
            self._give_back(slot, zygote)
        else:
            self._clean_up_later(slot, zygote, problem)

    def _give_back(self, slot: Slot, zygote: CallJail) -> None:
        """The slot is free again (its jail is as a call needs it)."""
        zygote.busy = False
        if self._open:
            self._free.release(slot)

    def _clean_up_later(self, slot: Slot, zygote: CallJail, problem: str | None) -> None:
        task = asyncio.create_task(self._cleanup(slot, zygote, problem), name=f"{slot.worker}-cleanup")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _finish(self, request: ExecRequest, result: ExecResult, slot: Slot | None, profile: Profile,
                queue_s: float) -> ExecResult:
        assert self.image is not None
        result.id = request.id
        result.queue_s = round(queue_s, 6)
        result.worker = slot.worker if slot else self.worker
        result.profile = profile.name
        result.image = self.image.short_hash
        result.python = self.image.python_version
        self.stats[result.status.value] += 1
        if result.started:
            self.calls_started += 1
            self.seccomp_kills += result.signal == signal.SIGSYS
        return result

    def _release(self, slot: Slot, zygote: CallJail, problem: str | None) -> None:
        """Return the slot to the pool once the call's traces are gone (in the background)."""
        if problem is None and zygote.ready_now and not zygote.lock.locked():
            # The common case: the call left nothing to wipe and the checks need no waiting.
            try:
                problem = zygote.finish_now()
            except Exception as exc:  # e.g. a cgroup file that cannot be read: recycle
                problem = f"checking the jail failed: {exc!r}"
            if problem is None:
                self._give_back(slot, zygote)
                return
        self._clean_up_later(slot, zygote, problem)

    async def _cleanup(self, slot: Slot, zygote: CallJail, problem: str | None) -> None:
        try:
            async with zygote.lock:
                reason = problem if problem is not None else await zygote.finish()
                if reason == NETWORK_USED:  # seen by finish_now, which cannot wait
                    reason = await zygote.renew_network()
                if reason is not None:
                    await slot.recycle(zygote, reason)
        except Exception as exc:  # a slot that cannot restart must not take the pool down
            logger.error("%s could not be restarted: %r", slot.worker, exc)
            await asyncio.sleep(1)
        finally:
            self._give_back(slot, zygote)

    def _zygote_died(self, zygote: CallJail) -> None:
        """A zygote's control socket closed: replace it at once unless a call is handling that."""
        if not self._open or zygote.busy or zygote.lock.locked():
            return  # the call in progress sees the death and recycles the slot itself
        slot = next(s for s in self.slots if zygote in s.zygotes.values())
        task = asyncio.create_task(self._replace(slot, zygote), name=f"{slot.worker}-replace")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _replace(self, slot: Slot, zygote: CallJail) -> None:
        async with zygote.lock:
            if not zygote.dead:
                return
            try:
                await slot.recycle(zygote, "its zygote died while idle")
            except Exception as exc:
                logger.error("%s could not be restarted: %r", slot.worker, exc)

    async def _supervise(self) -> None:
        """Ping idle zygotes; replace the silent or dead ones."""
        while True:
            await asyncio.sleep(SUPERVISE_EVERY_S)
            for slot in self.slots:
                for zygote in slot.zygotes.values():
                    if zygote.busy or zygote.lock.locked():
                        continue
                    async with zygote.lock:
                        if zygote.busy:
                            continue
                        if zygote.dead or not await zygote.ping():
                            try:
                                await slot.recycle(zygote, "it stopped answering while idle")
                            except Exception as exc:
                                logger.error("%s could not be restarted: %r", slot.worker, exc)


def _remove_stale_runtime(runtime_dir: Path) -> None:
    """Runtime dirs of workers that died without closing their pool."""
    if not runtime_dir.is_dir():
        return
    for d in runtime_dir.glob("codeenv-*"):
        pid = d.name.split("-")[1]
        if pid.isdigit() and not owner_alive(int(pid), d):
            shutil.rmtree(d, ignore_errors=True)


def _call_result(outcome: Outcome, limits: LimitValues, fetch: list[str] | None) -> ExecResult:
    """A plain call's result, with the files it was asked to fetch."""
    result = classify(outcome, limits)
    if fetch is not None:
        result.files = {p: base64.b64encode(d).decode() for p, d in (outcome.fetched or {}).items()}
        result.file_errors = outcome.fetch_errors or ({} if outcome.fetched is not None else
                                                      {p: "the call ended before its files could be read"
                                                       for p in fetch})
    return result


def _copy_jail_package(target: Path) -> None:
    """The in-jail package (sandbox/inside/, standard library only) as the jails mount it: sources
    only, readable by the jails' uids."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(Path(inside.__file__).parent, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    os.chmod(target, 0o755)
    for path in target.iterdir():
        os.chmod(path, 0o644)


def _sessions_max(settings: SandboxSettings, profiles: int, slots: int) -> int:
    """`sessions_max`, held to what the host allows (budget.py): lowered when left at its default,
    refused (SandboxError, one line) when set above it."""
    if settings.sessions_max == 0:
        return 0
    connections = getattr(settings, "max_connections", 2048)  # a gateway's, in embedded mode
    budget = session_budget(settings, jails=(slots + 1) * profiles, connections=connections,
                            cells_at_once=cells_at_once(slots))
    if settings.sessions_max <= budget.sessions:
        return settings.sessions_max
    if "sessions_max" in settings.model_fields_set:
        raise SandboxError(f"CODEENV_SESSIONS_MAX={settings.sessions_max} does not fit this host: {budget.sessions} "
                           f"sessions do, bounded by {budget.binding} (each: {budget.describe()}); lower it")
    logger.info("sessions: at most %d on this host (bounded by %s; each: %s)", budget.sessions, budget.binding,
                budget.describe())
    return budget.sessions


def _raise_open_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _not_compiled(request: ExecRequest, info: CompileInfo, wall_s: float) -> ExecResult:
    """The result of a C++ call whose code did not compile: nothing ran."""
    message = f"compile error: {info.message or 'the code does not compile'}"
    if request.judge is None:
        return ExecResult(status=Status.error, started=False, compile=info, stderr=info.stderr, message=message,
                          wall_s=round(wall_s, 6))
    tests = [TestResult(status=TestStatus.skipped, message="not run: the code does not compile")
             for _ in request.judge.tests]
    judged = JudgeOutcome(total=len(tests), tests=tests, compile=info)
    return ExecResult(status=Status.ok, started=False, judge=judged, compile=info, wall_s=round(wall_s, 6))
