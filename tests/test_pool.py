"""The pool as a library: many callers, bad requests, cancellation, images of one's own."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from codeenv import ExecRequest, InvalidRequest, LimitExceedsCap, Limits, SandboxSettings, SlotPool
from codeenv.admission import judge_call
from codeenv.errors import ImageError, PoolClosed
from codeenv.models import JudgeRequest, JudgeResult
from codeenv.sandbox.inside.protocol import GO_TIMEOUT_S
from tests.conftest import RUNNING_THEN_SLEEP, Runner, wait_until_running


@pytest.mark.jail
async def test_many_concurrent_callers_each_get_their_own_result(pool: SlotPool) -> None:
    codes = [f"import sys\nprint({i} * {i}, sys.stdin.read())" for i in range(300)]
    results = await asyncio.gather(*(pool.run(ExecRequest(code=c, stdin=str(i), id=f"call-{i}"))
                                     for i, c in enumerate(codes)))
    for i, r in enumerate(results):
        assert r.status == "ok" and r.stdout == f"{i * i} {i}\n" and r.id == f"call-{i}"
    assert {r.worker for r in results} == {s.worker for s in pool.slots}


@pytest.mark.jail
async def test_bad_requests_raise_invalid_request(pool: SlotPool) -> None:
    with pytest.raises(LimitExceedsCap, match="cannot exceed the configured limit"):
        await pool.run(ExecRequest(code="1", limits={"memory_mb": 10**6}))
    with pytest.raises(ValueError, match="lone surrogates"):  # refused as the request is built
        ExecRequest(code="print('\ud800')")
    with pytest.raises(InvalidRequest, match="lone surrogates"):  # and by the pool, for one built unchecked
        await pool.run(ExecRequest.model_construct(code="print('\ud800')", stdin="", limits=Limits(), id=None,
                                                   profile=None, deadline_s=None, files={}, fetch_files=[]))
    with pytest.raises(InvalidRequest, match="code is .* bytes"):
        await pool.run(ExecRequest(code="#" * (pool.settings.max_code_bytes + 1)))
    with pytest.raises(InvalidRequest, match="unknown profile 'gpu'"):
        await pool.run(ExecRequest(code="1", profile="gpu"))


@pytest.mark.jail
async def test_cancelled_call_frees_its_slot(run: Runner, pool: SlotPool) -> None:
    task = asyncio.create_task(run(RUNNING_THEN_SLEEP, slot=0, wall_s=60))
    await wait_until_running(pool.slots[0].zygotes["light"])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    r = await asyncio.wait_for(run("print('next')", slot=0), 30)
    assert r.status == "ok" and r.stdout == "next\n"


@pytest.mark.jail
async def test_what_the_zygote_made_stays_shared_with_its_calls(run: Runner) -> None:
    """Objects the zygote made before its first fork are immortal: a call that uses them writes
    nothing to them (no copy of their page); what the call makes itself is counted as usual."""
    r = await run("import sys, json\nx = object()\n"
                  "print(sys.getrefcount(json), sys.getrefcount(json.dumps), sys.getrefcount(x))")
    assert r.status == "ok", r
    module, function, own = map(int, r.stdout.split())
    assert module == function == 2**32 - 1
    assert own == 2


@pytest.mark.unit
async def test_closed_pool_refuses_calls() -> None:
    pool = SlotPool(SandboxSettings(slots=1))
    with pytest.raises(PoolClosed):
        await pool.run(ExecRequest(code="1"))


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Jails read images through a user namespace, so the directory must be world-traversable.
    path = Path(tempfile.mkdtemp(prefix="codeenv-test-", dir="/var/tmp"))
    os.chmod(path, 0o755)
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.jail
async def test_a_declared_image_builds_and_runs(state_dir: Path, tmp_path: Path) -> None:
    spec = tmp_path / "image.toml"
    spec.write_text(
        'name = "tiny"\npython = "3.12"\nhash_seed = 7\nenv = { TINY = "yes" }\n'
        '[[profiles]]\nname = "only"\ncovers = ["*"]\npreload = ["fractions"]\n'
    )
    messages: list[str] = []
    settings = SandboxSettings(slots=1, image=str(spec), state_dir=state_dir)
    async with SlotPool(settings, progress=messages.append) as tiny:
        r = await tiny.run(ExecRequest(code="import os, fractions, sys\n"
                                       "print(os.environ['TINY'], os.environ['PYTHONHASHSEED'], sys.version_info[:2])"))
        assert r.status == "ok" and r.stdout == "yes 7 (3, 12)\n"
        assert r.profile == "only" and tiny.image is not None and r.image == tiny.image.short_hash
        assert r.python == tiny.image.python_version and r.python.startswith("3.")
        r = await tiny.run(ExecRequest(code="import sympy"))
        assert r.status == "error" and r.error is not None and r.error.type == "ModuleNotFoundError"
    assert any("byte-compiling" in m for m in messages) and any(m.startswith("built") for m in messages)
    link = state_dir / "images" / "tiny"
    assert link.is_symlink() and (link / "root" / "usr/local/bin/python3.12").exists()
    assert not [p for p in (state_dir / "images").iterdir() if p.name.startswith(".build")]


@pytest.mark.unit
def test_unknown_image_is_a_clear_error(state_dir: Path) -> None:
    from codeenv.sandbox.image import ensure_image

    with pytest.raises(ImageError, match="no image declaration named 'nope'"):
        ensure_image(SandboxSettings(image="nope", state_dir=state_dir))


@pytest.mark.jail
async def test_without_preforking(state_dir: Path) -> None:
    """The fork-on-demand path (also taken at saturation) keeps the same behaviour."""
    settings = SandboxSettings(slots=1, prefork=False)
    async with SlotPool(settings) as p:
        r = await p.run(ExecRequest(code="import sys\nprint(sys.stdin.read()[::-1])", stdin="abc"))
        assert r.status == "ok" and r.stdout == "cba\n"
        r = await p.run(ExecRequest(code="1/0"))
        assert r.error is not None and r.error.line == 1
        r = await p.run(ExecRequest(code="import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()))"))
        assert len(eval(r.stdout)) == 2  # the zygote and this call: no spare waiting
        assert p.restarts == 0


@pytest.mark.jail
async def test_a_judged_call_without_a_spare_child(state_dir: Path) -> None:
    """A judged call's child forked on demand gets its "go" while the worker waits on the judge
    channel (it once waited there until the zygote gave up on the "go", 10 s, and failed)."""
    settings = SandboxSettings(slots=1, prefork=False)
    async with SlotPool(settings) as p:
        request = JudgeRequest.model_validate({"code": "print(int(input()) * 2)", "tests": [
            {"stdin": "2", "expected_stdout": "4"}, {"stdin": "3", "expected_stdout": "6"}]})
        t0 = time.monotonic()
        result = JudgeResult.from_call(await p.run(judge_call(request, settings)))
        assert (result.status, [t.status for t in result.tests]) == ("passed", ["passed", "passed"])
        assert time.monotonic() - t0 < GO_TIMEOUT_S / 2


@pytest.mark.jail
async def test_a_call_that_cannot_start_by_its_deadline_is_not_run(run: Runner, pool: SlotPool) -> None:
    busy = "open('running', 'w').close()\nimport time\ntime.sleep(1.5)"
    blockers = [asyncio.create_task(run(busy, slot=s)) for s in (0, 1)]
    for s in (0, 1):
        await wait_until_running(pool.slots[s].zygotes["light"])
    late = await pool.run(ExecRequest(code="open('ran', 'w')\nprint('ran')", deadline_s=0.3))
    assert late.status == "overloaded" and not late.started and "deadline" in (late.message or "")
    on_time = await pool.run(ExecRequest(code="print('ran')", deadline_s=10))
    assert on_time.status == "ok"
    await asyncio.gather(*blockers)


@pytest.mark.jail
async def test_a_second_pool_may_not_share_the_uid_range(pool: SlotPool) -> None:
    from codeenv.errors import SandboxError

    with pytest.raises(SandboxError, match="CODEENV_UID_BASE"):
        async with SlotPool(SandboxSettings(slots=1, uid_base=pool.uid_base)):
            pass
