"""What a fresh interpreter does, a jailed call does too."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.conftest import Runner

pytestmark = pytest.mark.jail


async def test_print_and_stdin(run: Runner) -> None:
    r = await run("import sys\ndata = sys.stdin.read()\nprint(data.upper(), end='')", stdin="hello\nworld\n")
    assert r.status == "ok" and r.exit_code == 0 and r.started
    assert r.stdout == "HELLO\nWORLD\n"
    assert r.image and r.worker and r.profile == "light"


async def test_input_builtin(run: Runner) -> None:
    r = await run("a = int(input()); b = int(input()); print(a + b)", stdin="2\n40\n")
    assert r.stdout == "42\n"


async def test_output_is_byte_for_byte_what_cpython_prints(run: Runner) -> None:
    code = (
        "import math, fractions\n"
        "print(1/3, 2**100, math.pi, fractions.Fraction(3, 9), [1.5, None, 'x'], {'a': (1,)})\n"
        "print('ünïcödé ✓', end='|')\n"
        "import sys; sys.stdout.write('tail without newline')\n"
        "print('to stderr', file=sys.stderr)\n"
    )
    r = await run(code)
    host = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout == host.stdout
    assert r.stderr == host.stderr


async def test_dunder_main_runs(run: Runner) -> None:
    r = await run("def main():\n    print('main ran')\n\nif __name__ == '__main__':\n    main()\n")
    assert r.stdout == "main ran\n"


async def test_traceback_shows_source_lines(run: Runner) -> None:
    r = await run("x = 1\ndef f():\n    return x / 0\nf()\n")
    assert r.status == "error" and r.exit_code == 1
    assert "return x / 0" in r.stderr and "f()" in r.stderr
    assert "zygote" not in r.stderr
    assert r.error is not None
    assert (r.error.type, r.error.message, r.error.line) == ("ZeroDivisionError", "division by zero", 3)


async def test_syntax_error_is_reported(run: Runner) -> None:
    r = await run("print('ok')\nx = (1,\ny = 2 +\n")
    assert r.status == "error"
    assert r.error is not None and r.error.type == "SyntaxError"
    assert r.error.line is not None and r.error.line >= 2
    assert "SyntaxError" in r.stderr and r.stdout == ""


async def test_exit_codes(run: Runner) -> None:
    r = await run("import sys\nprint('before')\nsys.exit(3)")
    assert (r.status, r.exit_code, r.stdout) == ("error", 3, "before\n")
    r = await run("import sys\nsys.exit('bye')")
    assert (r.status, r.exit_code) == ("error", 1) and r.stderr == "bye\n"
    r = await run("import sys\nsys.exit(0)")
    assert (r.status, r.exit_code) == ("ok", 0)
    r = await run("import os, sys\nprint('flushed?')\nsys.stdout.flush()\nos._exit(7)")
    assert (r.status, r.exit_code, r.stdout) == ("error", 7, "flushed?\n")


async def test_segfault_is_reported_as_a_signal(run: Runner) -> None:
    r = await run("import ctypes\nctypes.string_at(0)")
    assert r.status == "killed" and r.signal == 11 and r.exit_code is None


async def test_numpy_random_differs_between_calls(run: Runner) -> None:
    code = "import numpy as np, random\nprint(np.random.rand(), random.random())"
    outs = {(await run(code, slot=0)).stdout for _ in range(3)}
    assert len(outs) == 3


async def test_sympy_random_differs_between_calls(run: Runner) -> None:
    code = "from sympy.core.random import rng\nprint(rng.random())"
    outs = {(await run(code, slot=1)).stdout for _ in range(3)}
    assert len(outs) == 3


async def test_set_order_is_the_same_on_every_slot(run: Runner) -> None:
    code = "print({'apple', 'banana', 'cherry', 'date', 'elderberry', 'fig'})"
    outs = {(await run(code, slot=s)).stdout for s in (0, 1, 0, 1)}
    outs |= {(await run("import sympy\n" + code, slot=s)).stdout for s in (0, 1)}
    assert len(outs) == 1


async def test_numpy_and_scipy_run_under_the_defaults(run: Runner) -> None:
    code = (
        "import numpy as np\n"
        "a = np.random.rand(2000, 2000)\n"
        "b = a @ a\n"
        "from scipy.optimize import minimize\n"
        "res = minimize(lambda x: (x[0] - 3) ** 2 + (x[1] + 1) ** 2, [0, 0])\n"
        "print(b.shape, [round(float(v), 3) for v in res.x])\n"
    )
    r = await run(code)
    assert r.status == "ok", r
    assert r.stdout == "(2000, 2000) [3.0, -1.0]\n"
    assert r.memory_peak_kb is not None and r.memory_peak_kb > 60_000  # three 32 MB matrices
    assert r.profile == "scientific"


async def test_sympy_factor(run: Runner) -> None:
    r = await run("import sympy\nprint(sympy.factorint(2**64 - 1))")
    assert r.stdout == "{3: 1, 5: 1, 17: 1, 257: 1, 641: 1, 65537: 1, 6700417: 1}\n"
    assert r.profile == "math"


async def test_non_preloaded_module_imports(run: Runner) -> None:
    r = await run("import networkx as nx\nprint(nx.shortest_path_length(nx.path_graph(5), 0, 4))")
    assert r.stdout == "4\n"
    r = await run("import scipy.integrate as si\nprint(round(si.quad(lambda x: x * x, 0, 3)[0], 6))")
    assert r.stdout == "9.0\n"


async def test_work_dir_is_cwd_home_and_tmpdir(run: Runner) -> None:
    code = (
        "import os, tempfile\n"
        "print(os.getcwd(), os.environ['HOME'], tempfile.gettempdir())\n"
        "open('data.txt', 'w').write('x' * 10)\n"
        "open('/tmp/other.txt', 'w').write('y')\n"
        "print(sorted(os.listdir('.')))\n"
    )
    r = await run(code)
    assert r.stdout == "/work /work /work\n['data.txt', 'other.txt']\n"


async def test_threads_and_subprocesses_work(run: Runner) -> None:
    code = (
        "import threading, multiprocessing as mp\n"
        "out = []\n"
        "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "def sq(x):\n    return x * x\n"
        "if __name__ == '__main__':\n"
        "    with mp.get_context('fork').Pool(2) as p:\n"
        "        print(sorted(out), p.map(sq, range(5)))\n"
    )
    r = await run(code)
    assert r.status == "ok", r
    assert r.stdout == "[0, 1, 2, 3] [0, 1, 4, 9, 16]\n"


async def test_cpu_time_counts_children(run: Runner) -> None:
    code = (
        "import os\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    x = 0\n"
        "    for i in range(3_000_000): x += i\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
    )
    r = await run(code)
    assert r.status == "ok" and r.cpu_s > 0.05
