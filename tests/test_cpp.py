"""C++ (issue 38): compiled once in a jail of its own, cached, its binary run per test in the slot's
jail; every verdict, hostile compiles answered as a compile error or a limit, and /v1/execute."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from sandbox_fusion import RunCodeRequest, SummaryMapping, run_code, summary_run_code_result

from codeenv import SlotPool
from codeenv.models import LimitName
from codeenv.sandbox.cgroups import CgroupTree
from codeenv.sandbox.compiler import Compiler
from codeenv.settings import GatewaySettings, SandboxSettings
from tests.conftest import GatewayClient, pool_app, serving

pytestmark = pytest.mark.jail

SUM = """#include <bits/stdc++.h>
using namespace std;
int main() { long long a, b; cin >> a >> b; cout << a + b << "\\n"; }
"""


@pytest.fixture(scope="module")
def toolchain(cpp_toolchain: None) -> None:
    """(The session's, built if needed.)"""


@pytest_asyncio.fixture
async def api(toolchain: None, gateway: GatewayClient) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway(judge_max_tests=50, judge_max_bytes=1 << 16) as c:
        yield c


async def judge(client: httpx.AsyncClient, code: str, tests: list[tuple[str, str]], **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/judge", json={"code": code, "language": "cpp", **body,
                                             "tests": [{"stdin": i, "expected_stdout": o} for i, o in tests]})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def statuses(result: dict[str, Any]) -> list[str]:
    return [t["status"] for t in result["tests"]]


async def test_a_submission_is_compiled_once_and_each_test_runs_its_binary(api: httpx.AsyncClient) -> None:
    code = SUM + f"// {id(api)}\n"  # a source of this run's own: not in the cache yet
    result = await judge(api, code, [("1 2", "3"), ("2 2", "4"), ("0 0", "1")])
    assert result["status"] == "failed", result
    assert statuses(result) == ["passed", "passed", "wrong_answer"]
    assert result["compile"]["status"] == "ok" and not result["compile"]["cached"]
    assert result["compile"]["cpu_s"] > 0
    again = await judge(api, code, [("40 2", "42")], preset="codeforces")
    assert again["status"] == "passed" and again["compile"]["cached"], again
    other = await judge(api, code, [("40 2", "42")], preset="plain", std="c++20")
    assert other["status"] == "passed" and not other["compile"]["cached"], other


async def test_every_verdict(api: httpx.AsyncClient) -> None:
    code = r"""#include <bits/stdc++.h>
using namespace std;
int depth(int n) { volatile char pad[64]; pad[0] = n; return n == 0 ? 0 : 1 + depth(n - 1) + pad[0] * 0; }
int main() {
    string t; cin >> t;
    if (t == "ok") cout << "fine\n";
    if (t == "wa") cout << "wrong\n";
    if (t == "spin") { volatile unsigned long x = 0; for (;;) x++; }
    if (t == "sleep") { this_thread::sleep_for(chrono::seconds(30)); }
    if (t == "mem") { vector<char> v(512u << 20);
                      for (size_t i = 0; i < v.size(); i += 4096) v[i] = 1; cout << v[4096] << "\n"; }
    if (t == "segv") { volatile int *p = nullptr; *p = 1; }
    if (t == "abort") abort();
    if (t == "deep") cout << (depth(1000000) == 1000000 ? "fine" : "no") << "\n";
    if (t == "flood") for (;;) cout << "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n";
    if (t == "exit3") return 3;
    if (t == "fork") { for (;;) fork(); }
    return 0;
}
"""
    cases = ["ok", "wa", "spin", "sleep", "mem", "segv", "abort", "deep", "flood", "exit3", "fork", "ok"]
    result = await judge(api, code, [(c, "fine") for c in cases],
                         limits={"cpu_s": 1, "wall_s": 3, "memory_mb": 256, "output_bytes": 1 << 16})
    got = dict(zip(cases, result["tests"], strict=False))
    assert statuses(result) == ["passed", "wrong_answer", "timeout", "timeout", "memory", "error", "error",
                                "passed", "output_limit", "error", "timeout", "passed"], result
    assert got["spin"]["limit"] == "cpu" and got["sleep"]["limit"] == "wall"
    assert got["segv"]["signal"] == 11 and "Segmentation" in got["segv"]["message"]
    assert got["abort"]["signal"] == 6
    assert got["exit3"]["exit_code"] == 3
    assert (result["compile"]["status"], result["compile"]["stderr"]) == ("ok", ""), result["compile"]


async def test_a_program_starts_as_a_fresh_process_would(api: httpx.AsyncClient) -> None:
    """No fd of the harness, no signal ignored or blocked (CPython ignores SIGPIPE and SIGXFSZ), the
    stack as large as the memory limit: on /v1/judge (spawned per test) and /v1/execute (exec'd)."""
    code = r"""#include <bits/stdc++.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
int main() {
    std::string bad;
    for (int fd = 3; fd < 1024; fd++) if (fcntl(fd, F_GETFD) != -1) bad += " fd" + std::to_string(fd);
    sigset_t mask; sigprocmask(SIG_SETMASK, nullptr, &mask);
    for (int sig = 1; sig < 32; sig++) {
        struct sigaction sa; sigaction(sig, nullptr, &sa);
        if (sa.sa_handler != SIG_DFL) bad += " handler" + std::to_string(sig);
        if (sigismember(&mask, sig)) bad += " blocked" + std::to_string(sig);
    }
    rlimit stack; getrlimit(RLIMIT_STACK, &stack);
    if (stack.rlim_cur < (200ull << 20)) bad += " stack" + std::to_string(stack.rlim_cur);
    std::cout << (bad.empty() ? "fresh" : bad) << std::endl;
}
"""
    result = await judge(api, code, [("", "fresh"), ("", "fresh")], limits={"memory_mb": 256})
    assert statuses(result) == ["passed", "passed"], [t["stdout"] for t in result["tests"]]
    r = await api.post("/v1/execute", json={"code": code, "language": "cpp", "limits": {"memory_mb": 256}})
    assert r.status_code == 200 and r.json()["stdout"] == "fresh\n", r.text


async def test_a_program_cannot_find_the_expected_output(api: httpx.AsyncClient) -> None:
    secret = "the-expected-answer-7f3a"
    code = r"""#include <bits/stdc++.h>
#include <dirent.h>
#include <unistd.h>
using namespace std;
string found;
void scan(const string& dir, int depth) {
    if (depth > 6 || !found.empty()) return;
    DIR* d = opendir(dir.c_str()); if (!d) return;
    while (dirent* e = readdir(d)) {
        string n = e->d_name; if (n == "." || n == "..") continue;
        string p = dir + (dir == "/" ? "" : "/") + n;
        if (p == "/proc" || p == "/sys" || p == "/dev") continue;
        if (e->d_type == DT_DIR) { scan(p, depth + 1); continue; }
        if (e->d_type != DT_REG) continue;
        ifstream f(p, ios::binary); string s((istreambuf_iterator<char>(f)), {});
        if (s.find("the-expected-") != string::npos) { found = p; break; }
    }
    closedir(d);
}
int main(int, char**, char** env) {
    for (char** e = env; *e; e++) if (strstr(*e, "the-expected-")) found = "env";
    for (int fd = 0; fd < 64 && found.empty(); fd++) { char b[4096]; ssize_t n = pread(fd, b, sizeof b, 0);
        if (n > 0 && string(b, n).find("the-expected-") != string::npos) found = "fd"; }
    scan("/", 0);
    cout << (found.empty() ? "nothing" : found) << "\n";
}
"""
    result = await judge(api, code, [("", secret)], limits={"cpu_s": 5, "wall_s": 10})
    assert statuses(result) == ["wrong_answer"], json.dumps(result["tests"])
    assert result["tests"][0]["stdout"] == "nothing\n", result


async def test_a_compile_error_says_what_the_compiler_said(api: httpx.AsyncClient) -> None:
    result = await judge(api, "int main() { return undeclared; }\n", [("", ""), ("", "")])
    assert result["status"] == "compile_error"
    assert statuses(result) == ["skipped", "skipped"]
    assert "undeclared" in result["compile"]["stderr"] and "error" in result["compile"]["stderr"]
    assert result["compile"]["stderr"].startswith("/work/solution.cpp"), result["compile"]  # only the compiler's
    for hostile in ("#include </dev/urandom>\n", "#include </proc/self/environ>\n", "#include </etc/shadow>\n",
                    '#include "/work/../../../../proc/1/environ"\n'):
        result = await judge(api, hostile + "int main() {}\n", [("", "")])
        assert result["status"] == "compile_error", (hostile, result)
        assert "No such file" in result["compile"]["stderr"], (hostile, result["compile"])


@pytest.mark.parametrize(("update", "says"), [
    ({"cpp_toolchain": ""}, "C++ is off on this worker (CODEENV_CPP_TOOLCHAIN is empty)"),
    ({"state_dir": "EMPTY"}, "is not built on this worker (or its declaration changed since): run `codeenv image "
                              "build cpp-gcc12` on its host"),
])
async def test_without_a_toolchain_a_cpp_call_is_a_422_that_says_how_to_build_it(
        api: httpx.AsyncClient, pool: SlotPool, monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
        update: dict[str, Any], says: str) -> None:
    assert pool.compiler is not None
    update = {k: tmp_path if v == "EMPTY" else v for k, v in update.items()}
    monkeypatch.setattr(pool.compiler, "settings", pool.compiler.settings.model_copy(update=update))
    monkeypatch.setattr(pool.compiler, "_toolchain", None)
    for route, body in (("/v1/judge", {"tests": [{"stdin": "1 2", "expected_stdout": "3"}]}),
                        ("/v1/execute", {"stdin": "1 2"})):
        r = await api.post(route, json={"code": SUM, "language": "cpp", **body})
        assert r.status_code == 422 and says in r.text, r.text


async def test_execute_runs_cpp_with_stdin(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/execute", json={"code": SUM, "language": "cpp", "stdin": "20 22"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ok" and body["stdout"] == "42\n", body
    assert body["compile"]["status"] == "ok"
    r = await api.post("/v1/execute", json={"code": "int main() { syntax error }", "language": "cpp"})
    body = r.json()
    assert body["status"] == "error" and body["compile"]["status"] == "error" and not body["started"], body
    assert "error" in body["stderr"]
    r = await api.post("/v1/execute", json={"code": "x = 1", "preset": "ioi"})
    assert r.status_code == 422 and "preset and std are for language cpp" in r.text
    r = await api.post("/v1/judge", json={"code": SUM, "language": "cpp", "fn_name": "f",
                                          "tests": [{"args": [1], "expected": 1}]})
    assert r.status_code == 422 and "stdin tests only" in r.text


# --- the compile jail, with small limits ------------------------------------------------------------


@pytest.fixture(scope="module")
def small_compiler(toolchain: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Compiler, Any]]:
    settings = SandboxSettings(cpp_compile_cpu_s=3, cpp_compile_memory_mb=256, cpp_binary_mb=4, cpp_cache_mb=0)
    runtime = tmp_path_factory.mktemp("compile")
    runtime.chmod(0o755)
    tree = CgroupTree.create(settings.cgroup_root, f"codeenv-{__import__('os').getpid()}-cpptest")
    group = tree.group("compile")
    yield Compiler(settings, runtime), group
    group.remove()
    tree.remove()


@pytest.mark.parametrize(("source", "limits"), [
    # a template bomb: exponential instantiation
    ("template<int N> struct B { static const int v = B<N-1>::v + B<N-2>::v; };\n"
     "template<> struct B<0> { static const int v = 0; };\ntemplate<> struct B<1> { static const int v = 1; };\n"
     "template<int N, int M> struct T { static const long v = T<N-1, M>::v + T<N-1, M+1>::v; };\n"
     "template<int M> struct T<0, M> { static const long v = M; };\n"
     "int main() { return T<40, 0>::v; }\n", {LimitName.cpu, LimitName.memory, None}),
    # a binary over its size cap (1 GB of initialised data)
    ("char big[1 << 30] = {1};\nint main() { return big[12345]; }\n", {LimitName.file_size, LimitName.cpu,
                                                                        LimitName.memory, None}),
])
async def test_hostile_compiles_end_as_a_compile_error_or_a_limit(small_compiler: tuple[Compiler, Any], source: str,
                                                                   limits: set[LimitName | None]) -> None:
    compiler, group = small_compiler
    compiled = await compiler.compile(source.encode(), None, None, 1_499_999_000, group)
    assert compiled.binary is None and compiled.info.status == "error", compiled.info
    assert compiled.info.limit in limits, compiled.info
    assert compiled.info.wall_s < 3 * 2 + 10 + 5
    assert len(compiled.info.stderr) <= 64 << 10


async def test_a_big_uninitialised_array_compiles_and_its_memory_is_the_tests(api: httpx.AsyncClient) -> None:
    code = "#include <cstdio>\nstatic char big[1 << 30];\n" \
           "int main() { for (int i = 0; i < (1 << 30); i += 4096) big[i] = 1; printf(\"%d\\n\", big[4096]); }\n"
    result = await judge(api, code, [("", "1")], limits={"memory_mb": 128})
    assert statuses(result) == ["memory"], result
    result = await judge(api, code, [("", "1")], limits={"memory_mb": 1200, "cpu_s": 5})
    assert statuses(result) == ["passed"], result


# --- the wires of SandboxFusion (its own client) and code-judge, with cpp -----------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(toolchain: None, pool: SlotPool) -> AsyncIterator[str]:
    async with serving(pool_app(pool, GatewaySettings(slots=2))) as url:
        yield url


async def fusion(server: str, **fields: Any) -> Any:
    return await asyncio.to_thread(run_code, RunCodeRequest(language="cpp", **fields), endpoint=server,
                                   max_attempts=1)


async def test_the_sandbox_fusion_client_runs_cpp(server: str) -> None:
    ok = await fusion(server, code=SUM, stdin="1 2\n")
    assert (ok.status, ok.run_result.status, ok.run_result.return_code, ok.run_result.stdout) == (
        "Success", "Finished", 0, "3\n"), ok
    assert ok.compile_result is not None and ok.compile_result.status == "Finished"
    assert ok.compile_result.return_code == 0
    bad = await fusion(server, code="int main() { return nope; }")
    assert bad.status == "Failed" and bad.run_result is None, bad
    assert bad.compile_result.return_code == 1 and "nope" in bad.compile_result.stderr
    assert summary_run_code_result(bad, SummaryMapping()) == SummaryMapping().Failed
    crash = await fusion(server, code="int main() { volatile int *p = 0; return *p; }")
    assert crash.status == "Failed" and crash.run_result.return_code == -11, crash
    slow = await fusion(server, code="int main() { for (;;); }", run_timeout=1)
    assert (slow.status, slow.run_result.status) == ("Failed", "TimeLimitExceeded"), slow
    files = await fusion(server, code="#include <fstream>\nint main() { std::ifstream f(\"in.txt\"); int x; f >> x;"
                                      " std::ofstream(\"out.txt\") << x * 2; }",
                         files={"in.txt": base64.b64encode(b"21").decode()}, fetch_files=["out.txt"])
    assert files.status == "Success" and base64.b64decode(files.files["out.txt"]) == b"42", files


async def test_one_submission_as_verl_sends_its_tests_reaches_the_cache(server: str) -> None:
    """verl's per-test pattern: the same source with another stdin, one /run_code each."""
    code = SUM + f"// verl {time.time_ns()}\n"
    async with httpx.AsyncClient(base_url=server, timeout=60) as c:
        bodies = [(await c.post("/run_code", json={"code": code, "language": "cpp", "stdin": f"{i} {i}",
                                                   "compile_timeout": 10, "run_timeout": 10,
                                                   "memory_limit_MB": 1024})).json() for i in range(4)]
    assert [b["run_result"]["stdout"] for b in bodies] == [f"{2 * i}\n" for i in range(4)]
    assert bodies[0]["compile_result"]["execution_time"] > 0  # compiled once
    assert all(b["compile_result"]["execution_time"] == 0 for b in bodies[1:]), bodies  # then cached


async def test_code_judge_runs_cpp(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=60) as c:
        r = (await c.post("/run", json={"type": "cpp", "solution": SUM, "input": "2 3", "sub_id": "c1"})).json()
        assert (r["sub_id"], r["success"], r["run_success"], r["stdout"], r["reason"]) == ("c1", True, True, "5\n", "")
        right, wrong, broken = (await c.post("/judge/batch", json={"type": "batch", "submissions": [
            {"type": "cpp", "solution": SUM, "input": "40 2", "expected_output": "42\n"},
            {"type": "cpp", "solution": SUM, "input": "40 3", "expected_output": "42"},
            {"type": "cpp", "solution": "int main() { syntax }"}]})).json()["results"]
        assert right["success"] and not wrong["success"] and wrong["run_success"]
        assert not broken["run_success"] and broken["reason"] == ""
        compile_error = (await c.post("/run", json={"type": "cpp", "solution": "int main() { syntax }"})).json()
        assert not compile_error["run_success"] and "error" in compile_error["stderr"], compile_error
