"""Problem packages judged by reference: uploaded once, kept on disk, fetched where they are missing.

A problem's package (`models.ProblemPackage`: tests, checker, graders, limits) is named by the
sha256 of its JSON body. The gateway that takes `PUT /v1/problems/{sha256}` streams the body to its
disk (never into its heap), checks the name, and has a child process validate it under a cap on
its address space (`python -m codeenv.problems`); the package and its test count are then kept
under `problem_dir`, least recently used removed first past `problem_cache_mb`.

A judged call naming it (`/v1/judge` with `problem`) leaves the gateway with the count (admission
counts the tests) and a URL of that gateway signed for that one package: a ticket, the HMAC of its
name under a key kept in the directory, so every process on the host sharing the directory honours
it. The worker takes the package from its own disk (the gateway's own in embedded mode and on one
host), else fetches it from that URL once however many calls wait for it, checks its name, and
keeps it; the last few packages stay parsed in memory. A package never passes through Redis.

Usage::

    store = ProblemStore.from_settings(settings)
    store.refer(call.judge, "http://10.0.0.5:8000")   # the gateway: ProblemUnknown if not held
    call = await store.resolve(call)                   # the worker: the tests filled in
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import os
import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from pydantic import ValidationError

from codeenv.admission import check_tests_size
from codeenv.disk_lru import DiskLRU
from codeenv.errors import InvalidRequest, ProblemUnavailable, ProblemUnknown
from codeenv.models import ExecRequest, JudgeSpec, Limits, ProblemPackage, ProblemRef

if TYPE_CHECKING:
    from codeenv.settings import SandboxSettings

#: A package's file and the file of its test count, by its name.
PACKAGE, COUNT = ".json", ".tests"
#: Parsed packages a worker keeps in memory: at most this many, of at most this many bytes of JSON.
PARSED_KEEP, PARSED_BYTES = 8, 256 << 20
#: What validating a package may take: its parse, in multiples of its size, plus this much; and time.
PARSED_TIMES, PARSED_SLACK_BYTES, VALIDATE_TIMEOUT_S = 4, 256 << 20, 120.0
#: A fetch from the gateway that holds a package.
FETCH_TIMEOUT = httpx.Timeout(30.0, read=120.0)
#: The validator's exit statuses besides 0.
INVALID, TOO_LARGE = 2, 3


def validation_message(exc: ValidationError, most: int = 10) -> str:
    """A package's validation errors in one line (never its text)."""
    errors = exc.errors(include_url=False)
    parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:most]]
    more = f" (and {len(errors) - most} more)" if len(errors) > most else ""
    return "; ".join(parts) + more


class Sink:
    """A file written chunk by chunk as a body arrives (the page cache takes each write at once)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)  # hidden tests

    def write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            view = view[os.write(self.fd, view):]

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


class ProblemStore:
    """Problem packages on this host's disk, by name; the gateway's and the worker's side."""

    def __init__(self, root: Path, cap_bytes: int, max_bytes: int) -> None:
        self.files = DiskLRU(root, cap_bytes)
        self.max_bytes = max_bytes
        self._key: bytes | None = None
        self._parsed: collections.OrderedDict[str, tuple[ProblemPackage, int]] = collections.OrderedDict()
        self._loading: dict[str, asyncio.Future[ProblemPackage]] = {}
        self._http: httpx.AsyncClient | None = None
        self.fetched = 0  # packages this process fetched from a gateway

    @classmethod
    def from_settings(cls, settings: SandboxSettings) -> ProblemStore:
        root = settings.problem_dir or settings.state_dir / "problems"
        return cls(root, settings.problem_cache_mb << 20, settings.problem_max_mb << 20)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # --- the gateway's side -----------------------------------------------------------------------

    def tests(self, sha256: str) -> int | None:
        """How many tests the package named `sha256` holds, or None if it is not held here."""
        if not self.files.touch(sha256 + PACKAGE):
            return None
        count = self.files.read(sha256 + COUNT)
        return int(count) if count is not None and count.strip().isdigit() else None

    def path(self, sha256: str) -> Path:
        return self.files.path(sha256 + PACKAGE)

    def refer(self, spec: JudgeSpec, base_url: str) -> None:
        """Fill in a judged call's problem: its test count and where to fetch it (this gateway, at
        `base_url`); ProblemUnknown if it is not held here."""
        ref = spec.problem
        assert ref is not None
        count = self.tests(ref.sha256)
        if count is None:
            raise ProblemUnknown(ref.sha256)
        ref.tests = count
        ref.url = f"{base_url.rstrip('/')}/v1/problems/{ref.sha256}?ticket={self.ticket(ref.sha256)}"

    def ticket(self, sha256: str) -> str:
        """What lets a worker fetch the package `sha256` (and nothing else) without the token."""
        return hmac.new(self._ticket_key(), sha256.encode(), hashlib.sha256).hexdigest()

    def ticket_ok(self, sha256: str, given: str) -> bool:
        return hmac.compare_digest(self.ticket(sha256), given)

    def _ticket_key(self) -> bytes:
        if self._key is None:
            path = self.files.root / ".ticket-key"
            if not path.exists():  # made whole, then linked into place: another process reads all or none
                self.files.root.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".ticket-key.{os.getpid()}")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(os.urandom(32))
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, path)
                tmp.unlink()
            self._key = path.read_bytes()
        return self._key

    def temp(self, sha256: str) -> Path:
        """Where an upload of `sha256` is written before it is checked."""
        return self.files.temp(sha256 + PACKAGE)

    def keep(self, sha256: str, tmp: Path, tests: int) -> None:
        """Keep an upload checked and validated as the package `sha256`."""
        self.files.write(sha256 + COUNT, str(tests).encode())
        self.files.adopt(sha256 + PACKAGE, tmp)

    async def validate(self, path: Path, settings: SandboxSettings) -> int:
        """The test count of the package at `path`; InvalidRequest saying what is wrong with it. It is
        parsed in a child process whose address space may grow by PARSED_TIMES its size and no more."""
        allowance = PARSED_TIMES * path.stat().st_size + PARSED_SLACK_BYTES
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "codeenv.problems", str(path), str(settings.judge_max_tests),
            str(settings.judge_max_bytes), str(allowance),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), VALIDATE_TIMEOUT_S)
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            if isinstance(exc, TimeoutError):
                raise InvalidRequest(f"the package took over {VALIDATE_TIMEOUT_S:g}s to validate") from None
            raise
        if proc.returncode == 0:
            return int(out)
        if proc.returncode == INVALID:
            raise InvalidRequest(f"the package is not a problem: {err.decode(errors='replace')[:4000].strip()}")
        if proc.returncode == TOO_LARGE:
            raise InvalidRequest(f"the package would take more than {PARSED_TIMES} times its size once parsed")
        raise ProblemUnavailable(f"validating the package failed (exit {proc.returncode}): "
                                 f"{err.decode(errors='replace')[-2000:].strip()}")

    # --- the worker's side ------------------------------------------------------------------------

    async def resolve(self, request: ExecRequest) -> ExecRequest:
        """A judged call by reference with its problem filled in (tests, checker, graders, the
        package's limits under the call's own); ProblemUnknown, ProblemUnavailable, or
        InvalidRequest when the package cannot judge this submission."""
        spec = request.judge
        assert spec is not None and spec.problem is not None
        package = await self.package(spec.problem)
        limits = {**package.limits.model_dump(exclude_none=True), **request.limits.model_dump(exclude_none=True)}
        filled = JudgeSpec(tests=package.tests, fn_name=package.fn_name, compare=package.compare,
                           float_tol=package.float_tol, stop_on_failure=spec.stop_on_failure,
                           total_wall_s=spec.total_wall_s or package.total_wall_s, language=spec.language,
                           checker=package.checker, subtasks=package.subtasks, time_scale=spec.time_scale,
                           interactor=package.interactor, input_mode=package.input_mode)
        try:
            return ExecRequest.model_validate({**dict(request), "judge": filled, "limits": Limits(**limits),
                                               "graders": package.graders})
        except ValidationError as exc:
            raise InvalidRequest(f"problem {spec.problem.sha256} cannot judge this submission: "
                                 f"{validation_message(exc)}") from None

    async def package(self, ref: ProblemRef) -> ProblemPackage:
        """The parsed package `ref` names: from memory, this host's disk, or fetched once."""
        hit = self._parsed.get(ref.sha256)
        if hit is not None:
            self._parsed.move_to_end(ref.sha256)
            self.files.touch(ref.sha256 + PACKAGE)
            return hit[0]
        loading = self._loading.get(ref.sha256)
        if loading is None:
            loading = asyncio.ensure_future(self._load(ref))
            self._loading[ref.sha256] = loading
            loading.add_done_callback(lambda _: self._loading.pop(ref.sha256, None))
        return await asyncio.shield(loading)

    async def _load(self, ref: ProblemRef) -> ProblemPackage:
        name = ref.sha256 + PACKAGE
        if not self.files.touch(name):
            if ref.url is None:
                raise ProblemUnknown(ref.sha256)
            await self._fetch(ref)
        try:
            data = await asyncio.to_thread(self.files.path(name).read_bytes)
        except OSError:  # removed since (the cache's LRU)
            raise ProblemUnknown(ref.sha256, " (it was removed from this worker's disk)") from None
        try:
            package = await asyncio.to_thread(ProblemPackage.model_validate_json, data)
        except ValidationError as exc:
            raise InvalidRequest(f"problem {ref.sha256}'s package is not valid here: "
                                 f"{validation_message(exc)}") from None
        self.files.write(ref.sha256 + COUNT, str(len(package.tests)).encode())
        self._parsed[ref.sha256] = (package, len(data))
        while len(self._parsed) > PARSED_KEEP or sum(size for _, size in self._parsed.values()) > PARSED_BYTES:
            self._parsed.popitem(last=False)
        return package

    async def _fetch(self, ref: ProblemRef) -> None:
        """Fetch the package from the gateway that holds it, into this worker's disk."""
        assert ref.url is not None
        where = ref.url.split("?", 1)[0]
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=FETCH_TIMEOUT, trust_env=False)
        tmp = self.temp(ref.sha256)
        digest = hashlib.sha256()
        size = 0
        try:
            try:
                async with self._http.stream("GET", ref.url) as response:
                    if response.status_code == 404:
                        raise ProblemUnknown(ref.sha256, " (the gateway it was uploaded to holds it no more)")
                    if response.status_code != 200:
                        raise ProblemUnavailable(f"fetching problem {ref.sha256} from {where} was answered "
                                                 f"{response.status_code}")
                    with Sink(tmp) as sink:
                        async for chunk in response.aiter_bytes():
                            size += len(chunk)
                            if size > self.max_bytes:
                                raise ProblemUnavailable(f"problem {ref.sha256} from {where} is over "
                                                         f"{self.max_bytes} bytes")
                            digest.update(chunk)
                            sink.write(chunk)
            except httpx.HTTPError as exc:
                raise ProblemUnavailable(f"problem {ref.sha256} could not be fetched from {where}: {exc!r} (the "
                                         "gateway's public_url, CODEENV_PUBLIC_URL, must be an address its "
                                         "workers reach)") from None
            if digest.hexdigest() != ref.sha256:
                raise ProblemUnavailable(f"the package fetched from {where} is not problem {ref.sha256}")
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self.files.adopt(ref.sha256 + PACKAGE, tmp)
        self.fetched += 1


def _validate(path: str, max_tests: int, max_bytes: int, allowance: int) -> int:
    """The validator's work: exit INVALID with why on stderr, TOO_LARGE, or print the test count."""
    with open(path, "rb") as f:
        data = f.read()
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + allowance if hard == resource.RLIM_INFINITY else min(hard, mapped + allowance)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        package = ProblemPackage.model_validate_json(data)
    except ValidationError as exc:
        print(validation_message(exc), file=sys.stderr)
        return INVALID
    except MemoryError:
        return TOO_LARGE
    if len(package.tests) > max_tests:
        print(f"{len(package.tests)} tests; the limit is {max_tests}", file=sys.stderr)
        return INVALID
    try:
        check_tests_size(package.tests, package.fn_name, max_bytes)
    except InvalidRequest as exc:
        print(exc, file=sys.stderr)
        return INVALID
    print(len(package.tests))
    return 0


if __name__ == "__main__":
    sys.exit(_validate(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
