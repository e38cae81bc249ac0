"""A burst of mixed hostile and ordinary calls: every call gets its own verdict, nothing leaks."""

from __future__ import annotations

import asyncio
import random

import pytest

from codeenv import ExecRequest, SlotPool

pytestmark = [pytest.mark.jail, pytest.mark.slow]

KINDS = {
    "ok": ("import math\nprint(math.factorial(20))", {}, "ok", "2432902008176640000\n"),
    "sympy": ("import sympy\nprint(sympy.isprime(2**61 - 1))", {}, "ok", "True\n"),
    "error": ("raise ValueError('nope')", {}, "error", ""),
    "timeout": ("while True: pass", {"wall_s": 0.5}, "timeout", ""),
    "memory": ("x = bytearray(600 * 1024**2)", {"memory_mb": 200}, "memory", ""),
    "flood": ("import sys\nwhile True: sys.stdout.write('x' * 4096)", {}, "output_limit", None),
    "files": ("import os\nfor i in range(500): open(f'f{i}', 'w').write('x')\nprint('ok')", {}, "ok", "ok\n"),
    "fork": ("import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n        time.sleep(5)\nprint('forked')",
             {}, "ok", "forked\n"),
    "exit": ("import sys\nsys.exit(4)", {}, "error", ""),
}


async def test_mixed_burst(pool: SlotPool) -> None:
    rng = random.Random(7)
    kinds = [rng.choice(list(KINDS)) for _ in range(240)]
    before = pool.restarts
    results = await asyncio.wait_for(asyncio.gather(*(
        pool.run(ExecRequest(code=KINDS[k][0], limits=KINDS[k][1], id=f"{i}-{k}")) for i, k in enumerate(kinds)
    )), 240)
    for i, (kind, result) in enumerate(zip(kinds, results, strict=True)):
        _, _, status, stdout = KINDS[kind]
        assert result.id == f"{i}-{kind}"
        assert result.status == status, (kind, result)
        if stdout is not None:
            assert result.stdout == stdout, (kind, result)
    assert pool.restarts == before
    # Every slot comes back once its last call's traces are gone.
    for _ in range(2000):
        if pool.free_slots == len(pool.slots):
            break
        await asyncio.sleep(0.005)
    assert pool.free_slots == len(pool.slots)
