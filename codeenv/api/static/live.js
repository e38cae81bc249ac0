// codeenv's live page: reads /v1/live every 1.5 s; rates and windowed percentiles are differences
// between readings. No dependency, no network beyond this service.
"use strict";

const EVERY_MS = 1500;
const WINDOW_S = 10;
const KEPT = 240; // readings kept (6 minutes)
const FAULTS = ["overloaded", "internal_error", "rejected", "session_lost"];
const FAILURES = ["error", "timeout", "memory", "output_limit", "killed"];
const readings = [];

const $ = (id) => document.getElementById(id);
const sum = (values) => values.reduce((a, b) => a + b, 0);

function seconds(s) {
  if (s === Infinity) return "> 60 s";
  if (s === null || s === undefined || !isFinite(s)) return "–";
  if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms`;
  return `${s.toFixed(s < 10 ? 2 : 1)} s`;
}

function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// The q-quantile of a histogram (cumulative counts by bucket bound, and all it counted), interpolated
// linearly inside the bucket it falls in, as Prometheus's histogram_quantile does (Infinity: past the
// last bound).
function quantile(h, q) {
  if (!h.total) return null;
  const rank = q * h.total;
  for (let i = 0; i < h.le.length; i++) {
    if (h.counts[i] >= rank) {
      const below = i ? h.counts[i - 1] : 0, low = i ? h.le[i - 1] : 0;
      const inside = h.counts[i] - below;
      return inside > 0 ? low + ((h.le[i] - low) * (rank - below)) / inside : h.le[i];
    }
  }
  return Infinity;
}

// The calls a histogram counted between two readings (`b` absent: since start); `le`: the bounds
// every latency histogram shares (a reading's own).
function hdelta(le, a, b) {
  const same = b && b.count.length === a.count.length;
  return { le, counts: a.count.map((c, i) => c - (same ? b.count[i] : 0)), total: a.total - (same ? b.total : 0) };
}

function delta(now, then, key) {
  return hdelta(now.le, now.latency[key], then ? then.latency[key] : null);
}

// A table's rows; a cell is text, or {text, bad} to mark it.
function rows(tbody, items) {
  tbody.replaceChildren(...items.map((cells) => {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      if (cell !== null && typeof cell === "object") {
        td.textContent = cell.text;
        if (cell.bad) td.className = "bad";
      } else {
        td.textContent = cell;
      }
      tr.append(td);
    }
    return tr;
  }));
}

// One row per API (or profile) that ran calls in the window: calls/s, then each latency's p50 and p99.
function breakdown(now, before, span, field) {
  const keys = ["queue", "run", "overhead", "end_to_end"];
  return Object.entries(now[field]).map(([name, histograms]) => {
    const then = before && before[field] ? before[field][name] : null;
    const windowed = keys.map((key) => (histograms[key] ? hdelta(now.le, histograms[key], then ? then[key] : null) : null));
    const count = windowed[1] ? windowed[1].total : 0;
    const cells = [name || "–", span > 0 ? (count / span).toFixed(1) : "–"];
    for (const w of windowed) cells.push(seconds(w && quantile(w, 0.5)), seconds(w && quantile(w, 0.99)));
    return { count, cells };
  }).filter((row) => row.count > 0).map((row) => row.cells);
}

function mix(tbody, counts) {
  const total = sum(Object.values(counts));
  rows(tbody, Object.entries(counts).filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1])
    .map(([name, n]) => [name, n, `${((100 * n) / total).toFixed(1)}%`]));
  return total;
}

function rate(now, before, span, get) {
  return before && span > 0 ? ((get(now) - get(before)) / span).toFixed(1) : "–";
}

function older(now, seconds_) {
  for (let i = readings.length - 1; i >= 0; i--) if (now.time - readings[i].time >= seconds_) return readings[i];
  return readings[0] && readings[0] !== now ? readings[0] : null;
}

function render(now) {
  const before = older(now, WINDOW_S);
  const calls = now.calls;
  const total = sum(Object.values(calls));
  const span = before ? now.time - before.time : 0;
  const done = before ? (total - sum(Object.values(before.calls))) / span : null;
  $("updated").textContent = `updated ${new Date(now.time * 1000).toLocaleTimeString()}`;
  $("rate").textContent = done === null ? "–" : done.toFixed(1);
  $("rate-in").textContent = rate(now, before, span, (r) => r.accepted || 0);
  $("in-flight").textContent = now.in_flight;
  $("waiting").textContent = now.queue.waiting ?? "–";
  $("oldest-wait").textContent = seconds(now.queue.oldest_wait_s);
  $("slots").textContent = `${now.queue.free_slots ?? "–"} / ${now.queue.slots ?? "–"}`;
  $("lag").textContent = seconds(now.loop_lag_s);

  const names = { queue: "queue wait", run: "run time", overhead: "service overhead", end_to_end: "end to end" };
  const windowed = {};
  const latency = Object.keys(names).map((key) => {
    const w = delta(now, before, key), all = delta(now, null, key);
    windowed[key] = w;
    return [names[key], seconds(quantile(w, 0.5)), seconds(quantile(w, 0.99)),
      seconds(quantile(all, 0.5)), seconds(quantile(all, 0.99))];
  });
  rows($("latency").tBodies[0], latency);
  rows($("by-api").tBodies[0], breakdown(now, before, span, "by_api"));
  rows($("by-profile").tBodies[0], breakdown(now, before, span, "by_profile"));
  const waitP99 = quantile(windowed.queue, 0.99);
  const runP99 = quantile(windowed.run, 0.99);
  const verdict = $("verdict");
  const waiting = now.queue.waiting || 0;
  if (waitP99 !== null && runP99 !== null && waitP99 > runP99) {
    verdict.textContent = `Yes: calls wait longer for a slot (p99 ${seconds(waitP99)}) than they run (p99 ${seconds(runP99)}). Add slots or workers.`;
    verdict.className = "verdict bad";
  } else if (waiting > 0 && now.queue.free_slots === 0) {
    verdict.textContent = `Yes: every slot is busy and ${waiting} calls wait (the oldest ${seconds(now.queue.oldest_wait_s)}).`;
    verdict.className = "verdict bad";
  } else {
    verdict.textContent = waitP99 === null ? "No calls ended in the last seconds." : "No: calls get a slot sooner than they run.";
    verdict.className = "verdict";
  }

  const faults = sum(FAULTS.map((s) => calls[s] || 0));
  const failures = sum(FAILURES.map((s) => calls[s] || 0));
  $("calls-total").textContent = total;
  $("service-faults").textContent = faults;
  $("tool-error-ratio").textContent = total - faults > 0 ? (failures / (total - faults)).toFixed(3) : "–";
  mix($("statuses").tBodies[0], calls);
  $("judged-total").textContent = mix($("verdicts").tBodies[0], now.judge.verdicts);
  $("tests-total").textContent = mix($("test-statuses").tBodies[0], now.judge.tests);
  $("tests-rate").textContent = rate(now, before, span, (r) => sum(Object.values(r.judge.tests)));

  rows($("steps").tBodies[0], now.steps.map((s) => [s.step, s.calls,
    Object.entries(s.statuses).map(([k, v]) => `${k} ${v}`).join(", "), s.service_faults,
    s.slowest ? `${seconds(s.slowest.wall_s)} (${s.slowest.status}, id ${s.slowest.id ?? "–"})` : "–"]));

  const workers = Object.entries(now.workers);
  rows($("workers").tBodies[0], workers.map(([name, w]) => {
    const then = before && before.workers[name];
    const per = (key) => (then && span > 0 && w[key] !== undefined ? ((w[key] - (then[key] || 0)) / span).toFixed(1) : "–");
    return [name, w.sessions ?? "–", w.session_room ?? "–", per("sessions_created"), per("cells"),
      w.rollbacks ?? "–", w.sessions_lost ?? "–", w.sessions_evicted ?? "–", bytes(w.session_memory_bytes)];
  }));
  rows($("capacity").tBodies[0], workers.map(([name, w]) => {
    const state = w.up === 0 ? "failed" : w.free_slots < w.slots ? "working" : "idle";
    const headroom = (w.memory_allowance_bytes || 0) - (w.memory_bytes || 0);
    const low = w.memory_allowance_bytes > 0 && headroom < 0.1 * w.memory_allowance_bytes;
    const late = (w.heartbeat_age_s || 0) > 3;
    return [name, { text: state, bad: state === "failed" }, `${w.free_slots ?? "–"} / ${w.slots ?? "–"}`,
      `${bytes(w.memory_bytes)} / ${bytes(w.memory_allowance_bytes)}`, { text: bytes(Math.max(0, headroom)), bad: low },
      bytes(w.memory_needed_bytes), w.oom_kills ?? "–",
      w.seccomp_kills ?? "–", w.slot_restarts ?? "–",
      { text: seconds(w.heartbeat_age_s), bad: late }];
  }));

  spark();
}

function spark() {
  const points = [];
  for (let i = 1; i < readings.length; i++) {
    const a = readings[i - 1], b = readings[i];
    points.push((sum(Object.values(b.calls)) - sum(Object.values(a.calls))) / Math.max(1e-3, b.time - a.time));
  }
  const svg = $("spark");
  const top = Math.max(1, ...points);
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", points.map((p, i) => `${(300 * i) / Math.max(1, points.length - 1)},${58 - (56 * p) / top}`).join(" "));
  const label = document.createElementNS("http://www.w3.org/2000/svg", "text");
  label.setAttribute("x", "2");
  label.setAttribute("y", "10");
  label.setAttribute("font-size", "9");
  label.textContent = `calls/s (peak ${top.toFixed(1)})`;
  svg.replaceChildren(line, label);
}

async function tick() {
  const token = sessionStorage.getItem("codeenv-token");
  try {
    const answer = await fetch("/v1/live", { headers: token ? { Authorization: `Bearer ${token}` } : {} });
    if (answer.status === 401) {
      $("token-form").hidden = false;
      $("updated").textContent = "this service needs its token";
      return;
    }
    const now = await answer.json();
    readings.push(now);
    if (readings.length > KEPT) readings.shift();
    render(now);
  } catch (error) {
    $("updated").textContent = `no answer: ${error}`;
  }
}

$("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("codeenv-token", $("token").value);
  $("token-form").hidden = true;
  tick();
});
tick();
setInterval(tick, EVERY_MS);
