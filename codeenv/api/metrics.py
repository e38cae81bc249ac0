"""Prometheus metrics of a gateway (`/metrics`)."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from codeenv.models import SERVICE_FAULTS, ExecResult, Status
from codeenv.queue.base import CallQueue

#: The training steps a gateway process keeps figures of (the highest; a request's `step` label).
STEPS_KEPT = 64
#: Latency buckets 1.5x apart from 1 ms to 60 s: a percentile read off them is within 1.5x.
LATENCY_BUCKETS = (*(1.5**i / 1000 for i in range(28)), 60.0)
#: The latency histograms, by name: what the live page and /v1/live read.
LATENCIES = {"queue": "codeenv_queue_seconds", "run": "codeenv_run_seconds",
             "overhead": "codeenv_overhead_seconds", "end_to_end": "codeenv_end_to_end_seconds"}


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
    #: Per worker (label `worker`), where the queue reports them (`CallQueue.worker_figures`).
    WORKER_FIGURES = (("sessions", "Live sessions of a worker"),
                      ("session_room", "More sessions a worker takes now (0 while it drains)"),
                      ("session_memory_bytes", "Memory of a worker's session families"),
                      ("cells", "Cells a worker has run since it started (rate(): cells/s)"),
                      ("sessions_lost", "Sessions a worker lost (their processes died) since it started"),
                      ("sessions_evicted", "Sessions a worker evicted (short of memory) since it started"))

    def __init__(self, queue: CallQueue) -> None:
        self.queue = queue
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry()
        self.calls = Counter("codeenv_calls", "Calls answered, by status", ["status"], registry=self.registry)
        self.queue_s = Histogram("codeenv_queue_seconds", "Time a call waited for a slot", registry=self.registry,
                                 buckets=LATENCY_BUCKETS)
        self.run_s = Histogram("codeenv_run_seconds", "Wall time of a call's program", registry=self.registry,
                               buckets=LATENCY_BUCKETS)
        self.overhead_s = Histogram("codeenv_overhead_seconds", "A call's time in the service that is neither "
                                    "its wait for a slot nor its program's run", registry=self.registry,
                                    buckets=LATENCY_BUCKETS)
        self.end_to_end_s = Histogram("codeenv_end_to_end_seconds", "From a call's arrival at the gateway to its "
                                      "answer", registry=self.registry, buckets=LATENCY_BUCKETS)
        self.in_flight = Gauge("codeenv_in_flight_calls", "Calls accepted and not yet answered",
                               registry=self.registry, multiprocess_mode="livesum")
        self.loop_lag = Gauge("codeenv_event_loop_lag_seconds", "How late a gateway's event loop runs a timer",
                              registry=self.registry, multiprocess_mode="livemax")
        self.stats = {key: Gauge(f"codeenv_{key}", doc, registry=self.registry, multiprocess_mode="mostrecent")
                      for key, doc in self.STATS}
        self.steps = Steps()
        self.per_worker = {key: Gauge(f"codeenv_worker_{key}", doc, ["worker"], registry=self.registry,
                                      multiprocess_mode="mostrecent") for key, doc in self.WORKER_FIGURES}

    def observe(self, results: list[ExecResult], steps: Sequence[int | None] = (),
                accepted: float | None = None) -> None:
        """Count `results`; `steps`, where given, is each one's request's `step` label (or None);
        `accepted`: when (monotonic) the gateway took them, for their end-to-end time and overhead."""
        now = time.monotonic()
        for r in results:
            self.calls.labels(r.status.value).inc()
            if r.started:
                self.queue_s.observe(r.queue_s)
                self.run_s.observe(r.wall_s)
                if accepted is not None:
                    total = max(0.0, now - accepted)
                    self.end_to_end_s.observe(total)
                    self.overhead_s.observe(max(0.0, total - r.queue_s - r.wall_s))
        for step, r in zip(steps, results, strict=False):
            if step is not None:
                self.steps.observe(step, r)

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
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)

    def live(self) -> dict[str, Any]:
        """What the live page shows (GET /v1/live), every gateway process's counters and histograms
        (under --processes N, read from their shared files), the queue's and the workers' figures,
        this process's steps: cumulative counts, so that a reader's rates are differences."""
        registry = self.registry
        if self.multiprocess:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        calls: dict[str, float] = {}
        latency: dict[str, dict[str, Any]] = {key: {"le": [], "count": [], "sum": 0.0, "total": 0.0}
                                              for key in LATENCIES}
        names = {name: key for key, name in LATENCIES.items()}
        in_flight, lag = 0.0, 0.0
        for family in registry.collect():
            key = names.get(family.name)
            for sample in family.samples:
                if sample.name == "codeenv_calls_total":
                    calls[sample.labels["status"]] = calls.get(sample.labels["status"], 0.0) + sample.value
                elif key is not None and sample.name.endswith("_bucket"):
                    latency[key]["le"].append(float(sample.labels["le"]))
                    latency[key]["count"].append(sample.value)
                elif key is not None and sample.name.endswith("_sum"):
                    latency[key]["sum"] += sample.value
                elif sample.name == "codeenv_in_flight_calls":
                    in_flight += sample.value
                elif sample.name == "codeenv_event_loop_lag_seconds":
                    lag = max(lag, sample.value)
        for figures in latency.values():  # buckets in order (a process's files may list them apart)
            merged: dict[float, float] = {}
            for le, count in zip(figures["le"], figures["count"], strict=True):
                merged[le] = merged.get(le, 0.0) + count
            bounds = sorted(le for le in merged if le != float("inf"))
            figures["le"], figures["count"] = bounds, [merged[le] for le in bounds]
            figures["total"] = merged.get(float("inf"), 0.0)  # the calls observed, the last bucket's too
        figures_of = getattr(self.queue, "worker_figures", None)
        return {"time": time.time(), "calls": calls, "in_flight": in_flight, "loop_lag_s": lag,
                "latency": latency, "queue": self.queue.stats(),
                "workers": figures_of() if figures_of is not None else {},
                "steps": self.steps.view()[:16]}

    def process_exit(self) -> None:
        if self.multiprocess:
            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]
