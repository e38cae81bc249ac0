"""The in-jail package's pure parts, in temporary directories: no jail, no root."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from codeenv.sandbox.inside import child, workdir
from codeenv.sandbox.inside.protocol import FETCH_DATA_AT, CallFd, frame, unframe
from codeenv.sandbox.outside.call_io import pack_files, read_fetched

pytestmark = pytest.mark.unit


def _memfd(data: bytes = b"", size: int | None = None) -> int:
    fd = os.memfd_create("t")
    os.write(fd, data)
    if size is not None:
        os.ftruncate(fd, size)
    return fd


def test_wipe_empties_a_deep_wide_tree_without_following_links(tmp_path: Path) -> None:
    top = tmp_path / "work"
    top.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    deep = top
    for _ in range(300):
        deep = deep / "d"
    deep.mkdir(parents=True)
    for i in range(200):
        (top / f"f{i}").write_text("x")
    (top / "link").symlink_to(outside)
    locked = top / "locked"
    locked.mkdir()
    (locked / "inner").write_text("x")
    locked.chmod(0)
    os.mkfifo(top / "fifo")
    workdir.wipe(str(top))
    assert list(top.iterdir()) == []
    assert (outside / "keep").read_text() == "x"
    assert top.stat().st_mode & 0o777 == 0o700


def test_wipe_tree_removes_the_dir_itself(tmp_path: Path) -> None:
    (tmp_path / "s1" / "a").mkdir(parents=True)
    workdir.wipe_tree(str(tmp_path / "s1"))
    assert not (tmp_path / "s1").exists()


def test_listing_and_changes(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("1")
    (tmp_path / "gone.txt").write_text("1")
    (tmp_path / "sub").mkdir()
    before = workdir.listing(str(tmp_path))
    assert set(before) == {"a.txt", "gone.txt", "sub"}
    (tmp_path / "gone.txt").unlink()
    (tmp_path / "a.txt").write_text("22")
    (tmp_path / "sub" / "new.txt").write_text("x")
    after = workdir.listing(str(tmp_path))
    assert workdir.changed(before, after) == ["a.txt", "sub", "sub/new.txt", "gone.txt (deleted)"]
    assert workdir.changed(after, after) == []


def test_changes_are_capped() -> None:
    after = {f"f{i:04}": (i, 0, 0, 0) for i in range(workdir.WRITTEN_MAX + 50)}
    assert len(workdir.changed({}, after)) == workdir.WRITTEN_MAX


def test_copy_tree_copies_files_dirs_and_links_as_they_are(tmp_path: Path) -> None:
    src, dst = tmp_path / "s0", tmp_path / "s1"
    (src / "dir").mkdir(parents=True)
    (src / "dir" / "f").write_bytes(b"data")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o750)
    (src / "link").symlink_to("/etc/passwd")
    os.mkfifo(src / "fifo")
    workdir.copy_tree(str(src), str(dst))
    assert (dst / "dir" / "f").read_bytes() == b"data"
    assert (dst / "run.sh").stat().st_mode & 0o777 == 0o750
    assert os.readlink(dst / "link") == "/etc/passwd"
    assert not (dst / "fifo").exists()
    assert dst.stat().st_mode & 0o777 == 0o700


def test_files_in_and_out_round_trip(tmp_path: Path) -> None:
    files = [("a.txt", b"A"), ("deep/er/b.bin", bytes(range(256)))]
    files_fd = _memfd(pack_files(files))
    workdir.write_files(str(tmp_path), files_fd)
    assert (tmp_path / "deep" / "er" / "b.bin").read_bytes() == bytes(range(256))
    (tmp_path / "link").symlink_to(tmp_path / "a.txt")
    (tmp_path / "dir").mkdir()
    asked = ["a.txt", "deep/er/b.bin", "missing", "link", "dir"]
    list_fd = _memfd(json.dumps(asked).encode())
    out_fd = _memfd(size=FETCH_DATA_AT + 1024)
    workdir.fetch_files(str(tmp_path), list_fd, out_fd)
    fetched, errors = read_fetched(out_fd, asked)
    assert fetched == {"a.txt": b"A", "deep/er/b.bin": bytes(range(256))}
    assert errors == {"missing": "no such file", "link": "a symbolic link", "dir": "not a regular file"}
    for fd in (files_fd, list_fd, out_fd):
        os.close(fd)


def test_fetch_refuses_what_does_not_fit(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 2048)
    list_fd = _memfd(b'["big"]')
    out_fd = _memfd(size=FETCH_DATA_AT + 1024)
    workdir.fetch_files(str(tmp_path), list_fd, out_fd)
    fetched, errors = read_fetched(out_fd, ["big"])
    assert fetched == {} and errors["big"].startswith("2048 bytes")


def test_workdir_baseline_and_untouched(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    wd = workdir.Workdir(str(tmp_path))
    wd.record_baseline()
    assert wd.untouched()
    os.utime(tmp_path, (1, 1))
    wd.reset_times()
    assert wd.times is not None and os.stat(tmp_path).st_mtime_ns == wd.times[1]
    (tmp_path / "left").write_text("x" * 10000)
    assert not wd.untouched()


def test_exception_report_names_the_program_line() -> None:
    try:
        exec(compile("x = 1\nraise ValueError('bad')\n", child.FILENAME, "exec"), {})
    except ValueError as exc:
        report = child.exception_report(exc)
    assert report == {"type": "ValueError", "message": "bad", "line": 2}
    try:
        compile("def f(:\n", "<cell 3>", "exec")
    except SyntaxError as exc:
        assert child.exception_report(exc, "<cell 3>")["line"] == 1


@pytest.mark.parametrize(("code", "status"), [(None, 0), (3, 3), (256 + 7, 7), (True, 1), ("message", 1)])
def test_exit_code_as_the_interpreter_gives_it(code: object, status: int) -> None:
    assert child.exit_code(SystemExit(code)) == status


def test_call_fd_counts() -> None:
    assert CallFd.fits({}, 6) and CallFd.fits({}, 9) and not CallFd.fits({}, 7)
    assert CallFd.fits({"judge": "stdin"}, 7) and not CallFd.fits({"judge": "function"}, 6)
    assert CallFd.fits({"judge": "function_single"}, 6)


def test_frames_round_trip_and_cut_frames_read_as_nothing() -> None:
    data = frame({"a": [1, 2]})
    assert unframe(data + b"junk", 100) == ({"a": [1, 2]}, len(data))
    with pytest.raises(ValueError):
        unframe(frame({"a": "x" * 100}, 50), 50)
