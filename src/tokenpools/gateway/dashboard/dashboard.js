// The tokenpools dashboard: polls /admin/history with the admin key kept in sessionStorage
// (this tab only) and draws it. No build step: plain browser JavaScript and uPlot.
"use strict";

const KEY = "tokenpools-admin-key";
const POLL_MS = 2000;
const USAGE_EVERY_MS = 15000;  // /admin/usage flushes the ledger to SQL: not every poll
// [title, kind, digits]; admitted and refused are this replica's, the rest the pool's
const COLUMNS = [
  ["entitlement", "text"], ["pool", "text"], ["class", "text"], ["state", "text"],
  ["baseline", "num", 0], ["in flight", "num", 0], ["priority", "num", 1], ["debt", "num", 3],
  ["burst", "num", 2], ["admitted/s", "num", 2], ["refused/s", "num", 2], ["refused", "num", 0],
  ["refused by reason (/s)", "text"], ["TTFT p50", "num", 2], ["TTFT p99", "num", 2],
];
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];

const state = { sortBy: 0, descending: false, timer: null, charts: {}, usageAt: 0 };
window.tokenpools = state;  // for the end-to-end test and curious operators

const $ = (id) => document.getElementById(id);
const fmt = (x, digits = 2) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
const sum = (values) => Object.values(values || {}).reduce((a, b) => a + (b || 0), 0);

async function poll() {
  const key = sessionStorage.getItem(KEY);
  if (!key) return showLogin("");
  let response;
  try {
    response = await fetch("/admin/history", { headers: { Authorization: `Bearer ${key}` } });
  } catch (err) {
    $("status").textContent = `gateway unreachable: ${err}`;
    $("status").className = "down";
    return;
  }
  if (response.status === 401) {
    sessionStorage.removeItem(KEY);
    return showLogin("That admin key was refused.");
  }
  if (!response.ok) {
    $("status").textContent = `gateway answered ${response.status}`;
    $("status").className = "down";
    return;
  }
  render(await response.json());
  await pollBudgets(key);
}

async function admin(path, key) {
  const response = await fetch(path, { headers: { Authorization: `Bearer ${key}` } });
  return response.ok ? response.json() : null;
}

async function pollBudgets(key) {
  try {
    const budgets = await admin("/admin/budgets", key);
    if (budgets) renderBudgets(budgets.budgets);
    if (Date.now() - state.usageAt >= USAGE_EVERY_MS) {
      state.usageAt = Date.now();
      const from = Math.floor(Date.now() / 1000) - 24 * 3600;
      const usage = await admin(`/admin/usage?per=hour&by=tenant&from=${from}`, key);
      if (usage) renderUsage(usage.rows);
    }
  } catch (err) {
    $("status").textContent = `budgets unreadable: ${err}`;
  }
}

function renderBudgets(budgets) {
  document.querySelector("#budgets tbody").replaceChildren(...budgets.map((b) => {
    const tr = document.createElement("tr");
    tr.dataset.budget = b.name;
    const pct = (x) => `${Math.min(100, (100 * x) / Math.max(b.limit, 1)).toFixed(1)}%`;
    const bar = document.createElement("span");
    bar.className = b.exhausted ? "bar spent" : "bar";
    for (const [part, value] of [["used", b.used], ["held", b.held]]) {
      const span = document.createElement("span");
      span.className = part;
      span.style.width = pct(value);
      bar.append(span);
    }
    const usedCell = document.createElement("td");
    usedCell.className = "text";
    usedCell.dataset.column = "used";
    usedCell.append(bar, `${pct(b.used)} (${pct(b.held)})`);
    const cells = [
      [b.name, "text"], [`${b.scope} ${b.target}`, "text"],
      [`${b.window}, ${b.measure}`, "text"], null, [fmt(b.left, 0), "num"],
      [b.resets_at === null ? "never" : new Date(b.resets_at * 1000).toLocaleString(), "text"],
    ];
    for (const cell of cells) {
      if (cell === null) {
        tr.append(usedCell);
        continue;
      }
      const td = document.createElement("td");
      td.className = cell[1] === "text" ? "text" : "";
      td.textContent = cell[0];
      tr.append(td);
    }
    return tr;
  }));
}

function renderUsage(rows) {
  // every hour of the last 24, so the axis is the day even when few hours have usage
  const last = Math.floor(Date.now() / 3600000) * 3600;
  const hours = Array.from({ length: 25 }, (_, i) => last - (24 - i) * 3600);
  const tenants = [...new Set(rows.map((r) => r.tenant))].sort();
  const samples = hours.map((at) => ({ at, entitlements: Object.fromEntries(
    rows.filter((r) => r.start === at).map((r) => [r.tenant, r])) }));
  chart("usage", hours, tenants, samples, (r) => r.weighted_tokens);
}

function showLogin(message) {
  clearInterval(state.timer);
  state.timer = null;
  $("board").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message;
  for (const chart of Object.values(state.charts)) chart.destroy();
  state.charts = {};
  $("pools").replaceChildren();
  document.querySelector("#entitlements tbody").replaceChildren();
  document.querySelector("#refusals tbody").replaceChildren();
  document.querySelector("#budgets tbody").replaceChildren();
  state.usageAt = 0;
}

function start() {
  $("login").hidden = true;
  $("board").hidden = false;
  poll();
  state.timer = setInterval(poll, POLL_MS);
}

function render(history) {
  const latest = history.samples[history.samples.length - 1];
  const store = history.store.up ? "up" : "DOWN";
  $("status").textContent = `replica ${history.replica} · store ${history.store.backend} ${store}`
    + ` · ${history.samples.length} samples every ${history.update_period_s} s · pool figures are`
    + " the shared store's, admitted and refused this replica's";
  $("status").className = history.store.up ? "" : "down";
  if (!latest) return;
  renderPools(latest, history.backends);
  renderEntitlements(latest);
  renderRefusals(history.refusals);
  const times = history.samples.map((s) => s.at);
  const names = Object.keys(latest.entitlements);
  chart("priority", times, names, history.samples, (e) => e.priority);
  chart("debt", times, names, history.samples, (e) => e.debt);
  chart("refused", times, names, history.samples, (e) => sum(e.refused_per_s));
  for (const pool of Object.keys(latest.pools)) {
    for (const [dimension, id] of [["concurrency", "pool"], ["kv_tokens", "kv"]]) {
      chart(`${id}-${pool}`, times, ["in flight", "held back", "capacity"], history.samples,
        null, (s, series) => {
          const p = s.pools[pool];
          if (!p) return null;
          return [p.reserved[dimension], p.held_back[dimension], p.capacity[dimension]][series];
        });
    }
    chart(`tps-${pool}`, times, ["used", "capacity"], history.samples, null, (s, series) => {
      const p = s.pools[pool];
      if (!p) return null;
      return [p.tokens_per_s_used, p.capacity.tokens_per_s][series];
    });
  }
}

function renderPools(latest, backends) {
  const holder = $("pools");
  for (const [name, p] of Object.entries(latest.pools)) {
    let card = document.getElementById(`pool-card-${name}`);
    if (!card) {
      card = document.createElement("div");
      card.className = "pool";
      card.id = `pool-card-${name}`;
      card.innerHTML = `<h3></h3><dl></dl><h4>sequences</h4><div id="chart-pool-${name}"></div>`
        + `<h4>KV tokens</h4><div id="chart-kv-${name}"></div>`
        + `<h4>tokens/s (settled in the last period)</h4><div id="chart-tps-${name}"></div>`;
      holder.append(card);
    }
    card.querySelector("h3").textContent = `${name}`;
    const healthy = (backends[name] || []).filter((b) => b.healthy).length;
    const rows = [
      ["replicas", `${p.replicas} (desired ${p.desired_replicas})`],
      ["utilisation", p.utilization === null ? "–" : `${(100 * p.utilization).toFixed(0)} %`],
      ["slots", `${fmt(p.reserved.concurrency, 0)} of ${fmt(p.capacity.concurrency, 0)} in flight`
        + `, ${fmt(p.held_back.concurrency, 0)} held back`],
      ["KV tokens", `${fmt(p.reserved.kv_tokens, 0)} of ${fmt(p.capacity.kv_tokens, 0)}`],
      ["tokens/s", `${fmt(p.capacity.tokens_per_s, 0)} capacity, bucket `
        + `${p.bucket_tokens === null ? "unlimited" : fmt(p.bucket_tokens, 0)}`],
      ["backends", `${healthy} of ${(backends[name] || []).length} healthy`],
    ];
    card.querySelector("dl").replaceChildren(...rows.flatMap(([k, v]) => {
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = k;
      dd.textContent = v;
      return [dt, dd];
    }));
  }
}

function rowOf(name, e) {
  const reasons = Object.entries(e.refused_per_s)
    .filter(([, rate]) => rate)
    .map(([reason, rate]) => `${reason} ${fmt(rate, 1)}`)
    .join(", ");
  return [name, e.pool, e.class, e.state, e.baseline_concurrency, e.in_flight, e.priority, e.debt,
    e.burst, e.admitted_per_s, sum(e.refused_per_s), e.refused_total, reasons, e.ttft_p50_s,
    e.ttft_p99_s];
}

function renderEntitlements(latest) {
  const head = document.querySelector("#entitlements thead tr");
  if (!head.children.length) {
    COLUMNS.forEach(([title, kind], i) => {
      const th = document.createElement("th");
      th.textContent = title;
      th.className = kind === "text" ? "text" : "";
      th.addEventListener("click", () => {
        state.descending = state.sortBy === i ? !state.descending : kind === "num";
        state.sortBy = i;
        renderEntitlements(state.latest);
      });
      head.append(th);
    });
  }
  state.latest = latest;
  const rows = Object.entries(latest.entitlements).map(([name, e]) => rowOf(name, e));
  const i = state.sortBy;
  rows.sort((a, b) => {
    const x = a[i] ?? -Infinity;
    const y = b[i] ?? -Infinity;
    const order = x < y ? -1 : x > y ? 1 : 0;
    return state.descending ? -order : order;
  });
  document.querySelector("#entitlements tbody").replaceChildren(...rows.map((row) => {
    const tr = document.createElement("tr");
    tr.dataset.entitlement = row[0];
    row.forEach((value, c) => {
      const td = document.createElement("td");
      const kind = COLUMNS[c][1];
      td.className = kind === "text" ? "text" : "";
      td.dataset.column = COLUMNS[c][0];
      td.textContent = kind === "text" ? value : fmt(value, COLUMNS[c][2]);
      tr.append(td);
    });
    return tr;
  }));
}

function renderRefusals(refusals) {
  const rows = refusals.slice(-20).reverse().map((r) => {
    const tr = document.createElement("tr");
    const at = new Date(r.at * 1000).toLocaleTimeString();
    const retry = r.retry_after_s === null ? "–" : `${fmt(r.retry_after_s, 1)} s`;
    for (const value of [at, r.entitlement, r.reason, retry, r.message]) {
      const td = document.createElement("td");
      td.className = "text";
      td.textContent = value;
      tr.append(td);
    }
    return tr;
  });
  document.querySelector("#refusals tbody").replaceChildren(...rows);
}

// One time series chart; `pick` reads an entitlement's value, or `point` a sample's series.
function chart(id, times, names, samples, pick, point) {
  const data = [times];
  names.forEach((name, n) => data.push(samples.map((s) => {
    if (point) return point(s, n);
    const e = s.entitlements[name];
    return e ? pick(e) : null;
  })));
  const existing = state.charts[id];
  if (existing && existing.series.length === names.length + 1) {
    existing.setData(data);
    return;
  }
  if (existing) existing.destroy();
  const series = [{}].concat(names.map((name, n) => ({
    label: name, stroke: PALETTE[n % PALETTE.length], width: 1.5, spanGaps: true,
  })));
  const axes = [{}, { size: 70 }];  // room for labels such as 65,536
  state.charts[id] = new uPlot({ width: 460, height: 220, series, axes }, data, $(`chart-${id}`));
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY, key);
  $("key").value = "";
  start();
});
$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  showLogin("");
});
if (sessionStorage.getItem(KEY)) start();
