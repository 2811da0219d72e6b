// Tandem console: polls /console/api/state once a second; admin actions go to /admin with the
// token kept in sessionStorage. No framework, no build step, nothing fetched from outside.
"use strict";

const POLL_MS = 1000;
const HISTORY = 120; // samples a chart keeps
const PARTS = ["queue_s", "route_s", "prefill_s", "transfer_s", "first_decode_s", "decode_s"];
const COLORS = { queue_s: "#9aa3b5", route_s: "#c7a7e0", prefill_s: "#3b7dd8", transfer_s: "#e0a030",
  first_decode_s: "#7cc4a4", decode_s: "#2f8f5b" };
const history = { ttft50: [], ttft90: [], tpot50: [], tpot90: [], tps: [], running: [], waiting: [] };
const $ = (id) => document.getElementById(id);

function token() { return sessionStorage.getItem("tandem-admin-token") || ""; }

function setMode() {
  const admin = token() !== "";
  $("mode").textContent = admin ? "admin" : "read-only";
  $("mode").className = admin ? "badge admin" : "badge";
  document.querySelectorAll("button.admin").forEach((b) => { b.disabled = !admin; });
}

function say(text, error) {
  $("message").textContent = text;
  $("message").className = error ? "error" : "";
}

async function admin(path, body) {
  const headers = { "Content-Type": "application/json" };
  if (token()) headers.Authorization = "Bearer " + token();
  const r = await fetch(path, { method: "POST", headers, body: JSON.stringify(body || {}) });
  const data = await r.json().catch(() => ({}));
  if (!r.ok) {
    say(`${path}: ${r.status} ${(data.error && data.error.message) || r.statusText}`, true);
    return null;
  }
  say(`${path}: done`, false);
  return data;
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function renderPools(pools) {
  $("desired").textContent = "desired: " + Object.entries(pools.desired)
    .map(([r, n]) => `${r} ${n}`).join(", ") + " · up: " + Object.entries(pools.up)
    .map(([r, n]) => `${r} ${n}`).join(", ");
  const body = $("workers").querySelector("tbody");
  body.replaceChildren();
  for (const w of pools.workers) {
    const tr = document.createElement("tr");
    tr.dataset.worker = w.worker_id;
    tr.dataset.role = w.role;
    tr.dataset.state = w.state;
    tr.append(cell(w.worker_id), cell(w.role), cell(w.node || ""), cell(w.device || ""), cell(w.state),
      cell(w.running ?? "", "num"), cell(w.waiting ?? "", "num"),
      cell(w.kv_usage == null ? "" : (100 * w.kv_usage).toFixed(0) + "%", "num"),
      cell(w.num_preemptions ?? "", "num"));
    const td = document.createElement("td");
    const drain = document.createElement("button");
    drain.textContent = "Drain";
    drain.className = "admin drain";
    drain.disabled = !token() || w.state !== "up";
    drain.addEventListener("click", () => admin(`/admin/workers/${encodeURIComponent(w.worker_id)}/drain`));
    td.append(drain);
    const other = { prefill: "decode", decode: "prefill" }[w.role];
    if (other) {  // a role flip in place: the worker drains, then serves the other pool
      const flip = document.createElement("button");
      flip.textContent = "→ " + other;
      flip.className = "admin flip";
      flip.disabled = !token() || w.state !== "up";
      flip.addEventListener("click", () => admin(`/admin/workers/${encodeURIComponent(w.worker_id)}/role`,
        { role: other }));
      td.append(flip);
    }
    tr.append(td);
    body.append(tr);
  }
}

function push(series, value) {
  series.push(value);
  if (series.length > HISTORY) series.shift();
}

function draw(id, lines) {
  const c = $(id);
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const values = lines.flatMap((l) => l.data.filter((v) => v != null));
  c.dataset.points = String(Math.max(0, ...lines.map((l) => l.data.filter((v) => v != null).length)));
  if (!values.length) return;
  const top = Math.max(...values) * 1.15 || 1;
  g.fillStyle = "#5b6475";
  g.font = "10px sans-serif";
  g.fillText(top.toPrecision(3), 2, 10);
  for (const l of lines) {
    g.strokeStyle = l.color;
    g.beginPath();
    let started = false;
    l.data.forEach((v, i) => {
      if (v == null) return;
      const x = (i / (HISTORY - 1)) * c.width;
      const y = c.height - (v / top) * (c.height - 12);
      if (started) g.lineTo(x, y); else g.moveTo(x, y);
      started = true;
    });
    g.stroke();
  }
}

function renderLoad(load) {
  push(history.ttft50, load.ttft_p50_s);
  push(history.ttft90, load.ttft_p90_s);
  push(history.tpot50, load.tpot_p50_s == null ? null : 1000 * load.tpot_p50_s);
  push(history.tpot90, load.tpot_p90_s == null ? null : 1000 * load.tpot_p90_s);
  push(history.tps, load.tokens_per_s);
  push(history.running, load.running);
  push(history.waiting, load.waiting);
  $("load-now").textContent = `${load.requests} requests in the last ${load.span_s} s, ` +
    `${load.tokens_per_s.toFixed(1)} tokens/s, ${load.running} running (at most ${load.max_running}), ` +
    `${load.waiting} waiting`;
  draw("chart-ttft", [{ data: history.ttft50, color: "#3b7dd8" }, { data: history.ttft90, color: "#b3261e" }]);
  draw("chart-tpot", [{ data: history.tpot50, color: "#3b7dd8" }, { data: history.tpot90, color: "#b3261e" }]);
  draw("chart-tps", [{ data: history.tps, color: "#2f8f5b" }]);
  draw("chart-queue", [{ data: history.running, color: "#3b7dd8" }, { data: history.waiting, color: "#e0a030" }]);
}

function renderWaterfall(requests) {
  const box = $("waterfall");
  box.replaceChildren();
  const longest = Math.max(1e-6, ...requests.map((r) => PARTS.reduce((s, p) => s + r.parts[p], 0)));
  for (const r of requests.slice().reverse()) {
    const row = document.createElement("div");
    row.className = "row";
    row.dataset.request = r.request_id;
    const id = document.createElement("span");
    id.textContent = `${r.request_id.slice(0, 12)} · ${r.status}`;
    const bar = document.createElement("div");
    bar.className = "bar";
    for (const p of PARTS) {
      const seg = document.createElement("i");
      seg.style.width = (100 * r.parts[p]) / longest + "%";
      seg.style.background = COLORS[p];
      seg.title = `${p.replace("_s", "")}: ${(1000 * r.parts[p]).toFixed(1)} ms`;
      bar.append(seg);
    }
    const who = document.createElement("span");
    who.textContent = r.prefill_worker === r.decode_worker ? (r.decode_worker || "")
      : `${r.prefill_worker || "?"} → ${r.decode_worker || "?"}`;
    row.append(id, bar, who);
    box.append(row);
  }
}

function renderEvents(events) {
  const list = $("events");
  list.replaceChildren();
  for (const e of events.slice().reverse()) {
    const li = document.createElement("li");
    const when = new Date(1000 * Number(e.ts)).toLocaleTimeString();
    const rest = Object.entries(e).filter(([k]) => !["id", "kind", "ts"].includes(k))
      .map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`).join(" ");
    li.textContent = `${when} ${e.kind} ${rest}`;
    li.dataset.kind = e.kind;
    list.append(li);
  }
}

async function poll() {
  try {
    const r = await fetch("/console/api/state");
    if (!r.ok) throw new Error(`${r.status} ${r.statusText}`);
    const s = await r.json();
    $("banner").hidden = true;
    renderPools(s.pools);
    renderLoad(s.load);
    renderWaterfall(s.requests);
    renderEvents(s.events);
  } catch (e) {
    $("banner").textContent = `cannot reach the router: ${e.message}`;
    $("banner").hidden = false;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function init() {
  $("auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("tandem-admin-token", $("token").value.trim());
    $("token").value = "";
    setMode();
  });
  $("forget-token").addEventListener("click", () => { sessionStorage.removeItem("tandem-admin-token"); setMode(); });
  $("scale").addEventListener("click", () =>
    admin(`/admin/pools/${$("scale-role").value}`, { replicas: Number($("scale-n").value) }));
  $("rebalance").addEventListener("click", () =>
    admin("/admin/rebalance", { prefill: Number($("rb-p").value), decode: Number($("rb-d").value) }));
  document.querySelector(".legend").append(...PARTS.map((p) => {
    const s = document.createElement("span");
    const i = document.createElement("i");
    i.style.background = COLORS[p];
    s.append(i, p.replace("_s", "").replace("_", " "));
    return s;
  }));
  setMode();
  poll();
}

init();
