"""Sandbox images: a declared Python environment built into a self-contained, read-only root.

An image is declared by an ``image.toml`` (see ``sandbox_images/python-math/image.toml``) and built by
``codeenv image build NAME`` into ``<images_dir>/<name>-<hash>/``::

    root/            what a jail mounts read-only as /  (interpreter, stdlib, site-packages, libs, /etc)
    manifest.json    the spec, the interpreter version, the installed packages and the content hash

``<images_dir>/<name>`` is a symlink to the current build, replaced atomically. Usage::

    image = ensure_image(settings, progress=print)     # builds first if the spec changed
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from codeenv.errors import ImageError
from codeenv.settings import SandboxSettings

logger = logging.getLogger(__name__)

#: Bumped whenever the builder lays images out differently, so old builds are rebuilt.
BUILDER_VERSION = 2
PREFIX = "usr/local"
#: Standard-library parts a jail never needs (tests, GUIs, installers): smaller image, less surface.
STDLIB_EXCLUDES = {
    "site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "__pycache__",
    "lib2to3", "pydoc_data", "venv",
}
STDLIB_EXCLUDE_PATTERNS = [
    re.compile(r"^config-\d"),
    re.compile(r"^_test.*\.so$"),
    re.compile(r"^_tkinter.*\.so$"),
    re.compile(r"^(xxlimited|_xxtestfuzz|_ctypes_test|xxsubtype).*\.so$"),
]
#: Placeholders that mount points land on, so mounting never writes into the image.
MOUNT_POINTS_DIRS = ["proc", "work", "dev", "usr/lib/codeenv"]
MOUNT_POINTS_FILES = ["dev/null", "dev/zero", "dev/urandom", "dev/random"]
SANDBOX_UID = 1000

Progress = Callable[[str], None]


class Profile(BaseModel):
    """A zygote flavour: what it preloads, and which imports it serves without a fresh import."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    preload: list[str] = Field(default_factory=list)
    covers: list[str] = Field(default_factory=lambda: ["*"])
    warmup: str = Field("", description="code the zygote runs once after preloading (fills lazy caches)")


class ImageSpec(BaseModel):
    """The declaration in an ``image.toml``."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_.-]{0,63}$")
    description: str = ""
    python: str = Field("3.12", pattern=r"^3\.\d+$")
    packages: list[str] = Field(default_factory=list)
    hash_seed: int = Field(0, ge=0, le=4294967295)
    env: dict[str, str] = Field(default_factory=dict, description="extra environment inside the jail")
    profiles: list[Profile] = Field(min_length=1)


@dataclass(frozen=True)
class Image:
    """A built image, ready to be mounted."""

    name: str
    path: Path  # the build directory; the jail root is path / "root"
    content_hash: str
    spec: ImageSpec
    python_version: str

    @property
    def root(self) -> Path:
        return self.path / "root"

    @property
    def short_hash(self) -> str:
        return self.content_hash[:16]

    def profile(self, name: str) -> Profile:
        for profile in self.spec.profiles:
            if profile.name == name:
                return profile
        raise ImageError(f"unknown profile {name!r}; image {self.name} has "
                         f"{', '.join(p.name for p in self.spec.profiles)}")


def search_dirs() -> list[Path]:
    """Where image declarations are looked up: $CODEENV_IMAGE_PATH entries, then the shipped ones."""
    dirs = [Path(p) for p in os.environ.get("CODEENV_IMAGE_PATH", "").split(os.pathsep) if p]
    dirs.append(Path(__file__).resolve().parents[2] / "sandbox_images")
    return dirs


def find_spec(name: str) -> tuple[ImageSpec, bytes]:
    """Load an image declaration by name (or by a path to its image.toml)."""
    return load_declaration(name, "image.toml", ImageSpec, "image")


def load_declaration[M: BaseModel](name: str, filename: str, model: type[M], what: str) -> tuple[M, bytes]:
    """A declaration (NAME/`filename` in the first of `search_dirs` that has it, or the .toml file
    `name`) as `model`, and its bytes."""
    candidates = [Path(name)] if name.endswith(".toml") else [d / name / filename for d in search_dirs()]
    for path in candidates:
        if path.is_file():
            raw = path.read_bytes()
            try:
                return model.model_validate(tomllib.loads(raw.decode())), raw
            except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValidationError) as exc:
                raise ImageError(f"{path} is not a valid {what} declaration: {exc}") from exc
    looked = ", ".join(str(c) for c in candidates)
    raise ImageError(f"no {what} declaration named {name!r} (looked in {looked})")


def spec_digest(raw: bytes) -> str:
    return hashlib.sha256(b"builder-%d\0" % BUILDER_VERSION + raw).hexdigest()


def load_image(build_dir: Path) -> Image:
    try:
        manifest = json.loads((build_dir / "manifest.json").read_text())
        spec = ImageSpec.model_validate(manifest["spec"])
        return Image(spec.name, build_dir, manifest["content_hash"], spec, manifest["python_version"])
    except (OSError, ValueError, KeyError, ValidationError) as exc:
        raise ImageError(f"{build_dir} is not a built image: {exc}") from exc


def current_image(images_dir: Path, name: str, digest: str) -> Image | None:
    """The built image for this spec digest, if the current build matches it."""
    link = images_dir / name
    try:
        manifest = json.loads((link / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("spec_digest") != digest:
        return None
    return load_image(link.resolve())


def ensure_image(settings: SandboxSettings, progress: Progress | None = None) -> Image:
    """Return the built image the settings name, building it first if needed."""
    spec, raw = find_spec(settings.image)
    digest = spec_digest(raw)
    images_dir = settings.images_dir
    image = current_image(images_dir, spec.name, digest)
    if image is not None:
        return image
    images_dir.mkdir(parents=True, exist_ok=True)
    with open(images_dir / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same image
        image = current_image(images_dir, spec.name, digest)
        if image is None:
            image = build_image(spec, digest, images_dir, settings.image_python, progress)
    return image


# --- building ----------------------------------------------------------------------------------


def _interpreter_facts(python: str) -> dict[str, str]:
    probe = (
        "import json, sys, sysconfig\n"
        "print(json.dumps({'version': '%d.%d.%d' % sys.version_info[:3],"
        " 'short': '%d.%d' % sys.version_info[:2],"
        " 'executable': sys._base_executable, 'stdlib': sysconfig.get_path('stdlib'),"
        " 'libdir': sysconfig.get_config_var('LIBDIR') or '',"
        " 'soname': sysconfig.get_config_var('INSTSONAME') or '',"
        " 'shared': str(sysconfig.get_config_var('Py_ENABLE_SHARED') or 0),"
        " 'implementation': sys.implementation.name}))"
    )
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
        facts: dict[str, str] = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise ImageError(f"cannot use {python!r} to build images: {exc}") from exc
    return facts


def _interpreter_candidates(version: str) -> list[str]:
    """Where a CPython `version` (e.g. "3.12") may live: this process's, PATH, pyenv, the usual prefixes."""
    found = [sys.executable, f"python{version}"]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found += [str(p) for p in sorted((pyenv_root / "versions").glob(f"{version}.*/bin/python{version}"),
                                     reverse=True)]
    found += [f"/usr/local/bin/python{version}", f"/usr/bin/python{version}"]
    return found


def _pick_interpreter(spec: ImageSpec, configured: str | None) -> tuple[str, dict[str, str]]:
    candidates = [configured] if configured else _interpreter_candidates(spec.python)
    reasons = []
    for candidate in candidates:
        if candidate is None or (os.sep in candidate and not os.path.exists(candidate)):
            continue
        try:
            facts = _interpreter_facts(candidate)
        except ImageError as exc:
            reasons.append(str(exc))
            continue
        if facts["implementation"] == "cpython" and facts["short"] == spec.python:
            return candidate, facts
        reasons.append(f"{candidate} is {facts['implementation']} {facts['version']}")
    raise ImageError(
        f"image {spec.name} needs CPython {spec.python}; set CODEENV_IMAGE_PYTHON to one "
        f"({'; '.join(reasons)})"
    )


def _copy_stdlib(src: Path, dst: Path) -> None:
    def ignore(directory: str, names: list[str]) -> set[str]:
        top = Path(directory) == src
        skipped = {n for n in names if n == "__pycache__" or (top and n in STDLIB_EXCLUDES)}
        if top or Path(directory).name == "lib-dynload":
            skipped |= {n for n in names if any(p.match(n) for p in STDLIB_EXCLUDE_PATTERNS)}
        return skipped

    shutil.copytree(src, dst, ignore=ignore, symlinks=True)


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


_LDD_LINE = re.compile(r"^\s*(?:(\S+)\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)")


def _shared_deps(paths: list[Path]) -> set[str]:
    """Host libraries the given ELF files load (as ldd resolves them)."""
    deps: set[str] = set()
    for chunk_start in range(0, len(paths), 200):
        chunk = [str(p) for p in paths[chunk_start:chunk_start + 200]]
        out = subprocess.run(["ldd", *chunk], capture_output=True, text=True, timeout=300)
        for line in out.stdout.splitlines():
            m = _LDD_LINE.match(line)
            if m:
                deps.add(m.group(2))
    return deps


def _copy_host_file(host_path: str, root: Path) -> None:
    """Copy a host file into the image at the same absolute path, following symlink chains.

    On merged-/usr hosts a path may go through a symlinked directory (``/lib64 -> usr/lib64``)
    whose relative links only resolve from the real directory (trixie's
    ``/usr/lib64/ld-linux-x86-64.so.2 -> ../lib/...``), so each file goes to its real directory and
    the path asked for, where it differs, becomes an absolute link to it."""
    asked = Path(host_path)
    path = Path(os.path.realpath(asked.parent)) / asked.name
    if path != asked:
        alias = root / asked.relative_to("/")
        if not (alias.exists() or alias.is_symlink()):
            alias.parent.mkdir(parents=True, exist_ok=True)
            alias.symlink_to(path)
    target = root / path.relative_to("/")
    if target.exists() or target.is_symlink():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        link = os.readlink(path)
        target.symlink_to(link)
        _copy_host_file(link if os.path.isabs(link) else os.path.normpath(path.parent / link), root)
    else:
        shutil.copy2(path, target)


def _write_etc(root: Path, spec: ImageSpec) -> None:
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    files = {
        "passwd": f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
                  f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:/work:/usr/sbin/nologin\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1 localhost\n::1 localhost\n",
        "hostname": "codeenv\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
        "ld.so.conf": f"/{PREFIX}/lib\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n/lib64\n/usr/lib\n/lib\n",
        "os-release": f'NAME="codeenv sandbox"\nID=codeenv\nVERSION_ID="{spec.name}"\n',
    }
    for name, content in files.items():
        (etc / name).write_text(content)
    subprocess.run(["ldconfig", "-r", str(root)], check=True, capture_output=True, timeout=120)


def _tree_entries(root: Path) -> Iterator[tuple[str, os.stat_result, Path]]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            yield str(path.relative_to(root)), path.lstat(), path


def content_hash(root: Path) -> str:
    """sha256 over every path, its type, permission bits and content (or link target)."""
    h = hashlib.sha256()
    for rel, st, path in _tree_entries(root):
        h.update(rel.encode() + b"\0" + b"%o" % st.st_mode + b"\0")
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(path).encode())
        elif stat.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        h.update(b"\n")
    return h.hexdigest()


def _normalise_modes(root: Path) -> None:
    """World-readable (the jail runs as an unprivileged uid), nothing writable or set-id."""
    for _, st, path in _tree_entries(root):
        if stat.S_ISLNK(st.st_mode):
            continue
        mode = stat.S_IMODE(st.st_mode)
        executable = stat.S_ISDIR(st.st_mode) or mode & 0o111
        os.chmod(path, 0o755 if executable else 0o644)
    os.chmod(root, 0o755)


def build_image(
    spec: ImageSpec, digest: str, images_dir: Path, python: str | None = None,
    progress: Progress | None = None,
) -> Image:
    """Build `spec` into ``images_dir`` atomically and point ``images_dir/<name>`` at it."""
    say = progress or (lambda msg: logger.info("image %s: %s", spec.name, msg))
    interpreter, facts = _pick_interpreter(spec, python)
    build = Path(tempfile.mkdtemp(prefix=f".build-{spec.name}-", dir=images_dir))
    try:
        root = build / "root"
        stdlib = root / PREFIX / "lib" / f"python{spec.python}"
        say(f"copying CPython {facts['version']} from {facts['executable']}")
        exe = _copy_interpreter(root, stdlib, facts)
        if spec.packages:
            say(f"installing {len(spec.packages)} packages: {' '.join(spec.packages)}")
            _install_packages(spec, interpreter, stdlib / "site-packages")
        say("collecting shared libraries")
        _collect_libraries(root, exe, build)
        _make_mount_points(root, spec)
        say("byte-compiling")
        packages = _byte_compile(spec, interpreter, root, stdlib)
        say("hashing")
        _normalise_modes(root)
        digest_hex = content_hash(root)
        manifest = {
            "name": spec.name, "content_hash": digest_hex, "spec_digest": digest,
            "python_version": facts["version"], "packages": packages, "spec": spec.model_dump(),
        }
        (build / "manifest.json").write_text(json.dumps(manifest, indent=2))
        final = _publish(build, images_dir, f"{spec.name}-{digest_hex[:16]}", spec.name)
        say(f"built {final.name}")
        return load_image(final)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise


def _copy_interpreter(root: Path, stdlib: Path, facts: dict[str, str]) -> Path:
    """The interpreter, its standard library and libpython under `root`; the executable's path."""
    lib = stdlib.parent
    (root / PREFIX / "bin").mkdir(parents=True)
    _copy_stdlib(Path(facts["stdlib"]), stdlib)
    exe = root / PREFIX / "bin" / stdlib.name
    shutil.copy2(os.path.realpath(facts["executable"]), exe)
    for alias in ("python3", "python"):
        (root / PREFIX / "bin" / alias).symlink_to(exe.name)
    libpython = Path(facts["libdir"]) / facts["soname"] if facts["soname"] else None
    # Debian's python3 reports a shared libpython but its executable has it built in (the .so
    # comes with the separate libpython3.X package): copy it only where there is one.
    if facts["shared"] not in ("0", "") and libpython is not None and libpython.is_file():
        shutil.copy2(libpython, lib / facts["soname"])
    (stdlib / "site-packages").mkdir(exist_ok=True)
    if "dist-packages" in (stdlib / "site.py").read_text(encoding="utf-8", errors="replace"):
        # Debian's site.py looks in dist-packages instead of site-packages.
        (stdlib / "dist-packages").symlink_to("site-packages")
    return exe


def _install_packages(spec: ImageSpec, interpreter: str, site: Path) -> None:
    cmd = [interpreter, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-compile", "--no-warn-script-location", "--only-binary=:all:",
           "--target", str(site), *spec.packages]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise ImageError(f"pip could not install the packages of {spec.name}:\n{out.stderr[-4000:]}")
    shutil.rmtree(site / "bin", ignore_errors=True)


def _collect_libraries(root: Path, exe: Path, build: Path) -> None:
    """Copy the host's shared libraries that the image's ELF files need (libpython excepted)."""
    elves = [p for _, st, p in _tree_entries(root) if stat.S_ISREG(st.st_mode)
             and (p.suffix == ".so" or ".so." in p.name or p == exe) and _is_elf(p)]
    for dep in sorted(_shared_deps(elves)):
        if dep.startswith(str(build)) or "libpython" in Path(dep).name:
            continue
        _copy_host_file(dep, root)


def _make_mount_points(root: Path, spec: ImageSpec) -> None:
    for d in MOUNT_POINTS_DIRS:
        (root / d).mkdir(parents=True, exist_ok=True)
    for f in MOUNT_POINTS_FILES:
        (root / f).touch()
    (root / "tmp").symlink_to("work")
    (root / "dev" / "shm").symlink_to("../work")
    _write_etc(root, spec)


def _byte_compile(spec: ImageSpec, interpreter: str, root: Path, stdlib: Path) -> dict[str, str]:
    """Byte-compile the standard library and packages; the installed packages' versions."""
    out = subprocess.run(
        [interpreter, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
         "-s", str(root), "-p", "/", str(stdlib)],
        capture_output=True, text=True, timeout=3600,
    )
    if out.returncode != 0:
        logger.warning("byte-compiling %s reported: %s", spec.name, out.stdout[-2000:])
    freeze = subprocess.run(
        [interpreter, "-m", "pip", "list", "--format=json", "--path", str(stdlib / "site-packages")],
        capture_output=True, text=True, timeout=300,
    )
    return {p["name"]: p["version"] for p in json.loads(freeze.stdout or "[]")}


def _publish(build: Path, images_dir: Path, final_name: str, name: str) -> Path:
    """Move the finished build to its content-addressed name and point ``images_dir/<name>`` at it."""
    os.chmod(build, 0o755)
    final = images_dir / final_name
    if final.exists():
        shutil.rmtree(build)
    else:
        os.rename(build, final)
    link_tmp = images_dir / f".{name}.link"
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(final.name)
    os.replace(link_tmp, images_dir / name)
    return final
