"""Pure logic: limits against caps, routing by import lines, image declarations, verdicts."""

from __future__ import annotations

import importlib
import inspect
import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from codeenv import ExecRequest, InvalidRequest, LimitExceedsCap, Limits, SandboxSettings
from codeenv.admission import check, resolve_limits
from codeenv.errors import ImageError
from codeenv.sandbox.image import Profile, content_hash, find_spec
from codeenv.sandbox.inside.protocol import frame, unframe
from codeenv.sandbox.outside.call_io import Exited, Outcome, Ready, TestDone
from codeenv.sandbox.routing import choose_profile, imported_modules
from codeenv.sandbox.verdict import classify
from codeenv.settings import DEFAULT_CAPS, DEFAULT_LIMITS, GatewaySettings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["codeenv", "codeenv.client", "codeenv.rl"])
def test_public_api_is_all_and_only_all(name: str) -> None:
    """Every name of `__all__` exists, and every public name the module defines is in `__all__`."""
    module = importlib.import_module(name)
    exported = set(module.__all__)
    assert len(exported) == len(module.__all__), "a name twice in __all__"
    assert [n for n in module.__all__ if not hasattr(module, n)] == []
    public = {n for n, value in vars(module).items()
              if not n.startswith("_") and not inspect.ismodule(value) and n != "TYPE_CHECKING"}
    assert sorted(public - exported) == []


def test_limits_default_and_lower() -> None:
    v = resolve_limits(Limits(), DEFAULT_LIMITS, DEFAULT_CAPS)
    assert v.wall_s == 10 and v.memory_mb == 1024 and v.output_bytes == 65536 and v.cpu_s == 10
    v = resolve_limits(Limits(wall_s=2.5, memory_mb=100), DEFAULT_LIMITS, DEFAULT_CAPS)
    assert (v.wall_s, v.cpu_s, v.memory_mb) == (2.5, 2.5, 100)
    v = resolve_limits(Limits(wall_s=30), DEFAULT_LIMITS, DEFAULT_CAPS)
    assert v.cpu_s == 30


def test_limit_above_cap_names_the_cap() -> None:
    with pytest.raises(LimitExceedsCap, match=r"limits.wall_s=500 cannot exceed the configured limit of 120"):
        resolve_limits(Limits(wall_s=500), DEFAULT_LIMITS, DEFAULT_CAPS)
    with pytest.raises(InvalidRequest):
        resolve_limits(Limits(memory_mb=10**6), DEFAULT_LIMITS, DEFAULT_CAPS)


def test_the_gateways_check_compares_asked_limits_with_the_caps() -> None:
    settings = SandboxSettings()
    check(ExecRequest(code="print(1)", limits=Limits(wall_s=2.5, output_bytes=1000)), settings)
    with pytest.raises(LimitExceedsCap, match=r"limits.wall_s=500 cannot exceed"):
        check(ExecRequest(code="print(1)", limits=Limits(wall_s=500)), settings)
    with pytest.raises(LimitExceedsCap, match=r"limits.output_bytes"):
        check(ExecRequest(code="x" * 10**6, limits=Limits(output_bytes=10**9)), settings)


@pytest.mark.parametrize("bad", [{"wall_s": -1}, {"wall_s": 0}, {"wall_s": float("nan")},
                                 {"wall_s": float("inf")}, {"memory_mb": 0}, {"open_files": 3},
                                 {"bogus": 1}])
def test_bad_limits_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        Limits(**bad)


def test_settings_refuse_defaults_above_caps() -> None:
    with pytest.raises(ValidationError, match="defaults.wall_s"):
        SandboxSettings(defaults=DEFAULT_LIMITS.model_copy(update={"wall_s": 1000}))


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODEENV_SLOTS", "7")
    monkeypatch.setenv("CODEENV_CAPS__WALL_S", "30")
    monkeypatch.setenv("CODEENV_DEFAULTS__WALL_S", "5")
    s = SandboxSettings()
    assert s.slots == 7 and s.caps.wall_s == 30 and s.defaults.wall_s == 5
    assert s.caps.memory_mb == DEFAULT_CAPS.memory_mb and s.defaults.cpu_s == DEFAULT_LIMITS.cpu_s


PROFILES = [Profile(name="light", covers=["@stdlib"]), Profile(name="math", covers=["*"])]


@pytest.mark.parametrize(("code", "expected"), [
    ("print(1)", "light"),
    ("import math, itertools\nfrom fractions import Fraction", "light"),
    ("import os.path\nimport collections.abc as cabc", "light"),
    ("import sympy", "math"),
    ("from numpy.linalg import inv", "math"),
    ("def f():\n    import scipy.optimize\n", "math"),
    ("import math, numpy as np", "math"),
    ("m = __import__('sympy')", "math"),
    ("import importlib\nimportlib.import_module('numpy')", "math"),
    ("# import numpy in a comment at line start is still counted\n", "light"),
    ("x = 'import sympy'", "light"),
])
def test_routing(code: str, expected: str) -> None:
    assert choose_profile(code.encode(), PROFILES).name == expected


def test_routing_scan_is_bounded() -> None:
    code = b"x = 1\n" * 20000 + b"import sympy\n"
    assert imported_modules(code) == set()


def test_request_rejects_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        ExecRequest.model_validate({"code": "1", "cmd": "rm -rf /"})


def test_image_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="no image declaration named"):
        find_spec("no-such-image")
    bad = tmp_path / "image.toml"
    bad.write_text('name = "Bad Name"\nprofiles = []\n')
    with pytest.raises(ImageError, match="not a valid image declaration"):
        find_spec(str(bad))
    spec, _ = find_spec("python-math")
    assert [p.name for p in spec.profiles] == ["light", "math", "scientific"]


def test_content_hash_sees_content_modes_and_links(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("1")
    h1 = content_hash(tmp_path)
    (tmp_path / "a").write_text("2")
    h2 = content_hash(tmp_path)
    os.chmod(tmp_path / "a", 0o755)
    h3 = content_hash(tmp_path)
    (tmp_path / "l").symlink_to("a")
    h4 = content_hash(tmp_path)
    assert len({h1, h2, h3, h4}) == 4


def _outcome(wait_status: int, **kw: object) -> Outcome:
    exited = {"wait_status": wait_status, "wall_s": 0.1, "cpu_s": 0.05, "timed_out": False, "killed": False}
    exited.update(kw.pop("exited", {}))  # type: ignore[arg-type]
    return Outcome(started=True, exited=Exited.parse(exited), **kw)  # type: ignore[arg-type]


def test_exited_message_is_checked() -> None:
    assert Exited.parse({"op": "exited", "wait_status": 256, "cpu_s": 1, "timed_out": True}) == Exited(
        wait_status=256, cpu_s=1.0, timed_out=True)
    assert Exited.parse({"refused": "no"}).refused == "no" and not Exited.parse({"killed": "yes"}).killed
    for bad in ({"wait_status": "0"}, {"cpu_s": [1]}, {"maxrss_kb": True}):
        with pytest.raises(ValueError):
            Exited.parse(bad)


def test_ready_and_a_tests_done_are_their_own_replies() -> None:
    exited = Exited.parse({"op": "exited", "also_ready": True, "clean": True, "spare": True})
    assert exited.ready == Ready(clean=True, spare=True) and exited.clean
    assert Exited.parse({"op": "exited", "clean": True}).ready is None  # not wiped: a "ready" follows
    assert Ready.parse({"op": "ready", "clean": "yes"}) == Ready()
    assert TestDone.parse({"op": "done", "wait_status": 9, "clean": True}) == TestDone(wait_status=9, clean=True)
    with pytest.raises(ValueError):
        TestDone.parse({"op": "done", "cpu_s": "1"})


def test_framing_round_trips_and_refuses_what_is_not_a_frame() -> None:
    data = frame({"a": [1, "é"]})
    assert unframe(data + b"rest", 1 << 10) == ({"a": [1, "é"]}, len(data))
    for bad in (b"", b"\x05\x00\x00\x00{}", frame({"a": "x" * 100}, 50), frame({"big": "x" * 100})):
        with pytest.raises(ValueError):
            unframe(bad, 64)


def test_verdicts() -> None:
    lim = DEFAULT_LIMITS
    assert classify(_outcome(0), lim).status == "ok"
    assert classify(_outcome(3 << 8), lim).status == "error"
    r = classify(_outcome(9), lim)  # SIGKILL, little CPU: killed
    assert (r.status, r.signal, r.exit_code) == ("killed", 9, None)
    assert classify(_outcome(9, oom_killed=True), lim).status == "memory"
    assert classify(_outcome(0, output_overflow=True), lim).status == "output_limit"
    assert classify(_outcome(9, exited={"timed_out": True}), lim).limit == "wall"
    assert classify(_outcome(24), lim).limit == "cpu"
    # An uncaught MemoryError without an OOM event is the program's error; the report is advisory.
    r = classify(_outcome(1 << 8, report={"error": {"type": "MemoryError", "message": "", "line": 2}}), lim)
    assert r.status == "error" and r.limit is None and r.error is not None and r.error.line == 2
    r = classify(_outcome(0, report={"error": {"type": "MemoryError", "message": "", "line": 2}}), lim)
    assert r.status == "ok"
    r = classify(_outcome(125 << 8, setup_error="boom"), lim)
    assert r.status == "internal_error" and "boom" in (r.message or "")
    # A program that writes "setup_error" into its own report only forges its error field.
    r = classify(_outcome(125 << 8, report={"setup_error": "forged"}), lim)
    assert r.status == "error"
    r = classify(Outcome(started=True, watchdog_fired=True), lim)
    assert r.status == "timeout" and r.started
    # Junk in the report never breaks classification.
    r = classify(_outcome(1 << 8, report={"error": {"type": ["x"], "line": "7", "message": None}}), lim)
    assert r.status == "error" and r.error is not None and r.error.line is None


def test_output_is_capped_in_the_bytes_of_its_json() -> None:
    """Control bytes are six times larger as JSON, invalid UTF-8 three: the cap holds for the answer."""
    import json
    import random

    from codeenv.sandbox.verdict import json_size, json_text

    rnd = random.Random(7)
    alphabet = b'ab\n"\\\x01\x7f\xe2\x82\xac\xff'
    for _ in range(2000):
        raw = bytes(rnd.choice(alphabet) if rnd.random() < 0.7 else rnd.randrange(256)
                    for _ in range(rnd.randrange(80)))
        text = raw.decode("utf-8", "replace")
        encoded = len(json.dumps(text, ensure_ascii=False).encode()) - 2
        assert json_size(text, raw) == encoded, raw
        cap = rnd.randrange(1, 300)
        out, cut = json_text(raw, cap)
        assert len(json.dumps(out, ensure_ascii=False).encode()) - 2 <= cap and cut == (encoded > cap), raw
        assert raw.decode("utf-8", "replace").startswith(out.rstrip("\ufffd"))
    out, cut = json_text(b"\x01" * 600, 1200)
    assert cut and 190 <= len(out) <= 200  # six bytes each


def test_which_queues_run_sessions() -> None:
    """Every queue runs sessions (asked when the routes are made, before the pool has started): the
    embedded one its pool's, the others their pool process's or workers', through remote_sessions."""
    from codeenv.queue.embedded import EmbeddedQueue
    from codeenv.queue.host_socket import HostSocketQueue
    from codeenv.queue.redis import RedisQueue
    from codeenv.queue.remote_sessions import RemoteSessions
    from codeenv.sandbox.pool import SlotPool

    assert EmbeddedQueue(SlotPool(SandboxSettings(slots=1)), 8).sessions is not None
    assert isinstance(HostSocketQueue(Path("/nonexistent.sock")).sessions, RemoteSessions)
    assert isinstance(RedisQueue(GatewaySettings(redis_url="redis://127.0.0.1:1/0")).sessions, RemoteSessions)


def test_the_readme_lists_every_field_code_judge_requests_take() -> None:
    """The README's table of code-judge's request fields names each field of the models, and no other."""
    from codeenv.api.compat import BatchSubmission, Submission

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme.split("Requests take code-judge's fields", 1)[1].split("\n\n", 2)[1]
    documented = {name for row in table.splitlines()[2:]
                  for name in re.findall(r"`(\w+)(?:: \"\w+\")?`", row.split("|")[1])}
    assert documented == set(Submission.model_fields) | set(BatchSubmission.model_fields), documented


def test_host_pids_maps_each_namespace_pid_reading_each_status_once() -> None:
    """A fork batch's pids in its family's namespace, mapped to ours in one pass (session_forks)."""
    import subprocess
    import time

    from codeenv.sandbox.outside.process import host_pid, host_pids

    if os.geteuid() != 0:
        pytest.skip("a pid namespace of its own needs root here")

    def children(pid: int) -> list[int]:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    # PID 1 of a new pid namespace (its init dies with unshare, and every process of it with its init)
    # and PID 2 there, its child
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--", "sh", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while not (children(outer.pid) and children(children(outer.pid)[0])):
            assert time.monotonic() < deadline, "the namespace's processes did not start"
            time.sleep(0.01)
        first = children(outer.pid)[0]
        second = children(first)[0]
        candidates = [os.getpid(), outer.pid, first, second, 2 ** 22 + 1]  # the last: no such process
        assert host_pids(candidates, [2, 1, 7]) == {1: first, 2: second}
        assert host_pids(candidates, []) == {}
        assert host_pid(candidates, 2) == second and host_pid(candidates, 7) is None
    finally:
        outer.kill()
        outer.wait()
