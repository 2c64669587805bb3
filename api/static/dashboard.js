// The dashboard: reads /dashboard/snapshots (one snapshot a second), turns the totals into rates,
// keeps HISTORY_S seconds of them for the charts, and streams a clicked job's tokens.
"use strict";

const HISTORY_S = 300;  // what the charts show
const RATE_S = 10;      // rates are averaged over this many seconds (heartbeats come every few seconds)

const $ = (sel, root = document) => root.querySelector(sel);

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") el.className = v;
    else el.setAttribute(k, v);
  }
  for (const c of children) el.append(c);
  return el;
}

const fmt = {
  int: (v) => (v == null ? "–" : Math.round(v).toLocaleString("en-US")),
  rate: (v) => (v == null ? "–" : v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2)),
  ms: (s) => (s == null ? "–" : s >= 10 ? `${s.toFixed(1)} s` : s >= 1 ? `${s.toFixed(2)} s` : `${(s * 1000).toFixed(0)} ms`),
  pct: (v) => (v == null ? "–" : `${(v * 100).toFixed(v < 0.1 ? 1 : 0)}%`),
  age: (s) => (s == null ? "" : s < 60 ? `${s.toFixed(0)}s` : s < 3600 ? `${(s / 60).toFixed(0)}m` : `${(s / 3600).toFixed(0)}h`),
  time: (t) => new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false }),
  shortId: (id) => id.slice(0, 12),
};

// ---- history and rates -----------------------------------------------------------------------

const samples = [];  // {t, tokens, jobs}, for the rates
const series = { t: [], tokens: [], jobs: [], ttft50: [], ttft99: [], itl50: [], itl99: [] };

function rate(key, now) {
  const last = samples[samples.length - 1];
  const first = samples.find((s) => s.t >= now - RATE_S - 0.5) || samples[0];
  const dt = last.t - first.t;
  if (dt < 0.5) return null;
  return Math.max(0, last[key] - first[key]) / dt;
}

function record(snap) {
  const now = snap.at;
  samples.push({ t: now, tokens: snap.totals.tokens, jobs: snap.totals.jobs_ended });
  while (samples.length && samples[0].t < now - RATE_S - 2) samples.shift();
  const ms = (v) => (v == null ? null : v * 1000);
  const point = {
    t: now, tokens: rate("tokens", now), jobs: rate("jobs", now),
    ttft50: ms(snap.latency.ttft.p50), ttft99: ms(snap.latency.ttft.p99),
    itl50: ms(snap.latency.itl.p50), itl99: ms(snap.latency.itl.p99),
  };
  for (const k of Object.keys(series)) series[k].push(point[k]);
  while (series.t.length && series.t[0] < now - HISTORY_S) for (const k of Object.keys(series)) series[k].shift();
  return point;
}

// ---- charts --------------------------------------------------------------------------------

const clock = (t) => new Date(t * 1000).toLocaleTimeString("en-GB",
  { hour: "2-digit", minute: "2-digit", second: t % 60 ? "2-digit" : undefined });
const compact = (v) => (v >= 1000 ? `${+(v / 1000).toFixed(1)}k` : `${+v.toFixed(3)}`);

const charts = [];

function chart(el, lines) {
  const opts = {
    width: el.clientWidth || 300, height: el.clientHeight || 96,
    legend: { show: false },
    cursor: { show: false },
    scales: {
      x: { time: true, range: (u, min, max) => [Math.min(min ?? max - 60, max - 60), max] },  // at least a minute
      y: { range: (u, min, max) => [0, max > 0 ? max * 1.15 : 1] },
    },
    axes: [
      { stroke: "#8595a8", grid: { stroke: "#1f2935", width: 1 }, ticks: { stroke: "#263140" }, size: 24,
        font: "10px system-ui", values: (u, splits) => splits.map(clock) },
      { stroke: "#8595a8", grid: { stroke: "#1f2935", width: 1 }, ticks: { stroke: "#263140" }, size: 40,
        font: "10px system-ui", values: (u, splits) => splits.map(compact) },
    ],
    series: [{}, ...lines.map(([label, color]) => ({ label, stroke: color, width: 1.5, spanGaps: false,
      fill: lines.length === 1 ? color + "22" : undefined, points: { show: false } }))],
  };
  const u = new uPlot(opts, [[], ...lines.map(() => [])], el);
  new ResizeObserver(() => u.setSize({ width: el.clientWidth, height: el.clientHeight })).observe(el);
  return u;
}

function setupCharts() {
  if (typeof uPlot === "undefined") return;
  charts.push([chart($("#chart-tokens"), [["tokens/s", "#5cb3ff"]]), ["tokens"]]);
  charts.push([chart($("#chart-jobs"), [["jobs/s", "#4cc38a"]]), ["jobs"]]);
  charts.push([chart($("#chart-ttft"), [["p50", "#e8b04b"], ["p99", "#ef6a6a"]]), ["ttft50", "ttft99"]]);
  charts.push([chart($("#chart-itl"), [["p50", "#b48cff"], ["p99", "#ef6a6a"]]), ["itl50", "itl99"]]);
}

function drawCharts() {
  for (const [u, keys] of charts) u.setData([series.t, ...keys.map((k) => series[k])]);
}

// ---- rendering ----------------------------------------------------------------------------

function setField(card, field, text) {
  const el = card.querySelector(`[data-field="${field}"]`);
  if (el && el.textContent !== text) el.textContent = text;
  return el;
}

function poolCard(name) {
  // a model's own pool (`inference:<model>`, several models served) gets a card like the default model's
  let card = document.getElementById(`pool-${name}`);
  const first = document.getElementById("pool-inference");
  if (!card && name.startsWith("inference:") && first) {
    card = first.cloneNode(true);
    card.id = `pool-${name}`;
    card.dataset.pool = name;
    card.querySelector("h2").firstChild.textContent = `${name} `;
    first.parentElement.appendChild(card);
  }
  return card;
}

function renderPools(snap) {
  for (const [name, p] of Object.entries(snap.pools)) {
    const card = poolCard(name);
    if (!card) continue;
    setField(card, "workers", String(p.workers)).classList.toggle("none", p.workers === 0);
    setField(card, "lag", fmt.int(p.lag));
    setField(card, "pending", fmt.int(p.pending));
    const wants = p.load > 0 ? ` · wants ${Math.ceil(p.load / p.lag_per_replica)}` : "";
    setField(card, "load", `${p.load.toFixed(1)}`);
    card.querySelector('[data-field="load"]').title = `lag units; ${p.lag_per_replica} per replica${wants}`;
    if (name === "inference" || name.startsWith("inference:")) {
      setField(card, "running", `${fmt.int(p.running)} / ${fmt.int(p.capacity)}`);
      setField(card, "waiting", fmt.int(p.waiting));
      const kv = p.kv_cache;
      const most = p.per_worker.length > 1 ? ` (max ${fmt.pct(p.kv_cache_max)})` : "";
      setField(card, "kv_cache", kv == null ? "–" : fmt.pct(kv) + most);
      card.querySelector('[data-field="kv-fill"]').style.width = `${Math.min(100, (kv || 0) * 100)}%`;
      setField(card, "celery", `celery workers: ${snap.celery_workers}` +
        (p.per_worker.length ? ` · ${p.per_worker.map((w) => (w.host ? `${w.host}:` : "") + w.pid).join(", ")}` : ""));
    }
  }
}

function renderTiles(snap, point) {
  $("#stat-tokens-rate").textContent = fmt.rate(point.tokens);
  $("#stat-jobs-rate").textContent = fmt.rate(point.jobs);
  const l = snap.latency;
  for (const [id, q] of [["#stat-ttft", l.ttft], ["#stat-itl", l.itl]]) {
    $(id).replaceChildren(q.p50 == null ? "–" : fmt.ms(q.p50), q.p50 == null ? "" : h("small", {}, ` · ${fmt.ms(q.p99)}`));
  }
  $("#stat-ttft").parentElement.title = `last ${l.window_s}s, ${l.ttft.n} first tokens`;
  $("#stat-itl").parentElement.title = `last ${l.window_s}s, ${l.itl.n} observations`;
  $("#stat-jobs-ended").textContent = fmt.int(snap.totals.jobs_ended);
  $("#stat-dead").textContent = fmt.int(snap.totals.dead_letters);
}

const rows = new Map();  // job id -> <tr>, reused so a row being clicked is never replaced

function renderJobs(snap) {
  const tbody = $("#jobs tbody");
  const keep = new Set();
  for (const job of snap.jobs) {
    keep.add(job.id);
    let tr = rows.get(job.id);
    if (!tr) {
      tr = h("tr", { "data-job": job.id, title: job.id },
        h("td", { class: "id" }, fmt.shortId(job.id)), h("td", {}, h("span", { class: "badge" })),
        h("td", { class: "num" }), h("td", { class: "num" }), h("td", { class: "num wide" }));
      rows.set(job.id, tr);
    }
    const [, st, tok, ttft, age] = tr.children;
    const badge = st.firstChild;
    if (badge.textContent !== job.status) { badge.textContent = job.status; badge.className = `badge ${job.status}`; }
    tr.dataset.status = job.status;
    tok.textContent = fmt.int(job.tokens);
    ttft.textContent = fmt.ms(job.ttft);
    const since = job.finished_at || job.created_at;
    age.textContent = since ? fmt.age(Math.max(0, snap.at - since)) : "";
    tr.classList.toggle("selected", live.id === job.id);
    tbody.appendChild(tr);  // moves it into order
  }
  for (const [id, tr] of rows) if (!keep.has(id)) { tr.remove(); rows.delete(id); }
  $("#jobs-empty").hidden = snap.jobs.length > 0;
}

function renderTenants(snap) {
  const rows = snap.tenants || [];
  $("#tenants tbody").replaceChildren(...rows.map((t) => h("tr", {},
    h("td", { class: "id" }, t.tenant === "_" ? "(no key)" : t.tenant === "_other" ? "(others)" : t.tenant),
    h("td", { class: "num" }, fmt.int(t.waiting)),
    h("td", { class: "num" }, t.waiting ? fmt.ms(t.oldest_wait_s) : "–"),
    h("td", { class: "num" }, fmt.pct(t.share)))));
  $("#tenants-empty").hidden = rows.length > 0;
}

function renderDecisions(snap) {
  const ol = $("#decisions");
  ol.replaceChildren(...snap.decisions.map((d) => {
    const dir = d.to > d.from ? "out" : d.to < d.from ? "in" : "";
    const change = d.to === d.from ? `hold ${d.from} (wants ${d.wanted})` : `${d.from} → ${d.to}`;
    return h("li", {},
      h("div", { class: "head" }, h("span", { class: "muted" }, fmt.time(d.at)), h("strong", {}, d.pool),
        h("span", { class: `change ${dir}` }, change)),
      h("div", { class: "reason" }, d.reason));
  }));
  $("#decisions-empty").hidden = snap.decisions.length > 0;
}

// ---- the live view of one job ----------------------------------------------------------------

const live = { id: null, es: null, text: null, chunks: 0 };
let authRequired = false;

// where an ended job's time went, from its record's own times (GET /dashboard/jobs/{id}/timeline)
const STAGE_COLOURS = { "waiting": "#5b6b7a", "tokenizing": "#c9a227", "queued for a worker": "#8a6bd1",
  "waiting for a slot": "#d16b8a", "prefill": "#4c8ac3", "decode": "#4cc38a" };

async function showTimeline(id) {
  const r = await fetch(`/dashboard/jobs/${encodeURIComponent(id)}/timeline`);
  if (!r.ok || live.id !== id) return;
  const t = await r.json();
  const total = t.stages.reduce((a, s) => a + (s.end - s.start), 0) || 1;
  $("#live-stages").replaceChildren(...t.stages.map((s) => h("span", {
    title: `${s.stage}: ${fmt.ms(s.end - s.start)}`,
    style: `flex: ${(s.end - s.start) / total} 0 0; background: ${STAGE_COLOURS[s.stage] || "#888"}` })));
  $("#live-stage-list").replaceChildren(...t.stages.map((s) => h("li", {},
    h("span", {}, h("i", { style: `background: ${STAGE_COLOURS[s.stage] || "#888"}` }), s.stage),
    h("span", { class: "muted" }, fmt.ms(s.end - s.start)))));
  $("#live-trace").textContent = t.trace_id ? `trace ${t.trace_id}` : "not traced";
  $("#live-timeline").hidden = t.stages.length === 0;
}

function openLive(id) {
  closeLive();
  $("#live-timeline").hidden = true;
  live.id = id;
  live.chunks = 0;
  live.text = document.createTextNode("");
  $("#live-text").replaceChildren(live.text);
  $("#live-id").textContent = id;
  setLiveStatus("connecting");
  $("#live-count").textContent = "";
  $("#live").hidden = false;
  for (const tr of rows.values()) tr.classList.toggle("selected", tr.dataset.job === id);
  // with keys required the operator owns no job: the dashboard's own route (internal port only)
  const url = authRequired ? `/dashboard/jobs/${encodeURIComponent(id)}/events`
    : `/v1/jobs/${encodeURIComponent(id)}/events`;
  const es = new EventSource(url);
  live.es = es;
  es.addEventListener("token", (e) => {
    const pre = $("#live-text");
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    live.text.appendData(JSON.parse(e.data).text);
    live.chunks += 1;
    $("#live-count").textContent = `${live.chunks} chunks · ${live.text.length} chars`;
    if (live.chunks === 1 || $("#live-status").textContent === "queued") setLiveStatus("running");
    if (atEnd) pre.scrollTop = pre.scrollHeight;
  });
  es.addEventListener("status", (e) => {
    const job = JSON.parse(e.data);
    setLiveStatus(job.status, job.queue_position ? ` #${job.queue_position}` : "");
  });
  es.addEventListener("done", (e) => {
    const job = JSON.parse(e.data);
    setLiveStatus(job.status, job.finish_reason ? ` (${job.finish_reason})` : "");
    showTimeline(id);
    $("#live-count").textContent = `${job.usage.completion_tokens} tokens · ${live.text.length} chars`;
    es.close();  // or EventSource reconnects and replays
  });
  es.addEventListener("error", (e) => {
    if (e.data) {  // the server's error event
      setLiveStatus("error", `: ${JSON.parse(e.data).error.message}`);
      es.close();
    } else if (es.readyState === EventSource.CLOSED) {
      setLiveStatus("unavailable");
    }
  });
}

function setLiveStatus(status, extra = "") {
  const el = $("#live-status");
  el.textContent = status + extra;
  el.className = `badge ${status}`;
}

function closeLive() {
  if (live.es) live.es.close();
  live.es = null;
  live.id = null;
  $("#live").hidden = true;
  for (const tr of rows.values()) tr.classList.remove("selected");
}

// ---- wiring -------------------------------------------------------------------------------

function onSnapshot(snap) {
  authRequired = snap.auth_required;
  const point = record(snap);
  renderTiles(snap, point);
  renderPools(snap);
  renderJobs(snap);
  renderTenants(snap);
  renderDecisions(snap);
  drawCharts();
  $("#clock").textContent = fmt.time(snap.at);
}

function connect() {
  const conn = $("#conn");
  const es = new EventSource("/dashboard/snapshots");
  es.addEventListener("open", () => { conn.dataset.state = "live"; conn.textContent = "live"; });
  es.addEventListener("snapshot", (e) => {
    conn.dataset.state = "live";
    conn.textContent = "live";
    onSnapshot(JSON.parse(e.data));
  });
  es.addEventListener("error", (e) => {
    conn.dataset.state = "down";
    conn.textContent = e.data ? JSON.parse(e.data).error.message : "reconnecting";
  });
}

$("#jobs tbody").addEventListener("click", (e) => {
  const tr = e.target.closest("tr[data-job]");
  if (tr) openLive(tr.dataset.job);
});
$("#live-close").addEventListener("click", closeLive);
document.addEventListener("keydown", (e) => { if (e.key === "Escape") closeLive(); });
setupCharts();
connect();
