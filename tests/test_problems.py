"""Problem packages by reference (issue 39): a problem's tests, checker and limits uploaded once
(PUT /v1/problems/{sha256}) and judged by name; 409 problem_unknown where it is not held, which the
client answers by uploading and sending again; in Redis mode, workers fetch a package from the
gateway it was uploaded to (signed by a ticket, never through Redis), evict it and fetch it again."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from codeenv.bench.services import Service, free_port, start_codeenv
from codeenv.client import AsyncClient, Problem
from codeenv.disk_lru import DiskLRU
from codeenv.models import JudgeResult
from codeenv.problems import ProblemStore
from codeenv.settings import GatewaySettings
from tests.conftest import GatewayClient, Served
from tests.test_checkers import OPEN_R1_CHECKER
from tests.test_redis import WorkerProcess, wait_for_workers

DOUBLE = "print(int(input()) * 2)"


def package(n: int = 3, **extra: Any) -> tuple[bytes, str]:
    """A package of `n` doubling tests (its own, by a nonce in its limits-free body) and its name."""
    nonce = uuid.uuid4().int % 10**9
    tests = [{"stdin": str(nonce + i), "expected_stdout": str(2 * (nonce + i))} for i in range(n)]
    body = json.dumps({"tests": tests, **extra}).encode()
    return body, hashlib.sha256(body).hexdigest()


async def put(client: httpx.AsyncClient, body: bytes, sha: str | None = None, **headers: str) -> httpx.Response:
    return await client.put(f"/v1/problems/{sha or hashlib.sha256(body).hexdigest()}", content=body,
                            headers={"content-type": "application/json", **headers})


@pytest.mark.jail
async def test_a_problem_uploaded_once_judges_many_submissions(gateway: GatewayClient) -> None:
    body, sha = package(4, limits={"cpu_s": 0.5})
    async with gateway() as client:
        first = await put(client, body)
        again = await put(client, body)
        assert first.status_code == 201, first.text
        assert first.json() == {"sha256": sha, "tests": 4, "bytes": len(body), "created": True}
        assert again.status_code == 200 and again.json()["created"] is False
        answers = await asyncio.gather(*(client.post("/v1/judge", json={"code": code, "problem": sha}) for code in (
            DOUBLE, "print(int(input()) * 3)", "while True: pass", "print(int(input()) * 2)  # again")))
        results = [JudgeResult.model_validate(a.json()) for a in answers]
        assert [r.status for r in results] == ["passed", "failed", "failed", "passed"], results
        assert results[1].passed == 0 and results[1].total == 4
        # The package's limits: its cpu_s (0.5) stopped the loop; the request's own override them.
        assert {t.limit for t in results[2].tests} == {"cpu"} and results[2].tests[0].cpu_s < 1.5
        slow = await client.post("/v1/judge", json={"code": "import time\nx = 0\nfor i in range(10**7): x += i\n"
                                                            "print(int(input()) * 2)", "problem": sha,
                                                    "limits": {"cpu_s": 10}, "stop_on_failure": True})
        assert slow.json()["status"] == "passed", slow.text
        # The same problem in a batch, beside an inline one; each by its own tests.
        batch = await client.post("/v1/judge/batch", json={"requests": [
            {"code": DOUBLE, "problem": sha},
            {"code": DOUBLE, "tests": [{"stdin": "1", "expected_stdout": "3"}]}]})
        assert [r["status"] for r in batch.json()["results"]] == ["passed", "failed"]


@pytest.mark.jail
async def test_a_package_with_a_checker_or_function_calls(gateway: GatewayClient) -> None:
    checked, checked_sha = package(1, checker={"type": "open_r1", "code": OPEN_R1_CHECKER})
    calls = json.dumps({"fn_name": "add", "tests": [{"args": [1, 2], "expected": 3},
                                                    {"args": [uuid.uuid4().int % 1000, 0], "expected": None}]})
    async with gateway() as client:
        assert (await put(client, checked)).status_code == 201
        right = await client.post("/v1/judge", json={"code": DOUBLE, "problem": checked_sha})
        wrong = await client.post("/v1/judge", json={"code": "print('no')", "problem": checked_sha})
        assert right.json()["status"] == "passed" and right.json()["tests"][0]["score"] == 1, right.text
        assert wrong.json()["status"] == "failed"
        assert (await put(client, calls.encode())).status_code == 201
        sha = hashlib.sha256(calls.encode()).hexdigest()
        add = await client.post("/v1/judge", json={"code": "def add(a, b):\n    return a + b if b else None",
                                                   "problem": sha})
        assert add.json()["status"] == "passed", add.text
        # A function-call problem cannot judge C++: the worker says so (422), nothing runs.
        cpp = await client.post("/v1/judge", json={"code": "int main() {}", "language": "cpp", "problem": sha})
        assert cpp.status_code == 422 and "fn_name" in cpp.json()["detail"], cpp.text


@pytest.mark.jail
async def test_what_is_refused_and_why(gateway: GatewayClient) -> None:
    body, sha = package(2)
    unknown = hashlib.sha256(b"never uploaded").hexdigest()
    async with gateway(problem_max_mb=1) as client:
        judged = await client.post("/v1/judge", json={"code": DOUBLE, "problem": unknown})
        assert judged.status_code == 409 and judged.json()["detail"].startswith("problem_unknown:"), judged.text
        assert f"/v1/problems/{unknown}" in judged.json()["detail"]
        batch = await client.post("/v1/judge/batch", json={"requests": [{"code": DOUBLE, "problem": unknown}]})
        [item] = batch.json()["results"]
        assert item["status"] == "rejected" and item["refusal"] == "problem_unknown"
        # The body's hash is its name; JSON only; a package, valid; within problem_max_mb.
        assert (await put(client, body, unknown)).status_code == 400
        plain = await client.put(f"/v1/problems/{sha}", content=body, headers={"content-type": "text/plain"})
        assert plain.status_code == 415
        assert (await client.put("/v1/problems/NOT-A-SHA", content=body,
                                 headers={"content-type": "application/json"})).status_code == 422
        for bad, why in ((b'{"tests": []}', "tests"), (b"[1, 2", "problem"),
                         (json.dumps({"tests": [{"stdin": "1"}]}).encode(), "expected_stdout"),
                         (json.dumps({"tests": [{"args": [1], "expected": 1}], "fn_name": "f",
                                      "checker": {"type": "cms", "code": "x"}}).encode(), "checker")):
            refused = await put(client, bad)
            assert refused.status_code == 422 and why in refused.text, (bad, refused.text)
        big = json.dumps({"tests": [{"stdin": "x" * (2 << 20), "expected_stdout": "x"}]}).encode()
        assert (await put(client, big)).status_code == 413
        assert (await client.get(f"/v1/problems/{unknown}")).status_code == 404
        # A problem's request does not also send what its package holds.
        assert (await put(client, body)).status_code == 201
        both = await client.post("/v1/judge", json={"code": DOUBLE, "problem": sha,
                                                    "tests": [{"stdin": "1", "expected_stdout": "2"}]})
        assert both.status_code == 422 and "package" in both.text
        got = await client.get(f"/v1/problems/{sha}")
        assert got.status_code == 200 and got.content == body


@pytest.mark.jail
async def test_a_worker_fetches_with_a_ticket_and_nothing_else(gateway: GatewayClient) -> None:
    body, sha = package(1)
    other_body, other = package(1)
    token = "t" * 32
    auth = {"authorization": f"Bearer {token}"}
    async with gateway(token=token, headers=auth) as client:
        assert (await put(client, body)).status_code == 201
        assert (await put(client, other_body)).status_code == 201
        store = ProblemStore.from_settings(GatewaySettings())
        ticket = store.ticket(sha)
        anon = {"authorization": ""}
        assert (await client.get(f"/v1/problems/{sha}", headers=anon)).status_code == 401
        assert (await client.get(f"/v1/problems/{sha}?ticket={ticket}", headers=anon)).content == body
        assert (await client.get(f"/v1/problems/{other}?ticket={ticket}", headers=anon)).status_code == 401
        assert (await client.get(f"/v1/problems/{sha}?ticket={'0' * 64}", headers=anon)).status_code == 401
        put_with_ticket = await client.put(f"/v1/problems/{sha}?ticket={ticket}", content=body,
                                           headers={**anon, "content-type": "application/json"})
        assert put_with_ticket.status_code == 401


@pytest.mark.jail
async def test_the_client_uploads_once_and_again_after_an_eviction(served: Served) -> None:
    problem = Problem(tests=[{"stdin": str(uuid.uuid4().int % 1000), "expected_stdout": "x"}],
                      checker={"type": "open_r1", "code": OPEN_R1_CHECKER})
    rebuilt = Problem(tests=[dict(t) for t in json.loads(problem.body)["tests"]],
                      checker={"type": "open_r1", "code": OPEN_R1_CHECKER})
    assert rebuilt.sha256 == problem.sha256 and rebuilt.body == problem.body
    async with served() as url, AsyncClient(url) as client:
        first = await client.judge(DOUBLE, problem=problem, id="mine")
        assert client.step_metrics()["codeenv/calls"] == 1  # its refused first try not counted apart
        sent = client.requests_sent
        many = await asyncio.gather(*(client.judge(DOUBLE, problem=problem) for _ in range(6)))
        assert first.status == "failed" and first.id == "mine", first  # "x" is not the double: the checker says 0
        assert [r.status for r in many] == ["failed"] * 6
        assert client.requests_sent - sent <= 6  # no upload among them
        # Gone from the gateway's disk (its LRU): the client's next call uploads it again by itself.
        store = ProblemStore.from_settings(GatewaySettings())
        store.files.remove(problem.sha256 + ".json")
        again = await client.judge("print('x')", problem=problem)
        assert again.status == "passed", again
        # By name alone, a problem not held is the caller's to upload.
        missing = await client.judge(DOUBLE, problem=hashlib.sha256(b"nothing").hexdigest())
        assert missing.status == "rejected" and missing.refusal == "problem_unknown"


@pytest.mark.unit
def test_the_disk_cache_removes_the_least_recently_used_first(tmp_path: Path) -> None:
    lru = DiskLRU(tmp_path, 4 << 10)
    for name in ("aa1", "bb2", "cc3"):
        assert lru.write(name, b"x" * 1000)
    assert lru.read("aa1") == b"x" * 1000  # used now: bb2 is the oldest
    os.utime(lru.path("bb2"), (1, 1))
    assert lru.write("dd4", b"y" * 1000)
    assert lru.write("ee5", b"y" * 1000)  # over 4 KiB: down to 3 KiB, oldest first
    assert lru.read("bb2") is None and lru.read("ee5") is not None
    assert not lru.write("big", b"z" * 2000)  # over a quarter of the cap: not kept


async def until_ready(url: str, token: str, timeout_s: float = 90) -> None:
    """Until a gateway with a token answers /readyz (Service.await_ready sends none)."""
    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {token}"}) as http:
        for _ in range(int(timeout_s * 10)):
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get("/readyz")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} was not ready within {timeout_s:g}s")


@pytest.mark.jail
@pytest.mark.redis
@pytest.mark.slow
async def test_workers_fetch_a_package_from_its_gateway_evict_it_and_fetch_it_again(
        redis_server: Service, tmp_path: Path) -> None:
    prefix = uuid.uuid4().hex[:12]
    token = "k" * 32
    workers = [WorkerProcess(redis_server, prefix, tmp_path / f"w{i}.log", slots=1) for i in range(2)]
    for i, worker in enumerate(workers):
        worker.env["CODEENV_PROBLEM_DIR"] = str(tmp_path / f"w{i}")
    await asyncio.gather(*(w.start() for w in workers))
    gateway = start_codeenv("serve", "--redis", redis_server.url, "--no-local-worker", "--log-level", "warning",
                            "--token", token, port=free_port(),
                            env={**workers[0].env, "CODEENV_PROBLEM_DIR": str(tmp_path / "gateway")})
    problem = Problem(tests=[{"stdin": str(i), "expected_stdout": str(2 * i)} for i in range(40)])
    try:
        await wait_for_workers(redis_server, prefix, 2)
        assert gateway.url is not None
        await until_ready(gateway.url, token)
        async with AsyncClient(gateway.url, token=token, max_batch=64) as client:
            held = [tmp_path / f"w{i}" / problem.sha256[:2] / f"{problem.sha256}.json" for i in range(2)]
            for _ in range(5):  # until both workers have judged some
                results = await asyncio.gather(*(client.judge(DOUBLE, problem=problem) for _ in range(16)))
                assert [r.status for r in results] == ["passed"] * 16, results
                if all(path.exists() for path in held):
                    break
            for path in held:  # each worker fetched it from the gateway, into its own disk
                assert path.read_bytes() == problem.body
            # A worker restarted with its disk emptied (evicted) fetches the package again.
            assert await workers[0].stop() == 0
            shutil.rmtree(tmp_path / "w0")
            await workers[0].start()
            await wait_for_workers(redis_server, prefix, 2)
            fetched_again = tmp_path / "w0" / problem.sha256[:2] / f"{problem.sha256}.json"
            for _ in range(5):  # until the restarted worker has judged some (it fetches the package again)
                again = await asyncio.gather(*(client.judge(DOUBLE, problem=problem) for _ in range(16)))
                assert [r.status for r in again] == ["passed"] * 16
                if fetched_again.exists():
                    break
            assert fetched_again.read_bytes() == problem.body
            # Never through Redis: no key holds the package's bytes.
            r = aioredis.Redis(port=redis_server.port)
            try:
                for key in [k async for k in r.scan_iter(f"{prefix}*")]:
                    if await r.type(key) == b"string":
                        assert problem.body[:200] not in (await r.get(key) or b"")
            finally:
                await r.aclose()
    finally:
        await gateway.stop_async(60)
        for w in workers:
            await w.stop()


#: An IOI-style task in three subtasks: n up to 10, up to 1000, any n (a test may be in several).
SUBTASK_TESTS = [{"stdin": str(n), "expected_stdout": str(n * (n + 1) // 2)} for n in (3, 10, 500, 1000, 10**6, 10**7)]
SUBTASKS = [{"points": 20, "tests": [0, 1]}, {"points": 30, "tests": [0, 1, 2, 3]}, {"points": 50, "tests": [4, 5, 2]}]
#: Right for small n, wrong from 500 on (an overflow of its own making).
SMALL_ONLY = "n = int(input())\nprint(n * (n + 1) // 2 if n <= 10 else 0)"
#: Right, but quadratic: too slow for the last subtask.
QUADRATIC = "n = int(input())\ns = 0\nfor i in range(n + 1):\n    s += i\nprint(s if n < 10**6 else sum(range(n + 1)))"


@pytest.mark.jail
async def test_subtasks_score_the_lowest_of_their_tests_and_skip_what_cannot_score(gateway: GatewayClient) -> None:
    async with gateway() as client:
        async def judged(code: str, **extra: Any) -> dict[str, Any]:
            answer = await client.post("/v1/judge", json={"code": code, "tests": SUBTASK_TESTS, "subtasks": SUBTASKS,
                                                          **extra})
            assert answer.status_code == 200, answer.text
            return dict(answer.json())

        right = await judged("n = int(input())\nprint(n * (n + 1) // 2)")
        assert right["status"] == "passed" and right["score"] == 100
        assert [s["score"] for s in right["subtasks"]] == [20, 30, 50]
        small = await judged(SMALL_ONLY)
        assert small["score"] == 20 and [s["score"] for s in small["subtasks"]] == [20, 0, 0]
        # Test 2 failed subtasks 1 and 2: test 3 (subtask 1 only) and tests 4, 5 (subtask 2) never ran.
        assert [t["status"] for t in small["tests"]] == ["passed", "passed", "wrong_answer", "skipped", "skipped",
                                                         "skipped"], small["tests"]
        assert "every subtask" in small["tests"][3]["message"]
        # A time limit that stops one subtask's test: that subtask alone scores 0.
        slow = await judged("import time\nn = int(input())\nif n == 10**6: time.sleep(5)\nprint(n * (n + 1) // 2)",
                            limits={"cpu_s": 1, "wall_s": 2})
        assert slow["score"] == 50 and slow["tests"][4]["status"] == "timeout" and slow["tests"][5]["status"] == \
            "skipped", slow["tests"]
        # Out of range: a clear 422.
        bad = await client.post("/v1/judge", json={"code": SMALL_ONLY, "tests": SUBTASK_TESTS,
                                                   "subtasks": [{"points": 1, "tests": [6]}]})
        assert bad.status_code == 422 and "names test 6" in bad.text


@pytest.mark.jail
async def test_a_packages_subtasks_and_a_checkers_partial_scores(gateway: GatewayClient) -> None:
    cms = ("import sys\n_, answer, output = sys.argv[1:4]\nwant, got = open(answer).read().split(), "
           "open(output).read().split()\nprint(1 if got == want else 0.5 if got and got[0].lower() == want[0] else 0)")
    body = json.dumps({"tests": [{"stdin": "a", "expected_stdout": "a"}, {"stdin": "b", "expected_stdout": "b"},
                                 {"stdin": "c", "expected_stdout": "c"}],
                       "checker": {"type": "cms", "code": cms, "language": "python"},
                       "subtasks": [{"points": 40, "tests": [0]}, {"points": 60, "tests": [1, 2]}],
                       "limits": {"cpu_s": 2}, "compare": "tokens"}).encode()
    async with gateway() as client:
        assert (await put(client, body)).status_code in (200, 201)  # held already after an earlier run
        sha = hashlib.sha256(body).hexdigest()
        answer = await client.post("/v1/judge", json={"code": "s = input()\nprint(s.upper() if s == 'c' else s)",
                                                      "problem": sha})
        result = answer.json()
        assert [t["score"] for t in result["tests"]] == [1, 1, 0.5], result
        assert [s["score"] for s in result["subtasks"]] == [40, 30] and result["score"] == 70


@pytest.mark.jail
async def test_time_scale_scales_a_problems_time_limits(gateway: GatewayClient) -> None:
    body, sha = package(1, limits={"cpu_s": 0.4})
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8: pass\nprint(int(input()) * 2)"
    async with gateway() as client:
        assert (await put(client, body)).status_code == 201
        tight = await client.post("/v1/judge", json={"code": spin, "problem": sha})
        scaled = await client.post("/v1/judge", json={"code": spin, "problem": sha, "time_scale": 3})
        assert tight.json()["tests"][0]["status"] == "timeout", tight.text
        assert scaled.json()["status"] == "passed", scaled.text
        # Scaled past the server's caps: at the caps (a time limit the request could have asked for).
        capped = await client.post("/v1/judge", json={"code": DOUBLE, "tests": [{"stdin": "1", "expected_stdout": "2"}],
                                                      "limits": {"cpu_s": 100}, "time_scale": 10})
        assert capped.json()["status"] == "passed", capped.text


#: An interactive problem (testlib's protocol): guess the number in the input file; the answer file
#: holds the most guesses allowed; the output file, the guesses it took.
GUESS_INTERACTOR = """import sys
inp, out, ans = sys.argv[1:4]
secret, most = int(open(inp).read()), int(open(ans).read())
for q in range(1, most + 1):
    line = sys.stdin.readline()
    if not line:
        print("no guess", file=sys.stderr)
        sys.exit(1)
    guess = int(line)
    if guess == secret:
        open(out, "w").write(f"{q}\\n")
        print("=", flush=True)
        sys.exit(0)
    print("<" if guess < secret else ">", flush=True)
print(f"more than {most} guesses", file=sys.stderr)
sys.exit(1)
"""
BISECT = """lo, hi = 1, 10**6
while True:
    mid = (lo + hi) // 2
    print(mid, flush=True)
    said = input()
    if said == "=":
        break
    lo, hi = (mid + 1, hi) if said == "<" else (lo, mid - 1)
"""
BISECT_CPP = r"""#include <iostream>
#include <string>
int main() {
    long lo = 1, hi = 1000000;
    while (true) {
        long mid = (lo + hi) / 2;
        std::cout << mid << std::endl;
        std::string said; std::cin >> said;
        if (said == "=") return 0;
        if (said == "<") lo = mid + 1; else hi = mid - 1;
    }
}
"""
GUESS_TESTS = [{"stdin": str(n), "expected_stdout": "20"} for n in (1, 777, 424242, 10**6)]


@pytest.mark.jail
async def test_an_interactive_problem_talks_with_the_submission(gateway: GatewayClient) -> None:
    interactor = {"code": GUESS_INTERACTOR, "language": "python"}
    async with gateway() as client:
        async def judged(code: str, **extra: Any) -> dict[str, Any]:
            answer = await client.post("/v1/judge", json={"code": code, "tests": GUESS_TESTS, "interactor": interactor,
                                                          "limits": {"cpu_s": 2, "wall_s": 3}, **extra})
            assert answer.status_code == 200, answer.text
            return dict(answer.json())

        right = await judged(BISECT)
        assert right["status"] == "passed" and right["passed"] == 4, right
        linear = await judged("i = 0\nwhile True:\n    i += 1\n    print(i, flush=True)\n    if input() == '=':\n"
                              "        break")
        # 1 is found at once; the others take more than 20 guesses: the interactor's wrong answer
        # (the program then dies of the closed pipe: the interactor's verdict stands).
        assert [t["status"] for t in linear["tests"]] == ["passed"] + ["wrong_answer"] * 3, linear["tests"]
        assert "more than 20 guesses" in linear["tests"][1]["message"]
        silent = await judged("import time\ntime.sleep(30)")
        assert {t["status"] for t in silent["tests"]} == {"timeout"}, silent["tests"]
        hunting = await judged("import os\nprint(sorted(os.listdir('/work')), os.path.exists('/work/check/answer'), "
                               "flush=True)\nprint(open('/work/check/input').read(), flush=True)\ninput()")
        assert hunting["passed"] == 0 and {t["status"] for t in hunting["tests"]} == {"wrong_answer"}, hunting
        cpp = await judged(BISECT_CPP, language="cpp")
        assert cpp["status"] == "passed", cpp
        # A function-call problem has no interactor; an interactive one needs its interactor.
        bad = await client.post("/v1/judge", json={"code": BISECT, "tests": GUESS_TESTS, "interactive": True})
        assert bad.status_code == 422 and "interactor" in bad.text


@pytest.mark.jail
async def test_an_interactive_package_whose_checker_reads_the_interactors_file(gateway: GatewayClient) -> None:
    # The checker (CMS) scores the guesses the interactor counted: 1 within 20, 0.5 within 40.
    checker = ("import sys\n_, answer, output = sys.argv[1:4]\nq = int(open(output).read())\n"
               "print(1 if q <= 20 else 0.5 if q <= 40 else 0)")
    tests = [{"stdin": str(n), "expected_stdout": "60"} for n in (5, 500_000)]
    body = json.dumps({"tests": tests, "interactor": {"code": GUESS_INTERACTOR, "language": "python"},
                       "checker": {"type": "cms", "code": checker, "language": "python"},
                       "limits": {"cpu_s": 2, "wall_s": 3}}).encode()
    # 1 to 15 first, then bisection: 5 at its 5th guess, 500000 after 21 to 35 guesses.
    slower = ("for i in range(1, 16):\n    print(i, flush=True)\n    if input() == '=':\n        raise SystemExit\n"
              + BISECT.replace("lo, hi = 1, 10**6", "lo, hi = 16, 10**6"))
    async with gateway() as client:
        assert (await put(client, body)).status_code in (200, 201)  # held already after an earlier run
        sha = hashlib.sha256(body).hexdigest()
        fast = (await client.post("/v1/judge", json={"code": BISECT, "problem": sha})).json()
        slow = (await client.post("/v1/judge", json={"code": slower, "problem": sha})).json()
        assert fast["status"] == "passed" and [t["score"] for t in fast["tests"]] == [1, 1], fast
        assert [t["score"] for t in slow["tests"]] == [1, 0.5] and slow["tests"][1]["status"] == "wrong_answer", slow


#: The add problem's interactor in C++ (compiled once, as a checker is): it sends the numbers, wants the sum.
ADD_INTERACTOR_CPP = r"""#include <fstream>
#include <iostream>
int main(int argc, char** argv) {
    std::ifstream in(argv[1]), ans(argv[3]);
    long long a, b, want, got;
    in >> a >> b; ans >> want;
    std::cout << a << " " << b << std::endl;
    if (!(std::cin >> got) || got != want) { std::cerr << "wrong sum"; return 1; }
    return 0;
}
"""


@pytest.mark.jail
async def test_a_cpp_interactor_and_a_submission_that_stops_reading(gateway: GatewayClient,
                                                                    cpp_toolchain: None) -> None:
    tests = [{"stdin": "1 2", "expected_stdout": "3"}, {"stdin": "20 22", "expected_stdout": "42"}]
    async with gateway() as client:
        async def judged(code: str) -> dict[str, Any]:
            answer = await client.post("/v1/judge", json={"code": code, "tests": tests,
                                                          "interactor": {"code": ADD_INTERACTOR_CPP}})
            assert answer.status_code == 200, answer.text
            return dict(answer.json())

        honest = await judged("a, b = map(int, input().split())\nprint(a + b)")
        assert honest["status"] == "passed", honest
        # It ends before the interactor is done with it: the interactor reads no sum (or dies of
        # SIGPIPE writing to it): the submission's doing (a wrong answer), never the service's.
        gone = await judged("import os\nos.close(0)\nimport sys\nsys.exit(0)")
        assert [t["status"] for t in gone["tests"]] == ["wrong_answer"] * 2, gone["tests"]


@pytest.mark.jail
async def test_a_gateway_that_cannot_store_a_package_says_so(gateway: GatewayClient) -> None:
    body, _ = package(1)
    async with gateway(problem_dir="/proc/codeenv-nowhere") as client:
        answer = await put(client, body)
        assert answer.status_code == 507 and "cannot store" in answer.text, answer.text


#: CMS's Communication task (one process, std_io), as open-r1's cms_ioi package runs it: the manager
#: gets the pipes from and to the submission as its two arguments, the test's input on its stdin,
#: and prints a score from 0 to 1 (a message on stderr).
SQUARE_MANAGER = """import sys
from_user, to_user = sys.argv[1:3]
n = int(sys.stdin.read())
with open(to_user, "w") as out, open(from_user) as back:
    print(n, file=out, flush=True)
    said = back.readline().strip()
score = 1 if said == str(n * n) else 0.5 if said == str(-n * n) else 0
print(score)
print("translate:success" if score == 1 else "translate:wrong", file=sys.stderr)
"""
SQUARE_MANAGER_CPP = r"""#include <fstream>
#include <iostream>
#include <string>
int main(int argc, char** argv) {
    long long n; std::cin >> n;
    std::ofstream out(argv[2]); std::ifstream back(argv[1]);
    out << n << std::endl;
    std::string said; back >> said;
    std::cout << (said == std::to_string(n * n) ? "1" : "0") << std::endl;
    std::cerr << "translate:done" << std::endl;
}
"""


@pytest.mark.jail
async def test_a_communication_task_with_a_manager(gateway: GatewayClient, cpp_toolchain: None) -> None:
    tests = [{"stdin": str(n), "expected_stdout": ""} for n in (3, 12)]
    async with gateway() as client:
        async def judged(code: str, manager: str, language: str = "python") -> dict[str, Any]:
            answer = await client.post("/v1/judge", json={"code": code, "tests": tests, "interactor": {
                "code": manager, "language": language, "protocol": "manager"}})
            assert answer.status_code == 200, answer.text
            return dict(answer.json())

        right = await judged("n = int(input())\nprint(n * n)", SQUARE_MANAGER)
        assert right["status"] == "passed" and [t["score"] for t in right["tests"]] == [1, 1], right
        half = await judged("n = int(input())\nprint(-n * n)", SQUARE_MANAGER)
        assert [(t["status"], t["score"]) for t in half["tests"]] == [("wrong_answer", 0.5)] * 2, half
        assert half["tests"][0]["message"] == "translate:wrong"
        gone = await judged("pass", SQUARE_MANAGER)
        assert {t["status"] for t in gone["tests"]} == {"wrong_answer"}, gone
        cpp = await judged("n = int(input())\nprint(n * n)", SQUARE_MANAGER_CPP, "cpp")
        assert cpp["status"] == "passed", cpp
        # manager_args come after the pipes' paths
        with_args = await client.post("/v1/judge", json={"code": "n = int(input())\nprint(n * n)", "tests": tests,
                                                         "interactor": {
            "code": SQUARE_MANAGER.replace("from_user, to_user = sys.argv[1:3]",
                                           "from_user, to_user, word = sys.argv[1:4]\nassert word == 'bonus'"),
            "language": "python", "protocol": "manager", "manager_args": ["bonus"]}})
        assert with_args.json()["status"] == "passed", with_args.text


@pytest.mark.jail
async def test_input_mode_file_on_the_native_judge(gateway: GatewayClient) -> None:
    code = "a, b = map(int, open('input.txt').read().split())\nopen('output.txt', 'w').write(f'{a + b}\\n')"
    body, sha = package(2, input_mode="file")
    async with gateway() as client:
        assert (await put(client, body)).status_code == 201
        doubled = "n = int(open('input.txt').read())\nopen('output.txt', 'w').write(str(2 * n))"
        by_reference = await client.post("/v1/judge", json={"code": doubled, "problem": sha})
        assert by_reference.json()["status"] == "passed", by_reference.text
        inline = await client.post("/v1/judge", json={"code": code, "input_mode": "file", "stop_on_failure": True,
                                                      "tests": [{"stdin": "1 2", "expected_stdout": "3"},
                                                                {"stdin": "5 5", "expected_stdout": "10"}]})
        assert inline.json()["status"] == "passed", inline.text
        bad = await client.post("/v1/judge", json={"code": code, "input_mode": "file", "fn_name": "f",
                                                   "tests": [{"args": [1], "expected": 1}]})
        assert bad.status_code == 422 and "input_mode file" in bad.text


#: A manager of N processes (argv: from and to each, in turn): process k gets x_k (the input's k-th
#: number) and must answer x_k * x_k + k.
SQUARES_MANAGER_CPP = r"""#include <fstream>
#include <iostream>
#include <vector>
int main(int argc, char** argv) {
    int n = (argc - 1) / 2; bool right = true;
    std::vector<long long> x(n);
    for (auto& v : x) std::cin >> v;
    for (int k = 0; k < n; k++) {
        std::ofstream to(argv[2 + 2 * k]); to << x[k] << std::endl;
    }
    for (int k = 0; k < n; k++) {
        std::ifstream from(argv[1 + 2 * k]); long long got;
        if (!(from >> got) || got != x[k] * x[k] + k) right = false;
    }
    std::cout << (right ? 1 : 0) << std::endl;
    std::cerr << (right ? "translate:success" : "translate:wrong") << std::endl;
}
"""
SQUARES_STD_IO = r"""#include <cstdlib>
#include <iostream>
int main(int argc, char** argv) {
    long long x; std::cin >> x;
    std::cout << x * x + (argc > 1 ? std::atoi(argv[1]) : 0) << std::endl;
}
"""
SQUARES_FIFO_IO = r"""#include <cstdlib>
#include <fstream>
#include <iostream>
int main(int argc, char** argv) {
    std::ifstream in(argv[1]); std::ofstream out(argv[2]);
    long long x; in >> x;
    out << x * x + (argc > 3 ? std::atoi(argv[3]) : 0) << std::endl;
    std::cout << "to no one" << std::endl;
}
"""


@pytest.mark.jail
@pytest.mark.parametrize(("user_io", "code"), [("std_io", SQUARES_STD_IO), ("fifo_io", SQUARES_FIFO_IO)])
async def test_a_manager_talks_with_several_processes(gateway: GatewayClient, cpp_toolchain: None,
                                                      user_io: str, code: str) -> None:
    async with gateway() as client:
        async def judged(source: str, processes: int, **extra: Any) -> dict[str, Any]:
            answer = await client.post("/v1/judge", json={"code": source, "language": "cpp", **extra, "tests": [
                {"stdin": " ".join(str(5 + k) for k in range(processes)), "expected_stdout": ""}], "interactor": {
                "code": SQUARES_MANAGER_CPP, "protocol": "manager", "processes": processes, "user_io": user_io}})
            assert answer.status_code == 200, answer.text
            return dict(answer.json())

        for processes in (1, 2, 3):
            right = await judged(code, processes)
            assert right["status"] == "passed" and right["tests"][0]["score"] == 1, (processes, right)
        wrong = await judged(code.replace("x * x", "x * 2"), 2)
        assert wrong["tests"][0]["status"] == "wrong_answer" and wrong["tests"][0]["score"] == 0, wrong
        # One process that never answers: the test's time limit, not a hang.
        stuck = await judged(code.replace("long long x;", "for (;;) {} long long x;"), 2,
                             limits={"cpu_s": 1, "wall_s": 2})
        assert stuck["tests"][0]["status"] == "timeout", stuck
    async with gateway() as client:  # several processes run a compiled program: C++ only
        python = await client.post("/v1/judge", json={"code": "print(1)", "tests": [
            {"stdin": "1", "expected_stdout": ""}], "interactor": {"code": "x", "protocol": "manager",
                                                                   "processes": 2}})
        assert python.status_code == 422 and "C++" in python.text, python.text
