# ruff: noqa: E501  (the programs are data)
"""Write the shipped `code` workload: submissions to stdin/stdout problems, each with its tests.

    python benchmarks/workloads/make_code.py        # rewrites codeenv/bench/workloads/code.jsonl

What a code-RL run (DeepCoder-, TACO-, CodeContests-style) sends its reward function: for each of
ten problems, a correct submission, a wrong answer, one that fails at run time on some inputs and
one that does not compile; three problems also have one that runs out of time on its largest test.
Each problem has 10 to 50 tests of a few milliseconds each, their expected outputs computed here by
the reference solution. Every submission is deterministic.

Expected outcomes (how many tests each passes) are written by running the workload without a
service: ``codeenv bench --limit --workload code --write-expect codeenv/bench/workloads/code.expect.jsonl``.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "codeenv" / "bench" / "workloads"
TIMEOUT_S = 0.5  # CPU seconds per test, as a code-RL run sets it per problem


@dataclass
class Problem:
    name: str
    correct: str
    wrong: str
    runtime_error: str
    tests: Callable[[random.Random], list[str]]  # the inputs
    slow: str | None = None  # runs out of time on the largest input


def ints(r: random.Random, n: int, lo: int = -1000, hi: int = 1000) -> str:
    return " ".join(str(r.randint(lo, hi)) for _ in range(n))


PROBLEMS = [
    Problem(
        "sum",
        "n = int(input())\nprint(sum(map(int, input().split())))",
        "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs[1:]))",
        "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs) // (xs[0] % 7))",
        lambda r: [f"{n}\n{ints(r, n)}" for n in [r.randint(1, 1900) for _ in range(r.randint(10, 50))]],
        "n = int(input())\nxs = list(map(int, input().split()))\nwhile n > 1940:\n    pass\nprint(sum(xs))",
    ),
    Problem(
        "max_subarray",
        "input()\nbest = cur = None\nfor x in map(int, input().split()):\n    cur = x if cur is None or cur < 0 else cur + x\n    best = cur if best is None else max(best, cur)\nprint(best)",
        "input()\nbest = cur = 0\nfor x in map(int, input().split()):\n    cur = max(0, cur + x)\n    best = max(best, cur)\nprint(best)",
        "input()\nxs = list(map(int, input().split()))\nprint(max(sum(xs[i:j]) for i in range(len(xs)) for j in range(i + 1, i + 2 + xs[0] // 100)))",
        lambda r: [f"{n}\n{ints(r, n, -50, 40 if k % 4 else -1)}"
                   for k, n in enumerate([r.randint(1, 1500) for _ in range(r.randint(10, 50))])],
    ),
    Problem(
        "primes",
        "n = int(input())\nsieve = bytearray([1]) * (n + 1)\nsieve[:2] = b'\\x00\\x00'[: n + 1]\nfor i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n        sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))\nprint(sum(sieve))",
        "n = int(input()) - 1\nsieve = bytearray([1]) * (n + 1)\nsieve[:2] = b'\\x00\\x00'[: n + 1]\nfor i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n        sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))\nprint(sum(sieve))",
        "n = int(input())\nassert n % 5, 'unlucky'\nsieve = bytearray([1]) * (n + 1)\nsieve[:2] = b'\\x00\\x00'[: n + 1]\nfor i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n        sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))\nprint(sum(sieve))",
        lambda r: [str(r.randint(0, 19999)) for _ in range(r.randint(10, 40))],
        "n = int(input())\nwhile n >= 20000:\n    pass\nsieve = bytearray([1]) * (n + 1)\nsieve[:2] = b'\\x00\\x00'[: n + 1]\nfor i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n        sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))\nprint(sum(sieve))",
    ),
    Problem(
        "reverse_words",
        "print(' '.join(reversed(input().split())))",
        "print(' '.join(w[::-1] for w in input().split()))",
        "words = input().split()\nprint(' '.join(reversed(words)) if len(words) % 4 else words[len(words)])",
        lambda r: [" ".join("".join(r.choice("abcdefgh") for _ in range(r.randint(1, 8))) for _ in range(r.randint(1, 60)))
                   for _ in range(r.randint(10, 50))],
    ),
    Problem(
        "gcd_pairs",
        "import math\nfor _ in range(int(input())):\n    a, b = map(int, input().split())\n    print(math.gcd(a, b))",
        "import math\nfor _ in range(int(input())):\n    a, b = map(int, input().split())\n    print(math.gcd(a, b) if a < b else a % b)",
        "import math\nfor _ in range(int(input())):\n    a, b = map(int, input().split())\n    print(math.gcd(a, b) // (a % 10))",
        lambda r: [str(n) + "\n" + "\n".join(f"{r.randint(1, 10**9)} {r.randint(1, 10**9)}" for _ in range(n))
                   for n in [r.randint(1, 300) for _ in range(r.randint(10, 50))]],
    ),
    Problem(
        "fibonacci_mod",
        "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, (a + b) % 1000000007\nprint(a)",
        "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, (a + b) % 1000000009\nprint(a)",
        "n = int(input())\nfib = [0, 1]\nfor _ in range(n - 1):\n    fib.append((fib[-1] + fib[-2]) % 1000000007)\nprint(fib[n] if n % 3 else fib[n + 1])",
        lambda r: [str(r.randint(0, 20000)) for _ in range(r.randint(10, 40))],
    ),
    Problem(
        "balanced",
        "s = input()\nstack = []\npairs = {')': '(', ']': '[', '}': '{'}\nok = True\nfor c in s:\n    if c in '([{':\n        stack.append(c)\n    elif not stack or stack.pop() != pairs[c]:\n        ok = False\n        break\nprint('YES' if ok and not stack else 'NO')",
        "s = input()\nprint('YES' if s.count('(') == s.count(')') and s.count('[') == s.count(']') and s.count('{') == s.count('}') else 'NO')",
        "s = input()\nstack = []\npairs = {')': '(', ']': '[', '}': '{'}\nfor c in s:\n    if c in '([{':\n        stack.append(c)\n    elif stack.pop() != pairs[c]:\n        break\nprint('YES' if not stack else 'NO')",
        lambda r: [r.choice(["".join(r.choice("()[]{}") for _ in range(r.randint(1, 200))), _balanced(r, r.randint(1, 100)),
                             "(" * (k := r.randint(1, 50)) + "[" + ")" * k + "]"])
                   for _ in range(r.randint(10, 50))],
        "s = input()\nwhile len(s) > 300:\n    pass\nprint('YES' if s.count('(') == s.count(')') else 'NO')",
    ),
    Problem(
        "two_sum_count",
        "from collections import Counter\ninput()\nxs = list(map(int, input().split()))\nt = int(input())\nseen = Counter()\nc = 0\nfor x in xs:\n    c += seen[t - x]\n    seen[x] += 1\nprint(c)",
        "input()\nxs = list(map(int, input().split()))\nt = int(input())\nprint(sum(1 for i in range(len(xs)) for j in range(i, len(xs)) if xs[i] + xs[j] == t))",
        "input()\nxs = list(map(int, input().split()))\nt = int(input())\nprint(len({(a, b) for a in xs for b in xs if a + b == t}) // (len(xs) - 1))",
        lambda r: [f"{n}\n{ints(r, n, -20, 20)}\n{r.randint(-10, 10)}" for n in [r.randint(1, 150) for _ in range(r.randint(10, 50))]],
    ),
    Problem(
        "transpose",
        "r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\nfor row in zip(*m):\n    print(' '.join(row))",
        "r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\nfor row in m:\n    print(' '.join(row))",
        "r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\nfor j in range(r):\n    print(' '.join(m[i][j] for i in range(r)))",
        lambda r: [f"{a} {b}\n" + "\n".join(ints(r, b, 0, 99) for _ in range(a))
                   for a, b in [(r.randint(1, 30), r.randint(1, 30)) for _ in range(r.randint(10, 50))]],
    ),
    Problem(
        "distinct_sorted",
        "input()\nprint(*sorted(set(map(int, input().split()))))",
        "input()\nprint(*sorted(map(int, input().split())))",
        "input()\nxs = sorted(set(map(int, input().split())))\nprint(*xs[: len(xs) // (xs[0] % 3)])",
        lambda r: [f"{n}\n{ints(r, n, -30, 30)}" for n in [r.randint(1, 500) for _ in range(r.randint(10, 50))]],
    ),
]


def _balanced(r: random.Random, pairs: int) -> str:
    out: list[str] = []
    stack: list[str] = []
    opened = 0
    while opened < pairs or stack:
        if opened < pairs and (not stack or r.random() < 0.5):
            c = r.choice("([{")
            out.append(c)
            stack.append({"(": ")", "[": "]", "{": "}"}[c])
            opened += 1
        else:
            out.append(stack.pop())
    return "".join(out)


def reference_output(code: str, stdin: str) -> str:
    """What the correct submission prints for `stdin` (run here, in this interpreter)."""
    out = io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin + "\n")
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<reference>", "exec"), {"__name__": "__main__"})
    finally:
        sys.stdin = old_stdin
    return out.getvalue()


def workload() -> list[dict[str, object]]:
    calls: list[dict[str, object]] = []
    for k, problem in enumerate(PROBLEMS):
        r = random.Random(1000 + k)
        inputs = problem.tests(r)
        if problem.slow is not None:  # its largest input is what the slow submission cannot finish
            inputs.append({"sum": f"1950\n{ints(r, 1950)}", "primes": "20000",
                           "balanced": _balanced(r, 200)}[problem.name])
        tests = [{"stdin": i, "expected_stdout": reference_output(problem.correct, i)} for i in inputs]
        submissions = [("correct", problem.correct), ("wrong_answer", problem.wrong),
                       ("runtime_error", problem.runtime_error),
                       ("syntax_error", problem.correct.replace("print(", "print((", 1))]
        if problem.slow is not None:
            submissions.append(("timeout", problem.slow))
        for tag, code in submissions:
            calls.append({"code": code, "tests": tests, "timeout": TIMEOUT_S, "tag": f"{problem.name}/{tag}"})
    return calls


def main() -> None:
    path = OUT / "code.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in workload()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
