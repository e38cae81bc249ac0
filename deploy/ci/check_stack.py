"""Checks a running compose stack through its gateway (deploy/ci/test-compose.sh runs it).

    python deploy/ci/check_stack.py basics URL     hostile basics, one batch, the jail's interpreter
    python deploy/ci/check_stack.py spread URL N   wait for N live workers, then run a batch they share

The token comes from CODEENV_TOKEN; the Redis port the jails must not reach from CODEENV_CI_REDIS_PORT.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time

import httpx

from codeenv.bench.services import ServiceError, wait_ready

NETWORK_ERRORS = {"OSError", "ConnectionRefusedError", "URLError", "gaierror", "TimeoutError",
                  "ConnectionError", "PermissionError"}


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {os.environ['CODEENV_TOKEN']}"}


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, headers=auth())


def gateway_ready(url: str, timeout_s: float = 240) -> None:
    try:
        wait_ready(url, timeout_s, headers=auth())
    except ServiceError as exc:
        sys.exit(f"the gateway: {exc}")


def batch(http: httpx.Client, requests: list[dict[str, object]]) -> list[dict[str, object]]:
    response = http.post("/v1/execute/batch", json={"requests": requests})
    response.raise_for_status()
    results: list[dict[str, object]] = response.json()["results"]
    return results


def check(ok: bool, what: str, result: object) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        sys.exit(f"{what}: {result}")


def basics(url: str) -> None:
    redis_port = int(os.environ.get("CODEENV_CI_REDIS_PORT", "26379"))
    gateway_ready(url)
    with client(url) as http:
        version, net, redis_, memory, fork, after = batch(http, [
            {"code": "import sys\nprint('%d.%d.%d' % sys.version_info[:3])"},
            {"code": "import urllib.request\nurllib.request.urlopen('http://deb.debian.org/', timeout=3)",
             "limits": {"wall_s": 10}},
            {"code": f"import socket\nsocket.create_connection(('127.0.0.1', {redis_port}), timeout=3)"},
            {"code": "blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))",
             "limits": {"memory_mb": 256, "wall_s": 10}},
            {"code": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
             "limits": {"wall_s": 3}},
            {"code": "print(sum(range(10)))"},
        ])
        jail_python = str(version["stdout"]).strip()
        check(version["status"] == "ok" and re.fullmatch(r"3\.(1[2-9]|[2-9]\d)\.\d+", jail_python) is not None
              and version.get("python") == jail_python,
              f"a batch through the gateway; the jail runs Python {jail_python}, as the result says "
              f"(image {version['image']})", version)
        check(net["status"] == "error" and (net["error"] or {}).get("type") in NETWORK_ERRORS,  # type: ignore[union-attr]
              f"no network from a jail ({(net['error'] or {}).get('type')})", net)  # type: ignore[union-attr]
        check(redis_["status"] == "error" and (redis_["error"] or {}).get("type") in NETWORK_ERRORS,  # type: ignore[union-attr]
              f"Redis (127.0.0.1:{redis_port}) unreachable from a jail", redis_)
        check(memory["status"] == "memory", "a memory bomb gets status memory", memory)
        check(fork["status"] not in ("ok", "internal_error"), f"a fork bomb is contained ({fork['status']})", fork)
        check(after["status"] == "ok" and after["stdout"] == "45\n", "the call beside it still runs", after)
        again = batch(http, [{"code": "print('still here')"}])[0]
        check(again["status"] == "ok", "the service answers after the hostile batch", again)


def spread(url: str, workers: int) -> None:
    with client(url) as http:
        deadline = time.monotonic() + 240
        while True:
            metrics = http.get("/metrics").text
            m = re.search(r"^codeenv_workers\s+(\S+)", metrics, re.MULTILINE)
            if m and float(m.group(1)) >= workers:
                break
            if time.monotonic() > deadline:
                sys.exit(f"fewer than {workers} live workers after 240 s: {m.group(0) if m else 'no metric'}")
            time.sleep(1)
        print(f"ok   {workers} live workers")
        results = batch(http, [{"code": f"import time\ntime.sleep(0.3)\nprint({i})"} for i in range(24)])
        bad = [r for r in results if r["status"] != "ok"]
        check(not bad, f"a batch of {len(results)} calls spread over the workers", bad[:2])
        # A problem package uploaded to the gateway once: the workers fetch it from there (its public_url).
        body = json.dumps({"tests": [{"stdin": str(i), "expected_stdout": str(2 * i)} for i in range(20)],
                           "limits": {"cpu_s": 2}}).encode()
        sha = hashlib.sha256(body).hexdigest()
        put = http.put(f"/v1/problems/{sha}", content=body, headers={"content-type": "application/json"})
        check(put.status_code in (200, 201), "a problem package uploaded to the gateway", put.text)
        code = "import time\ntime.sleep(0.2)\nprint(int(input()) * 2)"
        judged = http.post("/v1/judge/batch", json={"requests": [{"code": code, "problem": sha}] * 8})
        judged.raise_for_status()
        verdicts = judged.json()["results"]
        failed = [r for r in verdicts if r["status"] != "passed"]
        on = len({r["worker"].rsplit("/", 1)[0] for r in verdicts})
        check(not failed, f"{len(verdicts)} submissions judged by reference on {on} workers, which fetched the "
                          "package from the gateway", failed[:2])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "basics":
        basics(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "spread":
        spread(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(__doc__)
