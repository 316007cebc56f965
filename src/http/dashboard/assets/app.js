// meshgate dashboard: one EventSource, tables sortable by column, a namespace
// filter, a search for namespaces outside the top N, the busiest deployments'
// routes, and canvas charts of the history. No libraries, nothing fetched from anywhere but this node.
"use strict";

const HISTORY_MAX = 600;
const state = {
  snap: null,
  history: [], // {at_ms, http_rps, handled_ps, publishes_ps, invocations_ps, ns: {name: [h, p, i]}}
  filter: "",
  search: "",
  sort: {
    "ns-table": { key: "namespace", dir: 1, type: "str" },
    "actor-table": { key: "id", dir: 1, type: "num" },
  },
};

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

function fmtRate(v) {
  if (v === null || v === undefined) return "–";
  if (v === 0) return "0";
  if (v < 10) return v.toFixed(2);
  if (v < 1000) return v.toFixed(1);
  return (v / 1000).toFixed(1) + "k";
}
function fmtInt(v) {
  return v === null || v === undefined ? "–" : Number(v).toLocaleString("en-US");
}
function fmtSecs(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1e3).toFixed(2) + " ms";
  return s.toFixed(2) + " s";
}
function fmtBytes(b) {
  if (!b) return "–";
  const u = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return b.toFixed(i ? 1 : 0) + " " + u[i];
}
function fmtUptime(s) {
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  return `${m}m ${s % 60}s`;
}

function pointOf(s) {
  const ns = {};
  for (const n of s.namespaces) ns[n.namespace] = [n.handled_per_sec, n.publishes_per_sec, n.invocations_per_sec];
  return {
    at_ms: s.at_ms, http_rps: s.node.http_requests_per_sec, handled_ps: s.node.handled_per_sec,
    publishes_ps: s.node.publishes_per_sec, invocations_ps: s.node.invocations_per_sec, ns,
  };
}

function sorted(rows, tableId) {
  const { key, dir, type } = state.sort[tableId];
  const val = (r) => (key === "breakers" ? r.breakers.map((b) => b.state).join(",") : r[key]);
  return rows.slice().sort((a, b) => {
    const x = val(a), y = val(b);
    if (type === "str") return dir * String(x).localeCompare(String(y));
    return dir * ((x ?? -1) - (y ?? -1));
  });
}

function renderNode(n) {
  $("n-uptime").textContent = fmtUptime(n.uptime_seconds);
  $("n-http").textContent = fmtRate(n.http_requests_per_sec);
  $("n-conn").textContent = fmtInt(n.ws_connections);
  $("n-subs").textContent = fmtInt(n.ws_subscribers);
  $("n-wasm").textContent = `${n.wasm_pool_busy} / ${n.wasm_pool_workers} (${n.wasm_pool_queued})`;
  $("n-rss").textContent = fmtBytes(n.memory_rss_bytes);
  $("n-actors").textContent = fmtInt(n.actors);
  $("n-ns").textContent = fmtInt(n.namespaces_running);
  $("n-known").textContent = fmtInt(n.namespaces_known);
  $("n-handled").textContent = fmtInt(n.messages_handled);
}

function renderFilter(namespaces) {
  const sel = $("ns-filter");
  const have = new Set([...sel.options].map((o) => o.value));
  const want = namespaces.map((n) => n.namespace);
  if (want.length + 1 === have.size && want.every((n) => have.has(n))) return;
  sel.innerHTML = '<option value="">all</option>' +
    want.map((n) => `<option value="${esc(n)}">${esc(n)}</option>`).join("");
  sel.value = want.includes(state.filter) ? state.filter : "";
  state.filter = sel.value;
}

function nsRow(r) {
    const breakers = r.breakers.length
      ? r.breakers.map((b) => `<span class="b-${b.state}" title="${esc(b.member)}">${esc(b.member)}: ${b.state}</span>`).join(" ")
      : '<span class="muted">none</span>';
    return `<tr data-ns="${esc(r.namespace)}">
      <td class="str" data-col="namespace">${esc(r.namespace)}${r.running ? "" : ' <span class="muted">(idle)</span>'}</td>
      <td data-col="actors">${r.actors}</td>
      <td data-col="mailbox_depth" class="${r.mailbox_depth > 0 ? "hot" : ""}">${r.mailbox_depth}</td>
      <td data-col="handled">${fmtInt(r.handled)}</td>
      <td data-col="handled_per_sec">${fmtRate(r.handled_per_sec)}</td>
      <td data-col="subscribers">${fmtInt(r.subscribers)}</td>
      <td data-col="topics">${fmtInt(r.topics)}</td>
      <td data-col="publishes_per_sec" title="${fmtInt(r.publishes)} published since the node started">${fmtRate(r.publishes_per_sec)}</td>
      <td data-col="invocations_per_sec">${fmtRate(r.invocations_per_sec)}</td>
      <td data-col="errors" class="${r.errors > 0 ? "hot" : ""}">${fmtInt(r.errors)}</td>
      <td data-col="restarts" class="${r.restarts > 0 ? "hot" : ""}">${r.restarts}</td>
      <td data-col="breakers" class="str">${breakers}</td></tr>`;
}

function renderNamespaces(rows, s) {
  const shown = rows.filter((r) => !state.filter || r.namespace === state.filter);
  const of = Math.max(s.namespaces_ranked || 0, s.node.namespaces_known || 0, rows.length);
  $("ns-count").textContent = `${shown.length} shown · top ${s.top_namespaces} of ${fmtInt(of)}`;
  $("ns-table").tBodies[0].innerHTML = sorted(shown, "ns-table").map(nsRow).join("");
}

// The search asks the node (the page holds only the top N): debounced, and
// re-run each tick while a query is typed so its numbers stay live.
let searchTimer = null;
let searchSeq = 0;
async function runSearch() {
  const q = state.search.trim();
  const body = $("search-table").tBodies[0];
  if (!q) { body.innerHTML = ""; $("search-count").textContent = ""; return; }
  const seq = ++searchSeq;
  try {
    const r = await fetch(`/__admin/api/namespaces/search?q=${encodeURIComponent(q)}`, { credentials: "same-origin" });
    const res = await r.json();
    if (seq !== searchSeq) return;
    if (!r.ok) { $("search-count").textContent = res.error ? res.error.message : `error ${r.status}`; body.innerHTML = ""; return; }
    $("search-count").textContent = `${res.namespaces.length} of ${res.matched} matching`;
    body.innerHTML = res.namespaces.map(nsRow).join("");
  } catch (e) {
    console.warn("search failed", e);
  }
}

function renderActors(rows) {
  const shown = rows.filter((r) => !state.filter || r.namespace === state.filter);
  $("actor-count").textContent = `${shown.length} of ${rows.length}`;
  $("actor-table").tBodies[0].innerHTML = sorted(shown, "actor-table").map((r) => `<tr data-actor="${r.id}">
      <td>${r.id}</td><td class="str">${esc(r.kind)}</td>
      <td class="str">${r.namespace ? esc(r.namespace) : '<span class="muted">node</span>'}</td>
      <td class="${r.mailbox_depth > 0 ? "hot" : ""}">${r.mailbox_depth}</td>
      <td>${fmtInt(r.handled)}</td><td>${fmtRate(r.handled_per_sec)}</td>
      <td>${fmtSecs(r.p50_seconds)}</td><td>${fmtSecs(r.p99_seconds)}</td>
      <td class="${r.restarts > 0 ? "hot" : ""}">${r.restarts}</td></tr>`).join("");
}

function fmtShare(v) {
  if (v === null || v === undefined) return "–";
  return (v * 100).toFixed(v > 0 && v < 0.1 ? 1 : 0) + " %";
}

// A deployment's certificate: the node's pair, an uploaded one or ACME's,
// with the leaf's end of validity; for ACME its order's state, the last
// error (in the tooltip too) and the next attempt after a failure.
const DAY_MS = 86_400_000;
function fmtTls(t, nowMs) {
  if (!t) return '<span class="muted">–</span>';
  if (t.mode === "node_pair") return '<span class="muted" title="no certificate of its own: the node\'s pair">node pair</span>';
  let until = "";
  if (t.not_after) {
    const left = Date.parse(t.not_after) - nowMs;
    const cls = t.expired ? "bad" : left < 14 * DAY_MS ? "hot" : "";
    until = ` <span class="${cls}" data-part="not_after" title="valid until ${esc(t.not_after)}">${t.expired ? "expired " : "until "}${esc(t.not_after.slice(0, 10))}</span>`;
  }
  if (t.mode === "uploaded") return `<span data-part="mode">uploaded</span>${until}`;
  const a = t.acme || { state: "pending" };
  const cls = a.state === "failed" ? "bad" : a.state === "pending" ? "muted" : "";
  let out = `<span data-part="mode">acme</span> <span class="${cls}" data-part="acme_state">${esc(a.state)}</span>${until}`;
  if (a.last_error) out += `<br><span class="muted err-line" data-part="last_error" title="${esc(a.last_error)}">${esc(a.last_error)}</span>`;
  if (a.next_attempt) out += `<br><span class="muted" data-part="next_attempt">next try ${esc(a.next_attempt.replace("T", " ").replace("Z", " UTC"))}</span>`;
  return out;
}

// One row per route of the most requested deployments (the node sends at
// most top_deployments, each with its busiest routes).
function renderDeployments(s) {
  const deps = (s.deployments || []).filter((d) => !state.filter || d.namespace === state.filter);
  const of = s.deployments_ranked || 0;
  $("dep-count").textContent = `${deps.length} shown · top ${s.top_deployments || 0} of ${fmtInt(of)}`;
  const rows = [];
  for (const d of deps) {
    const health = d.instances
      ? `<span class="${d.instances_healthy < d.instances ? "hot" : ""}">${d.instances_healthy} / ${d.instances}</span>`
      : '<span class="muted">static</span>';
    const more = d.routes_ranked > d.routes.length ? ` <span class="muted">(+${d.routes_ranked - d.routes.length} routes)</span>` : "";
    d.routes.forEach((r, i) => {
      const first = i === 0;
      rows.push(`<tr data-dep="${esc(d.namespace)}/${esc(d.deployment)}" data-route="${esc(r.route)}">
      <td class="str">${first ? esc(d.namespace) : ""}</td>
      <td class="str">${first ? esc(d.deployment) + more : ""}</td>
      <td class="str" data-col="route">${esc(r.route)}</td>
      <td data-col="requests_per_sec" title="${fmtInt(r.requests)} since the node started">${fmtRate(r.requests_per_sec)}</td>
      <td data-col="p50_seconds">${fmtSecs(r.p50_seconds)}</td>
      <td data-col="p99_seconds">${fmtSecs(r.p99_seconds)}</td>
      <td data-col="error_share" class="${r.error_share > 0 ? "hot" : ""}">${fmtShare(r.error_share)}</td>
      <td data-col="instances">${first ? health : ""}</td>
      <td class="str" data-col="tls" data-mode="${first && d.tls ? esc(d.tls.mode) : ""}">${first ? fmtTls(d.tls, s.at_ms || Date.now()) : ""}</td></tr>`);
    });
  }
  $("dep-table").tBodies[0].innerHTML = rows.length
    ? rows.join("")
    : '<tr><td class="str muted" colspan="9">no routed requests yet</td></tr>';
}

function drawChart(canvas, values, color) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const max = Math.max(1, ...values);
  const pad = 16;
  g.strokeStyle = "#2d3640"; g.lineWidth = 1;
  g.beginPath(); g.moveTo(0, h - pad + 0.5); g.lineTo(w, h - pad + 0.5); g.stroke();
  g.fillStyle = "#8a919a"; g.font = "11px system-ui, sans-serif";
  g.fillText(fmtRate(max), 2, 11);
  const last = values.length ? values[values.length - 1] : 0;
  g.fillText("now " + fmtRate(last), w - 70, 11);
  g.fillText(`${Math.round(values.length / 60 * 10) / 10} min`, 2, h - 3);
  if (values.length < 2) return;
  // At least two minutes across, so a young history is not squeezed into a sliver.
  const step = w / (Math.max(120, values.length) - 1);
  const x0 = w - (values.length - 1) * step;
  g.strokeStyle = color; g.lineWidth = 1.5; g.beginPath();
  values.forEach((v, i) => {
    const x = x0 + i * step, y = h - pad - (v / max) * (h - pad - 14);
    if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
  });
  g.stroke();
}

function renderCharts() {
  const f = state.filter;
  const pick = (nodeKey, idx) => state.history.map((p) => (f ? (p.ns[f] ? p.ns[f][idx] : 0) : p[nodeKey]));
  for (const el of document.querySelectorAll(".scope")) el.textContent = f ? `· ${f}` : "· node";
  drawChart($("c-handled"), pick("handled_ps", 0), "#39bae6");
  drawChart($("c-pub"), pick("publishes_ps", 1), "#7fd962");
  drawChart($("c-inv"), pick("invocations_ps", 2), "#ffb454");
  drawChart($("c-http"), state.history.map((p) => p.http_rps), "#d2a6ff");
}

function render() {
  const s = state.snap;
  if (!s) return;
  $("tick").textContent = s.tick;
  renderNode(s.node);
  renderFilter(s.namespaces);
  renderNamespaces(s.namespaces, s);
  renderDeployments(s);
  renderActors(s.actors);
  renderCharts();
}

function setupSorting() {
  for (const table of document.querySelectorAll("table.sortable")) {
    for (const th of table.tHead.rows[0].cells) {
      th.addEventListener("click", () => {
        const cur = state.sort[table.id];
        const key = th.dataset.key;
        state.sort[table.id] = { key, type: th.dataset.type || "num", dir: cur.key === key ? -cur.dir : (th.dataset.type === "str" ? 1 : -1) };
        for (const o of table.tHead.rows[0].cells) o.classList.remove("asc", "desc");
        th.classList.add(state.sort[table.id].dir > 0 ? "asc" : "desc");
        render();
      });
    }
  }
}

function connect() {
  const es = new EventSource("/__admin/api/stream");
  es.addEventListener("open", () => { $("conn").textContent = "live"; $("conn").className = "pill on"; });
  es.addEventListener("error", () => { $("conn").textContent = "reconnecting…"; $("conn").className = "pill off"; });
  es.addEventListener("snapshot", (ev) => {
    const s = JSON.parse(ev.data);
    if (!s.tick) return; // the sampler has not ticked yet
    if (state.snap && s.tick <= state.snap.tick) return;
    state.snap = s;
    const last = state.history[state.history.length - 1];
    if (!last || last.at_ms < s.at_ms) state.history.push(pointOf(s));
    if (state.history.length > HISTORY_MAX) state.history.splice(0, state.history.length - HISTORY_MAX);
    render();
    if (state.search.trim()) runSearch();
  });
}

async function start() {
  setupSorting();
  $("ns-filter").addEventListener("change", (e) => { state.filter = e.target.value; render(); });
  $("ns-search").addEventListener("input", (e) => {
    state.search = e.target.value;
    clearTimeout(searchTimer);
    searchTimer = setTimeout(runSearch, 250);
  });
  window.addEventListener("resize", renderCharts);
  try {
    const r = await fetch("/__admin/api/history", { credentials: "same-origin" });
    if (r.status === 401 || r.status === 403) { location.href = "/__admin/login"; return; }
    const h = await r.json();
    state.history = h.points;
  } catch (e) {
    console.warn("history unavailable", e);
  }
  connect();
}

document.addEventListener("DOMContentLoaded", start);
