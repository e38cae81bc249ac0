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

// The q-quantile of a histogram (cumulative counts by bucket bound, and all it counted): the bound
// it falls under (Infinity: past the last one).
function quantile(h, q) {
  if (!h.total) return null;
  for (let i = 0; i < h.le.length; i++) if (h.counts[i] >= q * h.total) return h.le[i];
  return Infinity;
}

function delta(now, then, key) {
  const a = now.latency[key], b = then ? then.latency[key] : null;
  const same = b && b.count.length === a.count.length;
  return { le: a.le, counts: a.count.map((c, i) => c - (same ? b.count[i] : 0)), total: a.total - (same ? b.total : 0) };
}

function rows(tbody, items) {
  tbody.replaceChildren(...items.map((cells) => {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      td.textContent = cell;
      tr.append(td);
    }
    return tr;
  }));
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
  rows($("statuses").tBodies[0], Object.entries(calls).filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1])
    .map(([status, n]) => [status, n, `${((100 * n) / total).toFixed(1)}%`]));

  rows($("steps").tBodies[0], now.steps.map((s) => [s.step, s.calls,
    Object.entries(s.statuses).map(([k, v]) => `${k} ${v}`).join(", "), s.service_faults,
    s.slowest ? `${seconds(s.slowest.wall_s)} (${s.slowest.status}, id ${s.slowest.id ?? "–"})` : "–"]));

  rows($("workers").tBodies[0], Object.entries(now.workers).map(([name, w]) => {
    const then = before && before.workers[name];
    const cells = then && span > 0 ? ((w.cells - then.cells) / span).toFixed(1) : "–";
    return [name, w.sessions ?? "–", w.session_room ?? "–", cells, w.sessions_lost ?? "–",
      w.sessions_evicted ?? "–", bytes(w.session_memory_bytes)];
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
