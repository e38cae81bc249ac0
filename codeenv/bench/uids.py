"""Host uid blocks for the pools that codeenv's own tests, benchmarks and `codeenv bench` start.

Slot i of a pool runs as host uid ``uid_base + i``, and two pools on one host must not share a uid
(the pool refuses to start: `codeenv.sandbox.pool.check_uids_free`). Every pool or service those
start gets a block of its own from this one table, laid out end to end so that no two overlap:

    from codeenv.bench.uids import uid_base
    settings = SandboxSettings(slots=2, uid_base=uid_base("tests.supervision", base))

`base` places the whole table: `codeenv bench` and the benchmarks use the sandbox's own
``uid_base`` (CODEENV_UID_BASE); the test suite uses CODEENV_TEST_UID_BASE when set. Two runs side
by side need bases at least `SPAN` apart.
"""

from __future__ import annotations

#: The most slots a pool may have (SandboxSettings.slots' bound): a block this wide holds any pool.
MAX_SLOTS = 1024


def _end_to_end(*blocks: tuple[str, int]) -> dict[str, range]:
    table: dict[str, range] = {}
    start = 0
    for name, size in blocks:
        table[name] = range(start, start + size)
        start += size
    return table


#: Block name -> the uid offsets above the base it owns.
UID_BLOCKS: dict[str, range] = _end_to_end(
    # The test suite: pools of one or two slots. The session's pool sits at the base itself.
    ("tests.pool", 64),
    ("tests.supervision", 64),
    ("tests.image", 64),
    ("tests.no-prefork", 64),
    ("tests.cli", 64),
    ("tests.serve", 64),
    ("tests.serve-processes", 64),
    ("tests.pool-process", 64),
    ("tests.math-verify", 64),
    ("tests.client", 64),
    ("tests.cgroups", 64),
    ("tests.redis", 512),  # several `codeenv worker` processes and a gateway, at offsets of their own
    ("tests.doctor", MAX_SLOTS),  # sizes for the default slot count, one per core
    # `codeenv bench`'s own targets and the benchmarks: any slot count, so a full block each; all of
    # them above MAX_SLOTS, clear of a worker that runs at the base itself.
    ("bench.codeenv", MAX_SLOTS),
    ("bench.codeenv-redis", MAX_SLOTS),
    ("bench.naive-jail", MAX_SLOTS),
    ("bench.naive", MAX_SLOTS),
    ("benchmarks.engine", MAX_SLOTS),
    ("benchmarks.engine-naive", MAX_SLOTS),
    ("benchmarks.engine-naive-jail", MAX_SLOTS),
    ("benchmarks.gateway-direct", MAX_SLOTS),
    ("benchmarks.gateway-http", MAX_SLOTS),
    ("benchmarks.gateway-redis", MAX_SLOTS),
    ("benchmarks.burst", MAX_SLOTS),
    ("benchmarks.client", MAX_SLOTS),
)
#: How far the table reaches above its base.
SPAN = max(block.stop for block in UID_BLOCKS.values())


def uid_base(name: str, base: int) -> int:
    """The first host uid of block `name` in the table placed at `base` (KeyError for an unknown name)."""
    return base + UID_BLOCKS[name].start
