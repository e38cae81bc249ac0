"""C++ compiled once, in a jail of its own, and kept in a cache keyed by what makes the binary.

A compile runs in a one-shot nsjail that sees only the toolchain (read-only at /, see toolchain.py)
and a work dir holding the source: no /proc, an empty /dev, a fresh /tmp, no network, as the host
uid of the slot that asked for it, in a cgroup of that slot's (its memory cap), with a CPU limit per
process, a wall limit, a cap on the binary's size (RLIMIT_FSIZE) and the first 64 KiB of its
diagnostics kept. The binary is linked statically, so the slot's own jail runs it as it is (exec'd
from a sealed memfd, never written to a file the program could reach).

The cache maps sha256(toolchain hash, flags, source) to the binary or to the compiler's diagnostics
(a compile error is as deterministic as a binary); a compile stopped by a limit is not kept (it may
pass on a quieter host). It lives on the worker's disk under a size cap, the least recently used
entries removed first, and may be shared by the workers of a host (entries are written whole and
renamed into place).

Usage::

    compiler = Compiler(settings)
    compiled = await compiler.compile(source, preset, std, host_uid, cgroup)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from nsjail import Exe, IdMap, MountPt, NsJailConfig, RLimitType
from nsjail.enums import LogLevel, Mode

from codeenv.disk_lru import DiskLRU
from codeenv.errors import ImageError
from codeenv.models import CompileInfo, LimitName
from codeenv.sandbox.cgroups import JailCgroup
from codeenv.sandbox.image import SANDBOX_UID
from codeenv.sandbox.jail import config_text, nsjail_binary, without_linker_notices
from codeenv.sandbox.outside.process import one_shot
from codeenv.sandbox.toolchain import Toolchain, built_toolchain
from codeenv.settings import SandboxSettings

logger = logging.getLogger(__name__)

#: The compiler's diagnostics kept (the rest is read and dropped).
DIAGNOSTICS_BYTES = 64 << 10
#: Flags every compile gets after the preset's: a static binary (it runs in the slot's jail, whose
#: root has no libstdc++), from the source in the compile jail's work dir.
LINK_FLAGS = ["-static"]
SOURCE = "solution.cpp"
#: Files beside the source that are compiled and linked with it (an IOI grader, a stub); the rest
#: (headers) are only there to be included.
LINKED_SUFFIXES = (".cpp", ".cc", ".cxx")
BINARY = "solution"
#: Processes a compile may have at once (the driver, cc1plus, as, collect2, ld).
COMPILE_PIDS = 32


@dataclass
class Compiled:
    """A compile's outcome: the binary (None on an error) and what the result says of it."""

    info: CompileInfo
    binary: bytes | None = None
    key: str = ""


class _Cache:
    """Compiled binaries and compile errors on disk, by key; least recently used removed first."""

    def __init__(self, root: Path, cap_bytes: int) -> None:
        self.files = DiskLRU(root, cap_bytes)

    def get(self, key: str) -> tuple[bytes | None, str | None] | None:
        """(binary, None) or (None, diagnostics) of `key`, or None on a miss."""
        binary = self.files.read(f"{key}.bin")
        if binary is not None:
            return binary, None
        diagnostics = self.files.read(f"{key}.err")
        return None if diagnostics is None else (None, diagnostics.decode("utf-8", "replace"))

    def put(self, key: str, binary: bytes | None, diagnostics: str = "") -> None:
        if binary is not None:
            self.files.write(f"{key}.bin", binary)
        else:
            self.files.write(f"{key}.err", diagnostics.encode())


class Compiler:
    """Compiles C++ for a worker's slots (the toolchain found when first needed: one built after the
    worker started is used without a restart)."""

    def __init__(self, settings: SandboxSettings, runtime_dir: Path) -> None:
        self.settings = settings
        self.runtime_dir = runtime_dir
        self.cache = _Cache(settings.state_dir / "compile-cache", settings.cpp_cache_mb << 20)
        self._toolchain: Toolchain | None = None
        self._count = 0
        self.compiles = 0
        self.cache_hits = 0

    def toolchain(self) -> Toolchain:
        """The built toolchain (ImageError saying how to build it, or that C++ is off)."""
        if not self.settings.cpp_toolchain:
            raise ImageError("C++ is off on this worker (CODEENV_CPP_TOOLCHAIN is empty)")
        if self._toolchain is None:
            self._toolchain = built_toolchain(self.settings.cpp_toolchain, self.settings.images_dir)
        return self._toolchain

    def flags(self, preset: str | None, std: str | None) -> list[str]:
        return [*self.toolchain().preset_flags(preset or "codeforces", std), *LINK_FLAGS]

    def key(self, source: bytes, flags: list[str], files: dict[str, bytes] | None = None) -> str:
        head = json.dumps([self.toolchain().content_hash, flags,
                           sorted((name, hashlib.sha256(data).hexdigest()) for name, data in (files or {}).items())])
        return hashlib.sha256(head.encode() + b"\0" + source).hexdigest()

    async def compile(self, source: bytes, preset: str | None, std: str | None, host_uid: int,
                      cgroup: JailCgroup, files: dict[str, bytes] | None = None) -> Compiled:
        """`source` compiled with `preset` and `std` (and `files` beside it in the work dir: headers,
        and C++ sources linked with it), from the cache or in a jail running as `host_uid` in `cgroup`
        (raises ImageError when there is no toolchain)."""
        flags = self.flags(preset, std)
        key = self.key(source, flags, files)
        hit = await asyncio.to_thread(self.cache.get, key)
        if hit is not None:
            self.cache_hits += 1
            binary, diagnostics = hit
            if binary is not None:
                return Compiled(CompileInfo(status="ok", cached=True), binary, key)
            return Compiled(CompileInfo(status="error", stderr=diagnostics or "", cached=True,
                                        message="the code does not compile"), None, key)
        compiled = await self._run(source, flags, host_uid, cgroup, files)
        compiled.key = key
        self.compiles += 1
        if compiled.info.limit is None:  # a limit may not be reached again on a quieter host
            await asyncio.to_thread(self.cache.put, key, compiled.binary, compiled.info.stderr)
        return compiled

    def _config(self, work: Path, flags: list[str], host_uid: int, sources: list[str]) -> NsJailConfig:
        s = self.settings
        toolchain = self.toolchain()
        ids = [IdMap(inside_id=str(SANDBOX_UID), outside_id=str(host_uid), count=1)]
        return NsJailConfig(
            name="codeenv-compile", mode=Mode.ONCE, hostname="codeenv", cwd="/work",
            time_limit=2 * s.cpp_compile_cpu_s + 10, max_cpus=0, keep_env=False,
            envar=["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "HOME=/work", "TMPDIR=/tmp"],
            keep_caps=False, silent=False, log_level=LogLevel.ERROR, log_file=str(work / "nsjail.log"),
            nice_level=max(0, os.getpriority(os.PRIO_PROCESS, 0)),
            rlimit_as_type=RLimitType.INF,  # the cgroup caps memory (address space is not memory)
            rlimit_core=0,
            rlimit_cpu=s.cpp_compile_cpu_s,
            rlimit_fsize=s.cpp_binary_mb,
            rlimit_nofile=256,
            rlimit_nproc_type=RLimitType.SOFT,  # the cgroup caps processes
            rlimit_stack=64,
            rlimit_memlock=0, rlimit_memlock_type=RLimitType.VALUE,
            rlimit_rtprio=0, rlimit_rtprio_type=RLimitType.VALUE,
            rlimit_msgqueue=0, rlimit_msgqueue_type=RLimitType.VALUE,
            clone_newnet=True, clone_newuser=True, clone_newns=True, clone_newpid=True, clone_newipc=True,
            clone_newuts=True, clone_newcgroup=True,
            uidmap=ids, gidmap=ids,
            mount=[
                MountPt(src=str(toolchain.root), dst="/", is_bind=True, rw=False),
                MountPt(src=str(work / "src"), dst="/work", is_bind=True, rw=True),
                MountPt(dst="/tmp", fstype="tmpfs", options=f"size={s.cpp_binary_mb * 2 + 64}m,mode=0777",
                        rw=True, is_dir=True, nosuid=True, nodev=True),
            ],
            exec_bin=Exe(path=toolchain.spec.compiler,
                         arg=[*flags, "-o", f"/work/{BINARY}", f"/work/{SOURCE}",
                              *(f"/work/{name}" for name in sorted(sources))]),
        )

    async def _run(self, source: bytes, flags: list[str], host_uid: int, cgroup: JailCgroup,
                   files: dict[str, bytes] | None = None) -> Compiled:
        s = self.settings
        self._count += 1
        work = self.runtime_dir / f"compile-{host_uid}-{self._count}"
        src = work / "src"
        src.mkdir(parents=True)
        try:
            for name, data in {**(files or {}), SOURCE: source}.items():  # names checked by the request's model
                (src / name).write_bytes(data)
                os.chmod(src / name, 0o444)
            os.chown(src, host_uid, host_uid)
            os.chmod(src, 0o700)
            cfg = work / "compile.cfg"
            sources = [name for name in files or {} if name.endswith(LINKED_SUFFIXES)]
            cfg.write_text(config_text(self._config(work, flags, host_uid, sources)))
            cgroup.set_memory_limit(s.cpp_compile_memory_mb << 20)
            cgroup.set_pids_max(COMPILE_PIDS)
            oom0, cpu0 = cgroup.oom_kills(), cgroup.cpu_usage_ns()

            async def collect(proc: asyncio.subprocess.Process) -> bytes:
                assert proc.stdout is not None
                return await _read_capped(proc.stdout, DIAGNOSTICS_BYTES)

            diagnostics, code, wall = await one_shot(
                s, cfg, cgroup, 2 * s.cpp_compile_cpu_s + 20, collect,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            cpu1 = cgroup.cpu_usage_ns()
            cpu_s = (cpu1 - cpu0) / 1e9 if cpu0 is not None and cpu1 is not None else 0.0
            text = without_linker_notices(diagnostics.decode("utf-8", "replace"), nsjail_binary(s))
            info = CompileInfo(status="ok", stderr=text, wall_s=round(wall, 6), cpu_s=round(cpu_s, 6))
            out = src / BINARY
            if code == 0 and out.is_file() and not out.is_symlink():
                binary = out.read_bytes()
                if len(binary) <= s.cpp_binary_mb << 20:
                    return Compiled(info, binary)
            info.status = "error"
            info.limit, info.message = self._why(code, text, wall, cpu_s, cgroup.oom_kills() > oom0, work)
            return Compiled(info)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    def _why(self, code: int, text: str, wall_s: float, cpu_s: float, oom: bool,
             work: Path) -> tuple[LimitName | None, str]:
        """Which of the compile's limits stopped it, if one did, and the message saying so."""
        s = self.settings
        if oom:
            return LimitName.memory, f"the compiler exceeded its memory limit of {s.cpp_compile_memory_mb} MB"
        if "SIGXCPU" in text or "CPU time limit exceeded" in text or cpu_s >= s.cpp_compile_cpu_s:
            return LimitName.cpu, f"the compiler exceeded its CPU limit of {s.cpp_compile_cpu_s} s"
        if wall_s >= 2 * s.cpp_compile_cpu_s + 10:
            return LimitName.wall, f"the compiler exceeded its wall-clock limit of {2 * s.cpp_compile_cpu_s + 10} s"
        if "File size limit exceeded" in text or "File too large" in text:
            return LimitName.file_size, f"the binary exceeded its size limit of {s.cpp_binary_mb} MB"
        if code != 0 and not text.strip():
            with contextlib.suppress(OSError):
                logged = (work / "nsjail.log").read_text(errors="replace")[-2000:]
                logger.warning("a compile ended with code %d and no diagnostics; nsjail said: %s", code, logged)
        return None, "the code does not compile"


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    """Everything `stream` says until it closes, of which the first `cap` bytes are kept."""
    kept = bytearray()
    while chunk := await stream.read(1 << 16):
        if len(kept) < cap:
            kept += chunk[:cap - len(kept)]
    return bytes(kept)
