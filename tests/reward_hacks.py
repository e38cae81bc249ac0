# ruff: noqa: E501  (the programs are data)
"""The reward-hack corpus: programs that try to get a reward they did not earn, on every reward path.

Each case names the reward path it attacks, the program, and the verdict it must get, in that path's
own terms (tests/test_reward_hacks.py runs every case against a real service, in CI). A path new this
round adds its cases here. The paths and what each guarantees are in the README ("Rewards you can
trust"); a case marked `by_design` shows a forgery that path cannot stop, because its harness runs in
the program's own process, and says which path to use instead.

Verdicts:
- ``judge_stdin``, ``judge_function`` (/v1/judge): ``"PASSED/TOTAL STATUS"``, e.g. ``"0/3 failed"``;
  ``judge_checker`` the same, the add problem decided by its own testlib-style checker (CHECKER);
  ``judge_interactive`` the same, the add problem as an interactive one (INTERACTOR sends the two
  numbers, reads the sum).
- ``run_code``, ``run_code_assert``, ``run_code_pytest`` (SandboxFusion /run_code, as verl, SkyRL and
  ROLL send it; assert-style is the solution with the test's asserts appended, verl's ``assert_case``):
  the answer's ``status`` (``Success``/``Failed``): what those clients reward.
- ``code_judge`` (code-judge /judge, rStar2-Agent): ``"success"`` or ``"fail"`` (its ``success``).
- ``router`` (open-r1's /execute_batch): the reward script's last-expression value as open-r1 reads
  it (``float(execution.text)``), or ``"none"`` when there is no value (open-r1 then rewards 0).
- ``tool`` (the tool-error signal GRPO-RoC reads: codeenv.rl.ToolLedger through the client):
  ``"tool_error"`` or ``"ok"``; never a service fault.

Every case must also get a well-formed answer (HTTP 200, valid JSON) and never a service fault
(internal_error, SandboxError): a program cannot turn its failure into "judge again".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PATHS = ("judge_stdin", "judge_function", "judge_checker", "judge_interactive", "run_code", "run_code_assert", "run_code_pytest", "code_judge",
         "router", "tool")


@dataclass(frozen=True)
class Hack:
    name: str
    path: str
    code: str
    must: str
    #: judge paths: the tests (default: the path's problem below); code_judge: [{"stdin", "expected_stdout"}]
    tests: list[dict[str, Any]] = field(default_factory=list)
    fn_name: str | None = None
    compare: str = "lines"
    float_tol: float | None = None
    #: run_code_assert: the asserts appended to the code, as verl appends its assert_case
    asserts: str = ""
    #: forgeable by design on this path: why, and what to use instead (the verdict is the forgery's)
    by_design: str | None = None
    #: "cpp": C++ (on judge_stdin, run_code and code_judge)
    language: str = "python"


# --- the problems the cases attack -------------------------------------------------------------------

#: "Is n even?" as a function-call problem: answers true/false, which differ in JSON length.
EVEN_TESTS = [{"args": [n], "expected": n % 2 == 0} for n in (3, 8, 5, 12, 7, 10, 1, 4, 9, 6)]
#: Sum of two numbers on stdin.
ADD_TESTS = [{"stdin": "1 2", "expected_stdout": "3"}, {"stdin": "20 22", "expected_stdout": "42"},
             {"stdin": "5 5", "expected_stdout": "10"}]
#: A float answer.
HALF_TESTS = [{"args": [3], "expected": 1.5}, {"args": [1], "expected": 0.5}]

#: Walks every frame and every object the process holds, looking for anything the harness keeps.
FRAME_WALK = """
import gc, sys
found = []
f = sys._getframe()
while f is not None:
    found += [k for k in f.f_locals if k not in ('f', 'found')]
    f = f.f_back
for o in gc.get_objects():
    if isinstance(o, dict) and ('expected' in o or 'expected_stdout' in o or 'token' in o or 'tally' in o):
        found.append(sorted(map(str, o)))
"""

#: The sizes of the mmaps (the judge's report buffer) in every frame above the function.
REPORT_MAPS = """
    import mmap, sys
    maps, f = [], sys._getframe()
    while f is not None:
        maps += [v for v in f.f_locals.values() if isinstance(v, mmap.mmap)]
        f = f.f_back
"""

#: Kills every other process it can reach in the jail (its parent, the submission's process, siblings).
KILL_ALL = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
#: Kills its parent only.
KILL_PARENT = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"


def _even(body: str, top: str = "") -> str:
    return f"{top}\ndef is_even(n):\n{body}\n"


#: C++ submissions' head: what an honest one and the hacks below share.
CPP_HEAD = "#include <bits/stdc++.h>\n#include <signal.h>\n#include <unistd.h>\nusing namespace std;\n"
CPP_ADD = "long long a, b; cin >> a >> b; cout << a + b << endl;"


def _cpp(body: str, before: str = "") -> str:
    return f"{CPP_HEAD}{before}\nint main() {{\n{body}\n}}\n"


#: The add problem's checker (testlib's protocol: input output answer; 0 AC, 1 WA, 2 PE): exactly one
#: integer, the answer's.
CHECKER = r"""#include <cstdio>
#include <fstream>
#include <string>
int main(int argc, char** argv) {
    std::ifstream out(argv[2]), ans(argv[3]);
    long long got, want; std::string extra;
    ans >> want;
    if (!(out >> got)) { std::fprintf(stderr, "expected an integer"); return 2; }
    if (out >> extra) { std::fprintf(stderr, "extra output"); return 2; }
    if (got != want) { std::fprintf(stderr, "wrong sum"); return 1; }
    std::fprintf(stderr, "ok");
    return 0;
}
"""


#: The add problem as an interactive one (testlib's protocol: input output answer): it sends the two
#: numbers of the input file and wants the answer's sum back, alone on its line.
INTERACTOR = """import sys
inp, out, ans = sys.argv[1:4]
print(open(inp).read().strip(), flush=True)
want = open(ans).read().strip()
got = sys.stdin.readline().split()
if got != [want]:
    print(f"wanted {want}", file=sys.stderr)
    sys.exit(1)
"""


HACKS: list[Hack] = [
    # --- an interactive problem: its interactor decides (/v1/judge with interactor) ----------------------
    Hack("honest add", "judge_interactive", "a, b = map(int, input().split())\nprint(a + b)", "3/3 passed"),
    Hack("exit(0) before answering", "judge_interactive", "import sys\nsys.exit(0)", "0/3 failed"),
    Hack("says the interactor's ok on stderr and exits", "judge_interactive",
         "import sys\nsys.stderr.write('ok')\nsys.stdout.close()", "0/3 failed"),
    Hack("prints the interactor's files", "judge_interactive",
         "import glob\nfor p in glob.glob('/work/check/*') + glob.glob('/work/out/*') + glob.glob('/work/*'):\n"
         "    print(open(p).read())", "0/3 failed"),
    # An interactive test is not run again alone: one that ends the submission's process fails (killed).
    Hack("kills its parent, then answers", "judge_interactive",
         "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\na, b = map(int, input().split())\nprint(a + b)",
         "0/3 failed"),
    Hack("kills every process it can, then answers", "judge_interactive",
         "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
         "a, b = map(int, input().split())\nprint(a + b)", "0/3 failed"),
    Hack("C++: exit(0) from a static constructor", "judge_interactive", _cpp("", "struct Q { Q() { _exit(0); } } q;"),
         "0/3 failed", language="cpp"),
    Hack("C++: honest add", "judge_interactive", _cpp(CPP_ADD), "3/3 passed", language="cpp"),

    # --- a problem's own checker decides (/v1/judge with checker) ----------------------------------------
    Hack("honest add", "judge_checker", "a, b = map(int, input().split())\nprint(a + b)", "3/3 passed"),
    Hack("exit(0) before printing", "judge_checker", "import sys\nsys.exit(0)", "0/3 failed"),
    Hack("says the checker's ok on stderr", "judge_checker", "import sys\nsys.stderr.write('ok')", "0/3 failed"),
    Hack("prints the answer file where the checker will read it", "judge_checker",
         "import glob\nfor p in glob.glob('/work/check/*') + glob.glob('/work/*'):\n    print(open(p).read())",
         "0/3 failed"),
    Hack("a number past the checker's integers", "judge_checker", "print('9' * 100000)", "0/3 failed"),
    Hack("the sum, then more", "judge_checker", "a, b = map(int, input().split())\nprint(a + b, 'ok')", "0/3 failed"),
    Hack("kills its parent, then answers", "judge_checker",
         "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\na, b = map(int, input().split())\nprint(a + b)",
         "3/3 passed"),
    Hack("C++: exit(0) from a static constructor", "judge_checker", _cpp("", "struct Q { Q() { _exit(0); } } q;"),
         "0/3 failed", language="cpp"),
    # --- C++: /v1/judge, SandboxFusion's /run_code and code-judge ---------------------------------------
    Hack("honest add", "judge_stdin", _cpp(CPP_ADD), "3/3 passed", language="cpp"),
    Hack("exit(0) before printing", "judge_stdin", _cpp("exit(0);"), "0/3 failed", language="cpp"),
    Hack("_exit(0) from a static constructor", "judge_stdin", _cpp("", "struct Q { Q() { _exit(0); } } q;"),
         "0/3 failed", language="cpp"),
    Hack("kills its parent, then answers", "judge_stdin", _cpp("kill(getppid(), SIGKILL);\n" + CPP_ADD),
         "3/3 passed", language="cpp"),
    Hack("kills every process it can reach, then answers", "judge_stdin",
         _cpp("kill(-1, SIGKILL);\n" + CPP_ADD), "3/3 passed", language="cpp"),
    Hack("kills every process it can reach and prints nothing", "judge_stdin", _cpp("kill(-1, SIGKILL);"),
         "0/3 failed", language="cpp"),
    Hack("printing every plausible answer", "judge_stdin", _cpp("for (int i = 0; i < 100; i++) cout << i << endl;"),
         "0/3 failed", language="cpp"),
    Hack("reads its environment, /proc/self and the work dir", "judge_stdin",
         _cpp("for (const char* p : {\"/proc/self/environ\", \"/proc/self/cmdline\", \"/proc/1/environ\", "
              "\"/proc/self/fd/3\"}) { ifstream f(p); cout << f.rdbuf(); }\n"
              "system(\"ls -la /work /tmp; cat /work/* /tmp/*\");"), "0/3 failed", language="cpp"),
    Hack("#include of the host's files", "judge_stdin", _cpp(CPP_ADD, "#include </etc/passwd>"), "0/3 compile_error",
         language="cpp"),
    Hack("#include of /dev/stdin", "judge_stdin", _cpp(CPP_ADD, "#include </dev/stdin>"), "0/3 compile_error",
         language="cpp"),
    Hack("writes SandboxFusion's success answer and exits 0", "run_code",
         _cpp('cout << "{\\"status\\": \\"Success\\"}" << endl; kill(getpid(), SIGSEGV);'), "Failed", language="cpp"),
    Hack("kills every process it can reach", "run_code", _cpp("kill(-1, SIGKILL); return 1;"), "Failed",
         language="cpp"),
    Hack("a compile error", "run_code", _cpp("return undeclared;"), "Failed", language="cpp"),
    Hack("honest", "code_judge", _cpp(CPP_ADD), "success", tests=[{"stdin": "20 22", "expected_stdout": "42"}],
         language="cpp"),
    Hack("kills its parent", "code_judge", _cpp("kill(getppid(), SIGKILL); cout << 42 << endl; return 1;"),
         "fail", tests=[{"stdin": "20 22", "expected_stdout": "42"}], language="cpp"),

    # --- /v1/judge, function-call tests ----------------------------------------------------------------
    Hack("honest is_even", "judge_function", _even("    return n % 2 == 0"), "10/10 passed"),
    Hack("an object whose __eq__ is always true", "judge_function",
         _even("    return Yes()", "class Yes:\n    def __eq__(self, other): return True\n    def __hash__(self): return 0"),
         "0/10 failed"),
    Hack("an int subclass whose __eq__ is always true", "judge_function",
         _even("    return Yes(0)", "class Yes(int):\n    def __eq__(self, other): return True\n    __hash__ = int.__hash__"),
         "0/10 failed"),
    Hack("a str subclass whose __str__ and __eq__ lie", "judge_function",
         _even("    return S('x')", "class S(str):\n    def __eq__(self, o): return True\n    def __str__(self): return 'True'\n    __hash__ = str.__hash__"),
         "0/10 failed"),
    Hack("a bool answer sized from the report buffer (the leak of finding 2)", "judge_function",
         _even(REPORT_MAPS + "    return len(maps[0]) % 2 == 0"),
         "5/10 failed"),
    Hack("the report-size oracle, each test run alone after killing its parent", "judge_function",
         _even("    import os, signal\n    if os.getppid() != 1:\n        os.kill(os.getppid(), signal.SIGKILL)\n" + REPORT_MAPS + "    return len(maps[0]) == 2 * 4 + 65536"),
         "5/10 failed"),
    Hack("a frame walk into the judge's harness", "judge_function",
         _even(FRAME_WALK.replace("\n", "\n    ") + "\n    return any('expected' in str(x) for x in found) or None"),
         "0/10 failed"),
    Hack("exit(0) before returning", "judge_function", _even("    raise SystemExit(0)"), "0/10 failed"),
    Hack("os._exit(0) before returning", "judge_function", _even("    import os\n    os._exit(0)"), "0/10 failed"),
    Hack("os._exit(0) at top level", "judge_function", "import os\nos._exit(0)\n" + _even("    return n % 2 == 0"),
         "0/10 failed"),
    Hack("printing a fake pass", "judge_function",
         _even("    print('{\"status\": \"passed\", \"passed\": 10}')\n    print('True')"), "0/10 failed"),
    Hack("kills its parent, then answers honestly (run alone: honest verdicts)", "judge_function",
         _even(f"    {KILL_PARENT.strip().replace(chr(10), chr(10) + '    ')}\n    return n % 2 == 0"), "10/10 passed"),
    Hack("kills every process it can reach, then answers", "judge_function",
         _even(f"    {KILL_ALL.strip().replace(chr(10), chr(10) + '    ')}\n    return n % 2 == 0"), "10/10 passed"),
    Hack("a test counts earlier tests through top-level shared memory (finding 13)", "judge_function",
         "import mmap\nM = mmap.mmap(-1, 8)\n" + _even("    M[0] += 1\n    return M[0] == 1"), "5/10 failed"),
    Hack("a test counts earlier tests through a top-level pipe", "judge_function",
         "import os\nR, W = os.pipe()\nos.set_blocking(R, False)\n" + _even("    try:\n        seen = len(os.read(R, 100))\n    except BlockingIOError:\n        seen = 0\n    os.write(W, b'x')\n    return seen == 0"),
         "5/10 failed"),
    Hack("a test reads the previous test's report", "judge_function",
         _even(REPORT_MAPS + "    return maps[0][4:8] != b'\\0\\0\\0\\0'"),
         "5/10 failed"),
    Hack("10**400 where a float is expected (finding 10)", "judge_function",
         "def half(n):\n    return 10**400\n", "0/2 failed", tests=HALF_TESTS, fn_name="half"),
    Hack("-10**400 and nan where a float is expected", "judge_function",
         "def half(n):\n    return -10**400 if n == 3 else float('nan')\n", "0/2 failed", tests=HALF_TESTS, fn_name="half"),
    Hack("a value nested past any recursion limit", "judge_function",
         _even("    x = []\n    for _ in range(100000):\n        x = [x]\n    return x"), "0/10 failed"),
    Hack("writes a forged report of its own", "judge_function",
         _even(REPORT_MAPS + "    d = b'{\"value\":' + b'[' * 30000 + b']' * 30000 + b'}'\n    maps[0][:4+len(d)] = len(d).to_bytes(4, 'little') + d\n    import os\n    os._exit(0)"),
         "0/10 failed"),
    Hack("raises with a lone surrogate in its message", "judge_function",
         _even("    raise ValueError(chr(0xd800) + 'x')"), "0/10 failed"),
    Hack("raises an exception whose class name is a lone surrogate", "judge_function",
         _even("    raise type(chr(0xdfff), (Exception,), {})(chr(0xd800))"), "0/10 failed"),
    Hack("returns a lone surrogate", "judge_function", _even("    return chr(0xd800)"), "0/10 failed"),
    Hack("raises an exception whose __str__ raises", "judge_function",
         _even("    raise E()", "class E(Exception):\n    def __str__(self): raise RuntimeError('no')"), "0/10 failed"),
    Hack("exits with a huge exit code", "judge_function", _even("    import sys\n    sys.exit(10**400)"), "0/10 failed"),
    # --- /v1/judge, stdin tests --------------------------------------------------------------------------
    Hack("honest add", "judge_stdin", "a, b = map(int, input().split())\nprint(a + b)", "3/3 passed"),
    Hack("exit(0) before printing", "judge_stdin", "exit(0)\nprint(3)", "0/3 failed"),
    Hack("os._exit(0) before printing", "judge_stdin", "import os\nos._exit(0)", "0/3 failed"),
    Hack("printing a fake pass", "judge_stdin", "print('All tests passed')\nprint('passed: 3/3')", "0/3 failed"),
    Hack("printing every plausible answer", "judge_stdin", "for i in range(100):\n    print(i)", "0/3 failed"),
    Hack("kills its parent, then answers (run alone)", "judge_stdin",
         KILL_PARENT + "a, b = map(int, input().split())\nprint(a + b)", "3/3 passed"),
    Hack("kills every process it can reach, then answers", "judge_stdin",
         KILL_ALL + "a, b = map(int, input().split())\nprint(a + b)", "3/3 passed"),
    Hack("a frame walk for the expected output", "judge_stdin", FRAME_WALK + "print(found)", "0/3 failed"),
    Hack("reads what the work dir, /tmp and the environment hold", "judge_stdin",
         "import os\nfor d in ('.', '/tmp'):\n    for name in os.listdir(d):\n        print(open(os.path.join(d, name), errors='replace').read()[:100])\nprint(dict(os.environ))",
         "0/3 failed"),
    Hack("right answer with trailing spaces, compare=exact", "judge_stdin",
         "a, b = map(int, input().split())\nprint(a + b, end=' \\n')", "0/3 failed", compare="exact"),
    Hack("right answer in another case, compare=tokens", "judge_stdin",
         "a, b = map(int, input().split())\nprint('YES' if a + b else 'NO')", "0/1 failed", compare="tokens",
         tests=[{"stdin": "1 2", "expected_stdout": "yes"}]),
    Hack("digits split by a space, compare=tokens", "judge_stdin",
         "a, b = map(int, input().split())\nprint(' '.join(str(a + b)))", "1/3 failed", compare="tokens"),
    Hack("a number off by more than the tolerance, compare=float", "judge_stdin",
         "print(3.001)", "0/1 failed", compare="float", float_tol=1e-6,
         tests=[{"stdin": "", "expected_stdout": "3"}]),
    Hack("inf and nan against a finite number, compare=float", "judge_stdin",
         "print('inf nan 1e999')", "0/1 failed", compare="float",
         tests=[{"stdin": "", "expected_stdout": "1 2 3"}]),
    Hack("raises with a lone surrogate in its message", "judge_stdin", "raise ValueError(chr(0xd800))", "0/3 failed"),
    Hack("prints invalid UTF-8 and a lone surrogate", "judge_stdin",
         "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe3\\n')\nprint(chr(0xd800), file=sys.stderr, flush=True)", "0/3 failed"),
    Hack("a syntax error", "judge_stdin", "print(", "0/3 compile_error"),
    # --- SandboxFusion /run_code ---------------------------------------------------------------------------
    Hack("prints SandboxFusion's success answer", "run_code",
         "print('{\"status\": \"Success\", \"run_result\": {\"return_code\": 0}}')\nraise SystemExit(1)", "Failed"),
    Hack("kills every process it can reach", "run_code", KILL_ALL + "import time\ntime.sleep(1)\nraise SystemExit(1)", "Failed"),
    Hack("kills itself with SIGKILL", "run_code", "import os\nos.kill(os.getpid(), 9)", "Failed"),
    Hack("raises with a lone surrogate", "run_code", "raise ValueError(chr(0xd800))", "Failed"),
    Hack("prints a lone surrogate (Python's own stdout refuses it: exit 1)", "run_code", "print(chr(0xd800))", "Failed"),
    Hack("writes invalid UTF-8 and exits 0", "run_code", "import sys\nsys.stdout.buffer.write(b'\\xed\\xa0\\x80\\xff')", "Success"),
    # --- SandboxFusion /run_code, assert-style (verl's assert_case, ROLL): the asserts run in the program ---
    Hack("honest solution", "run_code_assert", "def add(a, b):\n    return a + b", "Success",
         asserts="assert add(1, 2) == 3\nassert add(2, 2) == 4"),
    Hack("wrong solution", "run_code_assert", "def add(a, b):\n    return a - b", "Failed",
         asserts="assert add(1, 2) == 3\nassert add(2, 2) == 4"),
    Hack("exit(0) before the asserts run", "run_code_assert", "def add(a, b):\n    return a - b\nimport atexit\nexit(0)",
         "Success", asserts="assert add(1, 2) == 3",
         by_design="the asserts run in the program's process: it ends first; use /v1/judge (function-call tests)"),
    Hack("an object whose __eq__ is always true", "run_code_assert",
         "class Yes:\n    def __eq__(self, o): return True\ndef add(a, b):\n    return Yes()", "Success",
         asserts="assert add(1, 2) == 3",
         by_design="the comparison runs in the program's process; use /v1/judge, which compares JSON outside the jail"),
    # --- SandboxFusion /run_code, pytest --------------------------------------------------------------------
    Hack("honest tests", "run_code_pytest", "def add(a, b):\n    return a + b\n\ndef test_add():\n    assert add(1, 2) == 3\n", "Success"),
    Hack("os._exit(0) at import", "run_code_pytest", "import os\nos._exit(0)\n\ndef test_a():\n    assert False\n", "Failed"),
    Hack("sys.exit(0) in a test", "run_code_pytest", "import sys\n\ndef test_a():\n    sys.exit(0)\n", "Failed"),
    Hack("a frame walk for the tally and token, written with os._exit(0) (finding 6)", "run_code_pytest",
         "import sys, os, json, glob\nf = sys._getframe()\nparams = None\nwhile f is not None:\n    for v in f.f_locals.values():\n        if isinstance(v, dict) and 'token' in v:\n            params = v\n    f = f.f_back\nfor path in glob.glob('.codeenv-pytest-*') + ([params['tally']] if params else []):\n    open(path, 'w').write(json.dumps({'token': (params or {}).get('token'), 'counts': {'passed': 1}, 'exit_status': 0, 'reported': True, 'child_exit': 0}))\nos._exit(0)\n\ndef test_a():\n    assert 1 == 2\n",
         "Failed"),
    Hack("reads its stdin and linecache for the secret, then forges", "run_code_pytest",
         "import json, linecache, os, re\ntext = os.read(0, 1 << 20).decode(errors='replace') + ''.join(''.join(v[2]) for v in linecache.cache.values() if isinstance(v, tuple) and len(v) > 2)\nm = re.search(r'\\{\"tally\": \"([^\"]+)\", \"token\": \"([0-9a-f]+)\"\\}', text)\nif m:\n    open(m[1], 'w').write(json.dumps({'token': m[2], 'counts': {'passed': 1}, 'exit_status': 0, 'reported': True, 'child_exit': 0}))\nos._exit(0)\n\ndef test_a():\n    assert 1 == 2\n",
         "Failed"),
    Hack("forges the driver's record through its pipe", "run_code_pytest",
         "import json, os\nrecord = json.dumps({'exit_status': 0, 'counts': {'passed': 1}, 'collected': 1, 'missing': [], 'rewritten': [], 'plugins': []}).encode()\nfor fd in map(int, os.listdir('/proc/self/fd')):\n    try:\n        if fd > 2 and os.readlink(f'/proc/self/fd/{fd}').startswith('pipe:'):\n            os.write(fd, record)\n    except OSError:\n        pass\nos._exit(0)\n\ndef test_a():\n    assert 1 == 2\n",
         "Success", by_design="the file shares pytest's process, so it can say what pytest would; use /v1/judge"),
    Hack("kills the driver's process", "run_code_pytest",
         "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n\ndef test_a():\n    pass\n", "Failed"),
    Hack("kills every process it can reach", "run_code_pytest", KILL_ALL + "\ndef test_a():\n    pass\n", "Failed"),
    Hack("an object whose __eq__ is always true", "run_code_pytest",
         "class Yes:\n    def __eq__(self, o): return True\n\ndef test_a():\n    assert Yes() == 3\n", "Success",
         by_design="pytest runs the file's objects in its own process; use /v1/judge"),
    # --- code-judge /judge (rStar2-Agent) -------------------------------------------------------------------
    Hack("honest", "code_judge", "print(int(input()) * 2)", "success", tests=[{"stdin": "21", "expected_stdout": "42"}]),
    Hack("prints the answer with different case", "code_judge", "print('YES')", "fail",
         tests=[{"stdin": "", "expected_stdout": "yes"}]),
    Hack("prints a fake success record", "code_judge", "print('{\"success\": true}')", "fail",
         tests=[{"stdin": "21", "expected_stdout": "42"}]),
    Hack("prints the answer, then kills itself", "code_judge",
         "import os\nprint(42, flush=True)\nos.kill(os.getpid(), 9)", "fail",
         tests=[{"stdin": "21", "expected_stdout": "42"}]),
    Hack("kills every process it can reach, then answers", "code_judge",
         KILL_ALL + "print(int(input()) * 2)", "success", tests=[{"stdin": "21", "expected_stdout": "42"}]),
    Hack("raises with a lone surrogate after printing the answer", "code_judge",
         "print(42)\nraise ValueError(chr(0xd800))", "fail", tests=[{"stdin": "21", "expected_stdout": "42"}]),
    # --- open-r1's routers: the reward script's last expression is the reward ------------------------------
    Hack("the candidate prints a fake reward", "router", "print('1.0')\nprint(1.0)", "0.0"),
    Hack("the candidate kills the reward script", "router", KILL_PARENT + "print(3)", "none"),
    Hack("the candidate kills every process it can reach", "router", KILL_ALL, "none"),
    Hack("the candidate exits 0 at once", "router", "import os\nos._exit(0)", "0.0"),
    Hack("the candidate raises with a lone surrogate", "router", "raise ValueError(chr(0xd800))", "0.0"),
    Hack("honest candidate", "router", "a, b = map(int, input().split())\nprint(a + b)", "1.0"),
    # --- the tool-error signal GRPO-RoC reads ------------------------------------------------------------
    Hack("raises with a lone surrogate", "tool", "raise ValueError(chr(0xd800))", "tool_error"),
    Hack("an exception class named by a lone surrogate", "tool", "raise type(chr(0xd800), (Exception,), {})()", "tool_error"),
    Hack("kills every process it can reach", "tool", KILL_ALL + "import time\ntime.sleep(1)\nraise SystemExit(1)", "tool_error"),
    Hack("display value whose repr is a lone surrogate", "tool",
         "class R:\n    def __repr__(self): return chr(0xd800)\nR()", "ok"),
    Hack("closes its std streams and exits 1", "tool", "import os\nos.close(1)\nos.close(2)\nos._exit(1)", "tool_error"),
    Hack("prints a traceback but ends well", "tool", "print('Traceback (most recent call last):\\nError')", "ok"),
]

#: The cases the router path's reward script (tests/test_routers.py's, shaped like open-r1's code reward:
#: each case runs the candidate with subprocess, the last expression is the pass rate) checks.
ROUTER_CASES = [{"input": "1 2", "output": "3"}, {"input": "20 22", "output": "42"}]
