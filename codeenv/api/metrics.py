"""Prometheus metrics of a gateway (`/metrics`)."""

from __future__ import annotations

import collections
import functools
import itertools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest, multiprocess

from codeenv.models import SERVICE_FAULTS, ExecRequest, ExecResult, Status, judge_status
from codeenv.queue.base import CallQueue

#: The training steps a gateway process keeps figures of (the highest; a request's `step` label).
STEPS_KEPT = 64
#: Latency buckets 1.5x apart from 1 ms to 60 s: a percentile read off them is within 1.5x.
LATENCY_BUCKETS = (*(1.5**i / 1000 for i in range(28)), 60.0)
#: The bounds as /v1/live shows them (once, for every histogram), to 4 significant digits (0.05767,
#: not 0.0576650390625): the page's percentiles move by less than 0.05%.
LIVE_BOUNDS = [float(f"{bound:.4g}") for bound in LATENCY_BUCKETS]
#: The latency histograms, by name: what the live page and /v1/live read.
LATENCIES = {"queue": "codeenv_queue_seconds", "run": "codeenv_run_seconds",
             "overhead": "codeenv_overhead_seconds", "end_to_end": "codeenv_end_to_end_seconds"}
#: The `api` label of a session cell sent to /v1/execute (its path says native).
SESSION_API = "session"
#: The `api` label of a request, by its path's start (the first that matches; else "other").
API_OF = (("/v1/sessions", SESSION_API), ("/v1/judge", "judge"), ("/v1/", "native"), ("/run_code", "sandbox_fusion"),
          ("/run", "code_judge"), ("/judge", "code_judge"), ("/execute_batch", "routers"),
          ("/morph/", "routers"), ("/execute", "nemo"), ("/api/v2/", "piston"), ("/mcp", "mcp"))


def _observe_times(timed: list[tuple[Histogram, Histogram, float]], accepted: float) -> None:
    """Each call's end to end (from `accepted` to now) and overhead (that less its queue wait and
    run time), into its (end to end, overhead) histograms."""
    total = max(0.0, time.monotonic() - accepted)
    for end_to_end_s, overhead_s, inside in timed:
        end_to_end_s.observe(total)
        overhead_s.observe(max(0.0, total - inside))


def api_of(path: str) -> str:
    """The `api` label of a request to `path`."""
    for start, api in API_OF:
        if path.startswith(start):
            return api
    return "other"


class Steps:
    """The figures of the calls that carried a `step` label, per step, for the last STEPS_KEPT steps
    (the highest seen: a late call of an evicted step is not counted again): calls, the status mix,
    service faults, CPU seconds and the step's slowest call (its id and wall time). Not Prometheus
    labels: a label per step would grow without end."""

    def __init__(self, kept: int = STEPS_KEPT) -> None:
        self.kept = kept
        self._steps: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()

    def observe(self, step: int, result: ExecResult) -> None:
        figures = self._steps.get(step)
        if figures is None:
            if len(self._steps) >= self.kept and step < min(self._steps):
                return  # older than every step kept
            figures = self._steps[step] = {"step": step, "calls": 0, "statuses": {}, "service_faults": 0,
                                           "cpu_s": 0.0, "slowest": None}
            if len(self._steps) > self.kept:
                del self._steps[min(self._steps)]
        figures["calls"] += 1
        statuses = figures["statuses"]
        statuses[result.status.value] = statuses.get(result.status.value, 0) + 1
        figures["service_faults"] += result.status in SERVICE_FAULTS
        figures["cpu_s"] += result.cpu_s
        slowest = figures["slowest"]
        if result.started and result.status is not Status.session_lost and \
                (slowest is None or result.wall_s > slowest["wall_s"]):
            figures["slowest"] = {"id": result.id, "wall_s": result.wall_s, "status": result.status.value}

    def view(self) -> list[dict[str, Any]]:
        """The steps kept, the highest first (copies)."""
        return [{**f, "statuses": dict(f["statuses"]), "cpu_s": round(f["cpu_s"], 6)}
                for _, f in sorted(self._steps.items(), reverse=True)]


class Metrics:
    """Prometheus metrics of a gateway. Under `serve --processes N` (PROMETHEUS_MULTIPROC_DIR set)
    every process writes its values to files and a scrape of any process reads them all: counters
    and histograms add up, in-flight calls add up over live processes, the queue's gauges (the same
    host-wide figures in every process) are the most recent reading."""

    STATS = (("slots", "Slots of the workers"), ("free_slots", "Slots free right now"),
             ("slot_restarts", "Jails recycled since start"),
             ("waiting", "Calls accepted and waiting for a slot (the queue's depth)"),
             ("oldest_wait_s", "How long the oldest waiting call has waited (the queue's age)"),
             ("workers", "Live workers behind this gateway"),
             ("calls_run", "Calls the workers have run"),
             ("sessions", "Live sessions on the workers"))
    #: Per worker (label `worker`), where the queue reports them (`CallQueue.worker_figures`): the key
    #: in a worker's figures (the metric is `codeenv_worker_KEY`, but for WORKER_METRIC_NAMES) and its help.
    WORKER_FIGURES = (
        ("up", "1 while a worker can run calls (a zygote is alive), else 0"),
        ("slots", "Slots of a worker"),
        ("free_slots", "Slots of a worker free right now"),
        ("slot_restarts", "Jails a worker recycled since it started"),
        ("calls_run", "Calls and cells a worker has run since it started"),
        ("oom_kills", "Calls and cells the kernel's OOM killer ended (status memory) since start"),
        ("seccomp_kills", "Calls and cells the seccomp filter ended (SIGSYS) since start"),
        ("memory_bytes", "Memory a worker's jails and sessions use now"),
        ("memory_allowance_bytes", "Memory the worker may use (its cgroup's limit or the host's), as its sizing "
                                   "rule read it"),
        ("memory_needed_bytes", "The sizing rule's worst case: slots x (zygotes + the largest call)"),
        ("heartbeat_age_s", "Since a worker's last heartbeat (0 in embedded mode)"),
        ("sessions", "Live sessions of a worker"),
        ("session_room", "More sessions a worker takes now (0 while it drains)"),
        ("session_memory_bytes", "Memory of a worker's session families"),
        ("cells", "Cells a worker has run since it started (rate(): cells/s)"),
        ("sessions_created", "Sessions a worker created (forks too) since it started"),
        ("rollbacks", "Cells a worker rolled back (stopped by a limit) since it started"),
        ("sessions_lost", "Sessions a worker lost (their processes died) since it started"),
        ("sessions_evicted", "Sessions a worker evicted (short of memory) since it started"))
    #: The figures whose metric is not named by their key (Prometheus' base unit: seconds).
    WORKER_METRIC_NAMES = {"heartbeat_age_s": "heartbeat_age_seconds"}

    def __init__(self, queue: CallQueue) -> None:
        self.queue = queue
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry()
        registry = self.registry
        self.calls = Counter("codeenv_calls", "Calls answered, by status", ["status"], registry=registry)
        self.accepted = Counter("codeenv_calls_accepted", "Calls the gateway took (answered or not yet)",
                                registry=registry)
        docs = {"queue": "Time a call waited for a slot", "run": "Wall time of a call's program",
                "overhead": "A call's time in the service that is neither its wait for a slot nor its program's run",
                "end_to_end": "From a call's arrival at the gateway to its answer's sending"}
        self.latency = {key: Histogram(name, f"{docs[key]}, by API and profile", ["api", "profile"],
                                       registry=registry, buckets=LATENCY_BUCKETS)
                        for key, name in LATENCIES.items()}
        self._latency_of: dict[tuple[str, str], list[Histogram]] = {}  # (api, profile) -> their children
        self._counter_of: dict[tuple[Counter, str], Counter] = {}  # (counter, label) -> its child
        self.judged = Counter("codeenv_judge_submissions", "Judged submissions, by verdict", ["verdict"],
                              registry=registry)
        self.tests = Counter("codeenv_judge_tests", "Tests of judged submissions, by status", ["status"],
                             registry=registry)
        self.in_flight = Gauge("codeenv_in_flight_calls", "Calls accepted and not yet answered",
                               registry=registry, multiprocess_mode="livesum")
        self.loop_lag = Gauge("codeenv_event_loop_lag_seconds", "How late a gateway's event loop runs a timer",
                              registry=registry, multiprocess_mode="livemax")
        self.stats = {key: Gauge(f"codeenv_{key}", doc, registry=registry, multiprocess_mode="mostrecent")
                      for key, doc in self.STATS}
        self.steps = Steps()
        self.per_worker = {key: Gauge(f"codeenv_worker_{self.WORKER_METRIC_NAMES.get(key, key)}", doc, ["worker"],
                                      registry=registry, multiprocess_mode="mostrecent")
                           for key, doc in self.WORKER_FIGURES}

    def observe(self, results: Sequence[ExecResult], calls: Sequence[ExecRequest | None] = (),
                accepted: float | None = None, api: str = "native",
                answered: list[Callable[[], None]] | None = None) -> None:
        """Count `results`; `calls`, where given, are their requests (in order: a `step` label, a
        session cell); `accepted`: when (monotonic) the gateway took them, for their end-to-end time
        and overhead; `api`: the API they came by (API_OF names them). With `answered` (the Guard's
        list for a request, run once the answer is sent) end to end and overhead end there, when the
        answer has been encoded and handed to the connection; without it, now."""
        timed: list[tuple[Histogram, Histogram, float]] = []
        # Counters by label are added up over the results first: one increment per label seen, not
        # one per call (a batch's calls mostly share a status, a judged call's tests too).
        statuses: dict[str, int] = {}
        tests: dict[str, int] = {}
        for index, r in enumerate(results):
            statuses[r.status.value] = statuses.get(r.status.value, 0) + 1
            call = calls[index] if index < len(calls) else None
            if r.started:
                kind = SESSION_API if api == "native" and call is not None and call.session is not None else api
                labels = (kind, r.profile or "")
                children = self._latency_of.get(labels)
                if children is None:
                    children = self._latency_of[labels] = [h.labels(*labels) for h in self.latency.values()]
                queue_s, run_s, overhead_s, end_to_end_s = children
                queue_s.observe(r.queue_s)
                run_s.observe(r.wall_s)
                if accepted is not None:
                    timed.append((end_to_end_s, overhead_s, r.queue_s + r.wall_s))
            if r.judge is not None:
                self.judged.labels(judge_status(r).value).inc()
                for test in r.judge.tests:
                    tests[test.status.value] = tests.get(test.status.value, 0) + 1
            if call is not None and call.step is not None:
                self.steps.observe(call.step, r)
        for counter, counts in ((self.calls, statuses), (self.tests, tests)):
            for label, n in counts.items():
                child = self._counter_of.get((counter, label))
                if child is None:
                    child = self._counter_of[counter, label] = counter.labels(label)
                child.inc(n)
        if timed:
            assert accepted is not None
            if answered is None:
                _observe_times(timed, accepted)
            else:
                answered.append(functools.partial(_observe_times, timed, accepted))

    def exposition(self) -> bytes:
        stats = self.queue.stats()
        for key, gauge in self.stats.items():
            gauge.set(stats.get(key, 0))
        figures = getattr(self.queue, "worker_figures", None)
        workers = figures() if figures is not None else {}
        for key, gauge in self.per_worker.items():
            gauge.clear()  # a worker gone is not shown
            for worker, values in workers.items():
                if key in values:
                    gauge.labels(worker).set(values[key])
        return generate_latest(self._collected())

    def _collected(self) -> CollectorRegistry:
        """This process's registry, or under --processes N every process's (their shared files)."""
        if not self.multiprocess:
            return self.registry
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return registry

    def _live_sources(self) -> tuple[Iterable[Metric], dict[tuple[str, str, str], dict[float, float]]]:
        """What live() reads: the metric families whose samples it takes, and the latency histograms
        already read ((latency, api, profile) -> le -> cumulative count). Under --processes N every
        process's files, histograms among their samples; else this process's counters and gauges, and
        its histograms off their children (the stats and per-worker gauges come from the queue)."""
        if self.multiprocess:
            return self._collected().collect(), {}
        own = (self.calls, self.judged, self.tests, self.accepted, self.in_flight, self.loop_lag)
        return itertools.chain.from_iterable(metric.collect() for metric in own), self._own_buckets()

    def _own_buckets(self) -> dict[tuple[str, str, str], dict[float, float]]:
        """This process's latency histograms, (latency, api, profile) -> le -> cumulative count, read
        off the children observe() made: their samples, built for /metrics' text (each bound as a
        string), were most of what a read of the live page cost the gateway."""
        buckets: dict[tuple[str, str, str], dict[float, float]] = {}
        for (api, profile), children in self._latency_of.items():
            for key, child in zip(LATENCIES, children, strict=True):
                merged = buckets[key, api, profile] = {}
                count = 0.0
                for bound, bucket in zip(child._upper_bounds, child._buckets, strict=True):
                    count += bucket.get()
                    merged[bound] = count
        return buckets

    def live(self) -> dict[str, Any]:
        """What the live page shows (GET /v1/live), every gateway process's counters and histograms
        (under --processes N, read from their shared files), the queue's and the workers' figures,
        this process's steps: cumulative counts, so that a reader's rates are differences. Latency:
        all calls, by API and by profile, each a histogram (cumulative counts by bucket, total), their
        bucket bounds once as `le`."""
        names = {name: key for key, name in LATENCIES.items()}
        counters: dict[str, dict[str, float]] = {"codeenv_calls_total": {}, "codeenv_judge_submissions_total": {},
                                                 "codeenv_judge_tests_total": {}}
        label_of = {"codeenv_calls_total": "status", "codeenv_judge_submissions_total": "verdict",
                    "codeenv_judge_tests_total": "status"}
        families, buckets = self._live_sources()
        in_flight, lag, accepted = 0.0, 0.0, 0.0
        for family in families:
            key = names.get(family.name)
            for sample in family.samples:
                name, labels = sample.name, sample.labels
                if name in counters:
                    by = counters[name]
                    by[labels[label_of[name]]] = by.get(labels[label_of[name]], 0.0) + sample.value
                elif key is not None and name.endswith("_bucket"):
                    merged = buckets.setdefault((key, labels["api"], labels["profile"]), {})
                    le = float(labels["le"])
                    merged[le] = merged.get(le, 0.0) + sample.value
                elif name == "codeenv_calls_accepted_total":
                    accepted += sample.value
                elif name == "codeenv_in_flight_calls":
                    in_flight += sample.value
                elif name == "codeenv_event_loop_lag_seconds":
                    lag = max(lag, sample.value)
        latency = {key: _histogram() for key in LATENCIES}
        by_api: dict[str, dict[str, dict[str, Any]]] = {}
        by_profile: dict[str, dict[str, dict[str, Any]]] = {}
        for (key, api, profile), merged in sorted(buckets.items()):
            for target in (latency[key], by_api.setdefault(api, {}).setdefault(key, _histogram()),
                           by_profile.setdefault(profile, {}).setdefault(key, _histogram())):
                _add(target, merged)
        figures_of = getattr(self.queue, "worker_figures", None)
        return {"time": time.time(), "le": LIVE_BOUNDS, "calls": counters["codeenv_calls_total"], "accepted": accepted,
                "in_flight": in_flight, "loop_lag_s": lag, "latency": latency, "by_api": by_api,
                "by_profile": by_profile, "judge": {"verdicts": counters["codeenv_judge_submissions_total"],
                                                    "tests": counters["codeenv_judge_tests_total"]},
                "queue": self.queue.stats(), "workers": figures_of() if figures_of is not None else {},
                "steps": self.steps.view()[:16]}

    def process_exit(self) -> None:
        if self.multiprocess:
            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


def _histogram() -> dict[str, Any]:
    return {"count": [0] * len(LATENCY_BUCKETS), "total": 0}


def _add(histogram: dict[str, Any], merged: dict[float, float]) -> None:
    """Add one label set's buckets (le -> cumulative count, every latency histogram's bounds) to
    `histogram`; counts as whole numbers, which they are."""
    get = merged.get
    histogram["count"] = [c + int(get(le, 0.0)) for c, le in zip(histogram["count"], LATENCY_BUCKETS, strict=True)]
    histogram["total"] += int(get(float("inf"), 0.0))  # the calls observed, the last bucket's too
