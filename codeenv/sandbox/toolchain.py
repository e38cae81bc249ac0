"""Compiler toolchain images: a root made only of pinned Debian packages, for compiled submissions.

A toolchain is declared in ``sandbox_images/NAME/toolchain.toml`` (the compiler's path, flag presets,
and every package of the compiler's dependency closure with its version and the sha256 of its .deb).
Building it downloads each package with ``apt-get download NAME=VERSION`` (into a cache beside the
images), refuses any whose sha256 differs, unpacks each with ``dpkg-deb -x`` into a fresh root,
precompiles ``<bits/stdc++.h>`` once per preset, and publishes the root under its content hash, as
Python images are (``images_dir/NAME`` points at the current build). Nothing of the host's ``/usr`` is
in it; the build needs the host's apt (and its package sources) and root (the headers are precompiled
by the root's own compiler, in a chroot).

A preset's precompiled header lives in a directory of its own, ``/usr/lib/codeenv-pch/PRESET``, beside
a copy of the header: compiling with ``-I`` that directory (``preset_flags``) uses it, and only it, so
``-Winvalid-pch -Werror`` holds for every preset.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codeenv.errors import ImageError
from codeenv.sandbox.image import _normalise_modes, _publish, content_hash, load_declaration, search_dirs

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

#: Bumped when the builder changes what it makes from the same declaration.
BUILDER_VERSION = 1
#: Where a preset's precompiled header and its header's copy live in the root.
PCH_DIR = "usr/lib/codeenv-pch"
#: Debian's architecture names, by the machine's.
DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
#: The C++ standards a submission may ask for.
Std = Literal["c++11", "c++14", "c++17", "c++20", "gnu++11", "gnu++14", "gnu++17", "gnu++20"]


class Package(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9+.-]+$")
    version: str = Field(pattern=r"^[A-Za-z0-9.+~:-]+$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Preset(BaseModel):
    model_config = ConfigDict(extra="forbid")

    flags: list[str]
    std: Std


class ToolchainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    description: str = ""
    arch: str = "amd64"
    compiler: str
    header: str = "usr/include/x86_64-linux-gnu/c++/12/bits/stdc++.h"
    presets: dict[str, Preset]
    packages: list[Package] = Field(min_length=1)


class Toolchain:
    """A built toolchain: its root (read-only in the jail), content hash and declaration."""

    def __init__(self, path: Path, content_hash: str, spec: ToolchainSpec) -> None:
        self.path = path
        self.content_hash = content_hash
        self.spec = spec

    @property
    def root(self) -> Path:
        return self.path / "root"

    def preset_flags(self, preset: str, std: str | None = None) -> list[str]:
        """The compiler's flags for `preset` and `std` (default: the preset's), with its precompiled
        header where it has one for that standard."""
        try:
            chosen = self.spec.presets[preset]
        except KeyError:
            raise ImageError(f"unknown preset {preset!r}; {self.spec.name} has "
                             f"{', '.join(sorted(self.spec.presets))}") from None
        std = std or chosen.std
        pch = [f"-I/{PCH_DIR}/{preset}"] if std == chosen.std else []
        return [*chosen.flags, f"-std={std}", *pch]


def find_toolchain_spec(name: str) -> tuple[ToolchainSpec, bytes]:
    """A toolchain declaration by name (or by a path to its toolchain.toml)."""
    return load_declaration(name, "toolchain.toml", ToolchainSpec, "toolchain")


def is_toolchain(name: str) -> bool:
    """Whether `name` names a toolchain declaration (not a Python image)."""
    if name.endswith(".toml"):
        return Path(name).name == "toolchain.toml"
    return any((d / name / "toolchain.toml").is_file() for d in search_dirs())


def _spec_digest(raw: bytes) -> str:
    return hashlib.sha256(b"toolchain-builder-%d\0" % BUILDER_VERSION + raw).hexdigest()


def built_toolchain(name: str, images_dir: Path) -> Toolchain:
    """The toolchain `name` as built from its current declaration, without building it (ImageError
    saying how to build it when it is not)."""
    spec, raw = find_toolchain_spec(name)
    built = _current(images_dir, spec.name, _spec_digest(raw))
    if built is None:
        raise ImageError(f"the toolchain {spec.name} is not built on this worker (or its declaration changed "
                         f"since): run `codeenv image build {spec.name}` on its host")
    return built


def ensure_toolchain(name: str, images_dir: Path, progress: Progress | None = None) -> Toolchain:
    """The built toolchain `name`, building it first if its declaration changed since the last build."""
    spec, raw = find_toolchain_spec(name)
    digest = _spec_digest(raw)
    built = _current(images_dir, spec.name, digest)
    if built is not None:
        return built
    images_dir.mkdir(parents=True, exist_ok=True)
    with open(images_dir / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it
        built = _current(images_dir, spec.name, digest)
        return built if built is not None else build_toolchain(spec, digest, images_dir, progress)


def _current(images_dir: Path, name: str, digest: str) -> Toolchain | None:
    link = images_dir / name
    try:
        manifest = json.loads((link / "manifest.json").read_text())
        if manifest.get("spec_digest") != digest:
            return None
        return Toolchain(link.resolve(), manifest["content_hash"], ToolchainSpec.model_validate(manifest["spec"]))
    except (OSError, ValueError, KeyError, ValidationError):
        return None


def build_toolchain(spec: ToolchainSpec, digest: str, images_dir: Path,
                    progress: Progress | None = None) -> Toolchain:
    """Build `spec` into `images_dir` atomically and point ``images_dir/<name>`` at it."""
    say = progress or (lambda msg: logger.info("toolchain %s: %s", spec.name, msg))
    arch = DEBIAN_ARCH.get(platform.machine())
    if arch != spec.arch:
        raise ImageError(f"{spec.name} is declared for {spec.arch}; this host is {arch or platform.machine()}")
    for tool in ("apt-get", "dpkg-deb", "chroot"):
        if shutil.which(tool) is None:
            raise ImageError(f"building {spec.name} needs {tool} (Debian's apt and dpkg) on this host")
    debs = _download(spec, images_dir / ".debs", say)
    build = Path(tempfile.mkdtemp(prefix=f".build-{spec.name}-", dir=images_dir))
    try:
        root = build / "root"
        root.mkdir()
        say(f"unpacking {len(debs)} packages")
        for deb in debs:
            done = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True,
                                  timeout=600)
            if done.returncode != 0:
                raise ImageError(f"dpkg-deb could not unpack {deb.name}: {done.stderr[-2000:]}")
        for d in ("tmp", "work", "dev", "proc"):
            (root / d).mkdir(exist_ok=True)
        _normalise_modes(root)
        say("hashing")
        # What was unpacked, and the presets the headers are precompiled with: GCC's precompiled
        # headers are not byte-reproducible (28 bytes of 100 MB differ from one run to the next),
        # so they are derived from the hash's inputs and listed apart.
        unpacked = content_hash(root)
        presets = json.dumps({k: v.model_dump() for k, v in sorted(spec.presets.items())}, sort_keys=True)
        digest_hex = hashlib.sha256(f"{unpacked}\0{spec.compiler}\0{presets}".encode()).hexdigest()
        pch = {}
        for preset in sorted(spec.presets):
            say(f"precompiling <bits/stdc++.h> for preset {preset}")
            pch[preset] = _precompile(spec, root, preset)
        _normalise_modes(root)
        manifest = {"name": spec.name, "kind": "toolchain", "content_hash": digest_hex, "unpacked_hash": unpacked,
                    "precompiled_headers": pch, "spec_digest": digest, "spec": spec.model_dump()}
        (build / "manifest.json").write_text(json.dumps(manifest, indent=2))
        final = _publish(build, images_dir, f"{spec.name}-{digest_hex[:16]}", spec.name)
        say(f"built {final.name}")
        return Toolchain(final, digest_hex, spec)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise


def _download(spec: ToolchainSpec, cache: Path, say: Progress) -> list[Path]:
    """Each package's .deb, from the cache or apt-get download, its sha256 checked."""
    cache.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in spec.packages}

    def cached(p: Package) -> Path:
        return cache / f"{p.name}_{p.version.replace(':', '%3a')}_{spec.arch}.deb"

    def matches(path: Path, p: Package) -> bool:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest() == p.sha256

    missing = [p for p in spec.packages if not (cached(p).is_file() and matches(cached(p), p))]
    if missing:
        say(f"downloading {len(missing)} packages (apt-get download)")
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            argv = ["apt-get", "download", *[f"{p.name}={p.version}" for p in missing]]
            done = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:  # package lists absent or stale (a fresh host): once more after an update
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
                done = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise ImageError(f"apt-get could not download the packages of {spec.name} (a pinned version "
                                 f"may have left the mirror; refresh the declaration): {done.stderr[-2000:]}")
            for got in Path(tmp).glob("*.deb"):
                name = got.name.split("_", 1)[0]
                if name in wanted:
                    os.replace(got, cached(wanted[name]))
    for p in spec.packages:
        path = cached(p)
        if not path.is_file():
            raise ImageError(f"apt-get did not download {p.name}={p.version}")
        if not matches(path, p):
            path.unlink()
            raise ImageError(f"{p.name}={p.version} does not have its pinned sha256: refused")
    return [cached(p) for p in spec.packages]


def _precompile(spec: ToolchainSpec, root: Path, preset: str) -> str:
    """`preset`'s precompiled <bits/stdc++.h>, by the root's own compiler in a chroot, beside a copy of
    the header in the preset's own include directory; its sha256."""
    chosen = spec.presets[preset]
    header = root / spec.header
    if not header.is_file():
        raise ImageError(f"{spec.name} has no {spec.header}")
    where = root / PCH_DIR / preset / "bits"
    where.mkdir(parents=True)
    shutil.copy2(header, where / "stdc++.h")
    inside = f"/{PCH_DIR}/{preset}/bits"
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    cmd = [chroot, str(root), spec.compiler, *chosen.flags, f"-std={chosen.std}", "-x", "c++-header",
           f"{inside}/stdc++.h", "-o", f"{inside}/stdc++.h.gch"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin"})
    if done.returncode != 0:
        raise ImageError(f"precompiling <bits/stdc++.h> for preset {preset} failed: {done.stderr[-2000:]}")
    with open(where / "stdc++.h.gch", "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
