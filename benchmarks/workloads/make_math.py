# ruff: noqa: E501  (the programs are data: one template per line reads best)
"""Write the shipped workloads: `math` (a math-reasoning model's tool calls), `print` and `sympy`.

    python benchmarks/workloads/make_math.py        # rewrites codeenv/bench/workloads/*.jsonl

`math` is what a model trained to reason with a Python tool sends: mostly short sympy, numpy and
plain-Python computations (brute force, fractions, dynamic programming), some reading stdin, a few
calls that import a library or submodule no zygote preloads (scipy, networkx, sympy.stats), a tail
of calls that take over a second, about one call in ten that fails (a NameError, a typo, a bad
import, a recursion too deep) and a few that run out of time. Every program is deterministic: it
prints the same text on every run (floats are rounded, randomness is seeded, no set order leaks).
Each line says what kind of call it is (`tag`) so that the composition can be checked; `slow`
marks the tail. Expected outputs live beside it (`math.expect.jsonl`, written by
`codeenv bench --limit --workload math --write-expect ...`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "codeenv" / "bench" / "workloads"
TIMEOUT_S = 3.0  # the tool's wall limit, as an RL run would set it for every call

Template = Callable[[random.Random], str]


def sympy_calls() -> list[Template]:
    return [
        lambda r: f"from sympy import factorint\nprint(factorint({r.randrange(10**11, 10**14)}))",
        lambda r: (f"from sympy import symbols, solve\nx = symbols('x')\n"
                   f"print(sorted(solve(x**2 - {r.randint(2, 30)}*x + {r.randint(1, 50)}, x), key=str))"),
        lambda r: (f"import sympy as sp\nx = sp.symbols('x')\n"
                   f"print(sp.integrate(x**{r.randint(1, 4)} * sp.exp({r.randint(1, 3)}*x), x))"),
        lambda r: (f"from sympy import symbols, simplify, factor\nx = symbols('x')\n"
                   f"e = (x**{r.randint(3, 6)} - 1) / (x - 1)\nprint(simplify(e))\nprint(factor(x**4 - {r.randint(2, 9)**4}))"),
        lambda r: (f"from sympy import summation, symbols, oo, Rational\nk = symbols('k', integer=True, positive=True)\n"
                   f"print(summation(1 / (k * (k + {r.randint(1, 6)})), (k, 1, oo)))"),
        lambda r: (f"from sympy import Matrix\nimport random\nrandom.seed({r.randint(0, 999)})\n"
                   f"m = Matrix({(n := r.choice([3, 4]))}, {n}, lambda i, j: random.randint(-5, 5))\n"
                   "print(m.det())\nprint(m.rank())"),
        lambda r: (f"from sympy import isprime, nextprime, primepi\nn = {r.randrange(10**5, 10**6)}\n"
                   "print(isprime(n), nextprime(n), primepi(n))"),
        lambda r: (f"from sympy import binomial, Rational\n"
                   f"print(sum(binomial({r.randint(10, 40)}, k) * Rational(1, k + 1) for k in range({r.randint(5, 15)})))"),
        lambda r: f"import sympy\nprint(sympy.N(sympy.pi + sympy.E, {r.randint(20, 60)}))",
        lambda r: (f"from sympy import symbols, diff, sin, cos, series\nx = symbols('x')\n"
                   f"print(diff(sin(x)**{r.randint(2, 5)} * cos(x), x))\nprint(series(sin(x) / x, x, 0, {r.randint(4, 9)}))"),
        lambda r: (f"from sympy.solvers.diophantine import diophantine\nfrom sympy import symbols\nx, y = symbols('x y', integer=True)\n"
                   f"print(diophantine({r.randint(2, 20)}*x + {r.randint(2, 20)}*y - {r.randint(1, 100)}))"),
        lambda r: (f"from sympy import divisors, totient, mobius\nn = {r.randrange(10**4, 10**7)}\n"
                   "print(len(divisors(n)), totient(n), mobius(n))"),
        lambda r: (f"from sympy import symbols, limit, sin, oo\nx = symbols('x')\n"
                   f"print(limit((1 + {r.randint(1, 5)}/x)**x, x, oo))\nprint(limit(sin({r.randint(2, 7)}*x) / x, x, 0))"),
        lambda r: (f"from sympy import symbols, Eq, solve\nx, y = symbols('x y')\n"
                   f"print(solve([Eq(x + y, {r.randint(5, 30)}), Eq(x - y, {r.randint(1, 4)})], [x, y]))"),
    ]


def sympy_not_preloaded() -> list[Template]:
    """sympy submodules that `import sympy` does not load: the call imports them itself."""
    return [
        lambda r: (f"from sympy.stats import Die, E, P\nD = Die('D', {r.choice([6, 8, 10, 12, 20])})\n"
                   f"print(E(D))\nprint(P(D > {r.randint(2, 5)}))"),
        lambda r: (f"from sympy.physics.units import convert_to, meter, kilometer\n"
                   f"print(convert_to({r.randint(2, 90)} * kilometer, meter))"),
    ]


def numpy_calls() -> list[Template]:
    return [
        lambda r: (f"import numpy as np\nrng = np.random.default_rng({r.randint(0, 999)})\n"
                   f"a = rng.integers(-9, 10, size=({r.choice([3, 4, 5])},) * 2)\n"
                   "print(round(float(np.linalg.det(a)), 4))\nprint(np.round(np.sort(np.abs(np.linalg.eigvals(a))), 4).tolist())"),
        lambda r: (f"import numpy as np\nn = np.arange(1, {r.randint(10**5, 10**6)})\n"
                   f"print(int(((n % {r.randint(3, 9)} == 0) | (n % {r.randint(10, 19)} == 0)).sum()))"),
        lambda r: (f"import numpy as np\nroots = np.roots([1, {r.randint(-9, 9)}, {r.randint(-9, 9)}, {r.randint(1, 9)}])\n"
                   "print(sorted(round(float(z.real), 6) for z in roots))"),
        lambda r: (f"import numpy as np\nx = np.linspace(0, {r.randint(1, 5)}, 10001)\n"
                   f"print(round(float(np.trapezoid(np.exp(-x**2) * x**{r.randint(1, 3)}, x)), 6))"),
        lambda r: (f"import numpy as np\nA = np.array([[{r.randint(1, 9)}, 1], [1, {r.randint(1, 9)}]], dtype=float)\n"
                   f"print(np.round(np.linalg.matrix_power(A, {r.randint(5, 30)}) / 1e9, 3).tolist())"),
        lambda r: (f"import numpy as np\nrng = np.random.default_rng({r.randint(0, 999)})\n"
                   f"s = rng.integers(1, 7, size=({r.randint(10**4, 10**5)}, 3)).sum(axis=1)\n"
                   f"print(int((s == {r.randint(8, 12)}).sum()))"),
    ]


def scientific_calls() -> list[Template]:
    """Libraries the math profile does not preload (the call goes to the scientific profile)."""
    return [
        lambda r: (f"from scipy.optimize import minimize_scalar\n"
                   f"res = minimize_scalar(lambda t: (t - {r.randint(1, 9)})**2 + {r.randint(1, 5)}*abs(t), bounds=(-20, 20), method='bounded')\n"
                   "print(round(float(res.x), 3))"),
        lambda r: (f"from scipy.integrate import quad\nimport math\n"
                   f"print(round(quad(lambda t: math.exp(-t) * t**{r.randint(1, 4)}, 0, math.inf)[0], 6))"),
        lambda r: (f"import networkx as nx\nG = nx.cycle_graph({r.randint(10, 60)})\nG.add_edge(0, {r.randint(5, 9)})\n"
                   f"print(nx.shortest_path_length(G, 0, {r.randint(3, 9)}), nx.number_of_edges(G))"),
    ]


def pure_calls() -> list[Template]:
    return [
        lambda r: (f"count = 0\nfor n in range(1, {r.randint(10**4, 2 * 10**5)}):\n"
                   f"    if sum(map(int, str(n))) % {r.randint(5, 13)} == 0:\n        count += 1\nprint(count)"),
        lambda r: (f"from fractions import Fraction\n"
                   f"print(sum(Fraction(1, k * (k + 1)) for k in range(1, {r.randint(50, 400)})))"),
        lambda r: (f"from itertools import combinations\n"
                   f"print(sum(1 for c in combinations(range(1, {r.randint(15, 25)}), 3) if sum(c) % {r.randint(3, 7)} == 0))"),
        lambda r: (f"N = {r.randint(50, 300)}\np = [1] + [0] * N\nfor k in range(1, N + 1):\n"
                   "    for n in range(k, N + 1):\n        p[n] += p[n - k]\nprint(p[N])"),
        lambda r: f"import math\nprint(math.gcd({r.randrange(10**8)}, {r.randrange(10**8)}), pow({r.randint(2, 99)}, {r.randrange(10**6)}, 10**9 + 7))",
        lambda r: (f"from math import comb\nprint(comb({r.randint(20, 60)}, {r.randint(3, 15)}) % 1000007)"),
        lambda r: (f"seen = {{}}\nx, i = {r.randint(1, 99)}, 0\nwhile x not in seen:\n    seen[x] = i\n"
                   f"    x = (x * x + {r.randint(1, 9)}) % {r.randint(1000, 50000)}\n    i += 1\nprint(i, i - seen[x])"),
        lambda r: (f"def collatz(n):\n    s = 0\n    while n != 1:\n        n = n // 2 if n % 2 == 0 else 3 * n + 1\n        s += 1\n"
                   f"    return s\nprint(max(range(1, {r.randint(2000, 20000)}), key=collatz))"),
    ]


def stdin_calls() -> list[tuple[Template, Callable[[random.Random], str]]]:
    return [
        (lambda r: "import sys\nnums = list(map(int, sys.stdin.read().split()))\nprint(sum(nums), max(nums) - min(nums))",
         lambda r: " ".join(str(r.randint(-1000, 1000)) for _ in range(r.randint(5, 50))) + "\n"),
        (lambda r: "a, b = map(int, input().split())\nfrom math import gcd\nprint(a * b // gcd(a, b))",
         lambda r: f"{r.randint(2, 10**6)} {r.randint(2, 10**6)}\n"),
    ]


def slow_calls() -> list[Template]:
    """The tail: calls that take over a second of CPU here."""
    return [
        lambda r: (f"N = {r.randint(120, 140) * 10**5}\nsieve = bytearray([1]) * (N + 1)\nsieve[0] = sieve[1] = 0\n"
                   "for i in range(2, int(N**0.5) + 1):\n    if sieve[i]:\n        sieve[i*i::i] = bytearray(len(range(i*i, N + 1, i)))\n"
                   "total = 0\nfor i in range(N + 1):\n    if sieve[i]:\n        total += i\nprint(total)"),
        lambda r: (f"from math import isqrt\nN = {r.randint(2200, 2400)}\ncount = 0\nfor a in range(1, N):\n"
                   "    for b in range(a, N):\n        c2 = a * a + b * b\n        c = isqrt(c2)\n"
                   "        if c * c == c2 and c < N:\n            count += 1\nprint(count)"),
    ]


def error_calls() -> list[Template]:
    return [
        lambda r: f"total = 0\nfor i in range({r.randint(5, 50)}):\n    total += i\nprint(totl)",
        lambda r: f"from sympy import symbols\nx = symbols('x')\nprint(solve(x**2 - {r.randint(2, 9)}, x))",
        lambda r: f"print(sum(1 / (k - {r.randint(2, 9)}) for k in range(10)))",
        lambda r: f"import numpy as np\nprint(np.arange({r.randint(3, 9)}) @ np.ones(2))",
        lambda r: f"def f(n):\n    return f(n - 1) + {r.randint(1, 9)}\nprint(f(10))",
        lambda r: f"x = [1, 2, 3\nprint(x[{r.randint(0, 2)}])",
        lambda r: f"import sympyy\nprint(sympyy.factorint({r.randint(10, 999)}))",
        lambda r: f"assert {r.randint(2, 99)} % 2 == 3, 'not what I expected'",
    ]


def timeout_calls() -> list[Template]:
    """Brute-force searches that never finish: the call runs until its time limit."""
    return [
        lambda r: (f"n = {r.randint(10, 99)}\nwhile True:\n    if n * n == {r.randint(2, 9) * 10**9 + 7} * 2:\n"
                   "        break\n    n += 1\nprint(n)"),
    ]


#: (tag, share of calls): the composition the workload's test checks.
COMPOSITION = {"sympy": 0.38, "sympy_submodule": 0.03, "numpy": 0.15, "scientific": 0.05, "pure": 0.20,
               "stdin": 0.05, "slow": 0.04, "error": 0.08, "timeout": 0.02}


def math_workload(calls: int = 200, seed: int = 20261202) -> list[dict[str, object]]:
    r = random.Random(seed)
    pools: dict[str, list[Template]] = {
        "sympy": sympy_calls(), "sympy_submodule": sympy_not_preloaded(), "numpy": numpy_calls(),
        "scientific": scientific_calls(), "pure": pure_calls(), "slow": slow_calls(), "error": error_calls(),
        "timeout": timeout_calls(),
    }
    lines: list[dict[str, object]] = []
    for tag, share in COMPOSITION.items():
        for i in range(round(calls * share)):
            stdin = ""
            if tag == "stdin":
                make_code, make_stdin = stdin_calls()[i % len(stdin_calls())]
                code, stdin = make_code(r), make_stdin(r)
            else:
                templates = pools[tag]
                code = templates[i % len(templates)](r)
            lines.append({"code": code, "stdin": stdin, "timeout": TIMEOUT_S, "tag": tag})
    r.shuffle(lines)
    return lines


def write(name: str, lines: list[dict[str, object]]) -> None:
    path = OUT / f"{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{path.name}: {len(lines)} calls")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    write("math", math_workload())
    write("print", [{"code": "print(1)", "tag": "print"}])
    write("sympy", [{"code": "import sympy\nprint(sympy.factorint(2**64 - 1))", "tag": "sympy"}])


if __name__ == "__main__":
    main()
