"""Files into a call's work dir and back out: written and read inside the jail, never on the host."""

from __future__ import annotations

import base64

import pytest

from codeenv import ExecRequest, SlotPool
from codeenv.errors import InvalidRequest

pytestmark = pytest.mark.jail


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def test_files_in_and_out(pool: SlotPool) -> None:
    blob = bytes(range(256)) * 100
    result = await pool.run(ExecRequest(
        code="import os\nprint(open('data/in.txt').read())\n"
             "open('out/result.bin', 'wb').write(open('blob', 'rb').read()[::-1])\n"
             "open('note.txt', 'w').write('written inside')",
        files={"data/in.txt": b64(b"hello from the trainer"), "blob": b64(blob), "out/.keep": ""},
        fetch_files=["out/result.bin", "note.txt", "data/in.txt"]))
    assert result.status == "ok", result
    assert result.stdout == "hello from the trainer\n"
    assert result.files is not None and result.file_errors == {}
    assert base64.b64decode(result.files["out/result.bin"]) == blob[::-1]
    assert base64.b64decode(result.files["note.txt"]) == b"written inside"
    assert base64.b64decode(result.files["data/in.txt"]) == b"hello from the trainer"
    # Nothing of the call is left for the next one.
    after = await pool.run(ExecRequest(code="import os\nprint(sorted(os.listdir('.')))"))
    assert after.stdout == "[]\n"


async def test_fetching_anything_but_a_regular_file_is_refused(pool: SlotPool) -> None:
    code = """
import os
os.symlink('/proc/1/environ', 'environ')
os.symlink('/dev/zero', 'zero')
os.mkfifo('fifo')
with open('sparse', 'wb') as f:
    f.truncate(1 << 30)
os.mkdir('dir')
os.symlink('/etc', 'etc')
open('small', 'w').write('ok')
"""
    asked = ["environ", "zero", "fifo", "sparse", "dir", "etc/passwd", "missing", "small"]
    result = await pool.run(ExecRequest(code=code, fetch_files=asked, limits={"file_size_mb": 1024}))
    assert result.status == "ok", result
    assert result.files == {"small": b64(b"ok")}
    errors = result.file_errors or {}
    assert set(errors) == set(asked) - {"small"}
    assert errors["environ"] == errors["zero"] == "a symbolic link"
    assert errors["fifo"] == errors["dir"] == "not a regular file"
    assert "more than" in errors["sparse"]
    assert "link" in errors["etc/passwd"] or "directory" in errors["etc/passwd"]
    assert errors["missing"] == "no such file"
    healthy = await pool.run(ExecRequest(code="print('fine')"))
    assert healthy.stdout == "fine\n"


async def test_files_survive_a_timeout_and_an_exit(pool: SlotPool) -> None:
    result = await pool.run(ExecRequest(code="open('partial', 'w').write('so far')\nwhile True: pass",
                                        fetch_files=["partial"], limits={"wall_s": 0.5}))
    assert result.status == "timeout"
    assert result.files == {"partial": b64(b"so far")}
    result = await pool.run(ExecRequest(code="import os\nopen('x', 'w').write('1')\nos._exit(3)", fetch_files=["x"]))
    assert result.status == "error" and result.exit_code == 3 and result.files == {"x": b64(b"1")}


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", "a\0b", "", "./x", "a//b"])
async def test_paths_outside_the_work_dir_are_refused(pool: SlotPool, path: str) -> None:
    for request in (ExecRequest(code="1", files={path: b64(b"x")}), ExecRequest(code="1", fetch_files=[path])):
        with pytest.raises(InvalidRequest, match="file path"):
            await pool.run(request)


async def test_file_caps(pool: SlotPool) -> None:
    with pytest.raises(InvalidRequest, match="base64"):
        await pool.run(ExecRequest(code="1", files={"a": "not base64!"}))
    with pytest.raises(InvalidRequest, match="both a file and a directory"):
        await pool.run(ExecRequest(code="1", files={"a": "", "a/b": ""}))
    with pytest.raises(InvalidRequest, match="files in and out"):
        await pool.run(ExecRequest(code="1", fetch_files=[f"f{i}" for i in range(300)]))
    big = pool.settings.max_fetch_bytes + 1
    result = await pool.run(ExecRequest(code=f"open('big', 'wb').write(b'x' * {big})", fetch_files=["big"]))
    assert result.status == "ok" and "more than" in (result.file_errors or {})["big"]
