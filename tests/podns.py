"""Run a command the way a Kubernetes pod with ``hostUsers: false`` runs its container (test helper).

    python tests/podns.py OUTER SCRATCH_DIR CGROUP_DIR... -- COMMAND...

As root of a new user namespace that maps 65,536 uids and gids from host uid OUTER, in the given
cgroups (made beforehand and owned by OUTER: what a runtime with writable cgroups hands a pod), in
a mount namespace of its own. The host's files stay owned by host root, which the namespace does
not map; so that its root can still reach the interpreter and the repository, directories on their
paths that others may not search (such as ``/root`` holding pyenv) are covered with a searchable
tmpfs that holds only the paths needed (SCRATCH_DIR, an empty directory, is where the originals
stay reachable; its mounts live only in the helper's mount namespace).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _blocked(path: Path) -> Path | None:
    """The first directory on `path` that others may not search, or None."""
    for parent in reversed(path.parents):
        if not os.stat(parent).st_mode & 0o001:
            return parent
    return None


def _open_up(paths: list[Path], scratch: Path) -> None:
    """Cover each directory on `paths` that others may not search with a searchable tmpfs that
    holds bind mounts of just the children on `paths` (the originals are reached through `scratch`)."""
    blocked: dict[Path, set[str]] = {}
    for path in paths:
        if (top := _blocked(path)) is not None:
            blocked.setdefault(top, set()).add(path.relative_to(top).parts[0])
    for n, (top, children) in enumerate(blocked.items()):
        keep = scratch / f"blocked-{n}"
        keep.mkdir()
        subprocess.run(["mount", "--bind", str(top), str(keep)], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "podns", str(top)], check=True)
        for child in children:
            (top / child).mkdir()
            subprocess.run(["mount", "--bind", str(keep / child), str(top / child)], check=True)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    outer, scratch, cgroups, command = int(argv[0]), Path(argv[1]), argv[2:split], argv[split + 1:]
    os.unshare(os.CLONE_NEWNS)
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=700", "podns", str(scratch)], check=True)
    _open_up([Path(os.path.realpath(sys.executable)), Path(sys.executable), REPO], scratch)
    return _run(outer, cgroups, command)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the helper dies (if it is killed, the command must not outlive it)."""
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it died before the prctl
        os._exit(70)


def _run(outer: int, cgroups: list[str], command: list[str]) -> int:
    for group in cgroups:
        Path(group, "cgroup.procs").write_text(str(os.getpid()))
    ready_r, ready_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    helper = os.getpid()
    pid = os.fork()
    if pid == 0:  # never returns: an exception here must not run the parent's clean-up
        try:
            os.close(ready_r)
            os.close(mapped_w)
            os.unshare(os.CLONE_NEWUSER)
            os.write(ready_w, b"1")
            if os.read(mapped_r, 1) == b"1":
                os.setresgid(0, 0, 0)
                os.setresuid(0, 0, 0)
                _die_with_parent(helper)  # after the uid changes, which would clear it
                os.execvp(command[0], command)
        finally:
            os._exit(70)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))  # the command's to handle
    os.close(ready_w)
    os.close(mapped_r)
    if os.read(ready_r, 1) == b"1":
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{pid}/{name}").write_text(f"0 {outer} 65536\n")
        os.write(mapped_w, b"1")
    os.close(mapped_w)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
