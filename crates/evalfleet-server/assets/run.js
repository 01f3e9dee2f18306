// One run, live: its progress and ETA, items per second, latency, TTFT and
// TPOT percentiles, each endpoint's health, limit and calls in flight over
// time, errors by class, quota pauses, its GPUs', engines' and evalfleet's
// memory and CPU (its resource telemetry) and its event log, from the run's
// server-sent event stream; its report once it stops. A page may stay open
// for hours: its charts are made once and fed new points, its timeline and
// log are windows of bounded size, and the stream is its only clock.
"use strict";
(() => {
  const { api, h, fmt, badge, runBadge, bar, showError, stat, liveChart } = EF;
  /** Points kept for the charts (a point a second: the last 15 minutes). */
  const WINDOW = 900;
  /** Events kept for the log. */
  const LOG = 300;
  const runId = document.body.dataset.run;
  const root = document.getElementById("content");
  let points = [];
  let events = [];
  let run = null;
  let endpoints = null;
  let server = { runs_evaluations: false, running: [] };

  const title = h("h1", {}, runId);
  const sub = h("div", { class: "sub mono" }, runId);
  const state = h("span", { id: "state" });
  const actions = h("div", { class: "actions", id: "actions" });
  const progress = h("div", { id: "progress" });
  const stats = h("div", { class: "stats", id: "stats" });
  const charts = {
    items: h("div", { class: "chart", id: "chart-items" }),
    latency: h("div", { class: "chart", id: "chart-latency" }),
    ttft: h("div", { class: "chart", id: "chart-ttft" }),
    limit: h("div", { class: "chart", id: "chart-limit" }),
  };
  const plots = {
    items: liveChart(charts.items, "Items per second", "per s"),
    latency: liveChart(charts.latency, "Latency (ms)", "ms"),
    limit: liveChart(charts.limit, "Concurrency limit and calls in flight", "calls"),
    ttft: liveChart(charts.ttft, "TTFT and TPOT (ms, streams)", "ms"),
  };
  const resourceCharts = {
    memory: h("div", { class: "chart", id: "chart-memory" }),
    share: h("div", { class: "chart", id: "chart-share" }),
  };
  const resourcePlots = {
    memory: liveChart(resourceCharts.memory, "Memory (MiB): GPUs, engines, evalfleet", "MiB"),
    share: liveChart(resourceCharts.share, "CPU, GPU utilisation and KV cache (%)", "%"),
  };
  const resourcesNote = h("div", { class: "sub", id: "resources-note" });
  const endpointsTable = h("table", { id: "endpoints" });
  const workersCard = h("div", { class: "card", id: "workers", style: "display:none" });
  const errors = h("div", { id: "errors" });
  const log = h("div", { class: "log", id: "log" });
  const report = h("div", { id: "report" });
  root.append(
    h("div", { class: "row", style: "justify-content: space-between; align-items: flex-start" },
      h("div", {}, h("div", { style: "display:flex; gap:10px; align-items:center" }, title, state), sub),
      actions),
    progress, stats,
    h("div", { class: "row" },
      h("div", { class: "card grow" }, charts.items),
      h("div", { class: "card grow" }, charts.latency)),
    h("div", { class: "row" },
      h("div", { class: "card grow" }, charts.limit),
      h("div", { class: "card grow" }, charts.ttft)),
    h("div", { class: "card", id: "resources" }, h("h2", {}, "Resources"),
      h("div", { class: "row" }, h("div", { class: "grow" }, resourceCharts.memory), h("div", { class: "grow" }, resourceCharts.share)),
      resourcesNote),
    h("div", { class: "card" }, h("h2", {}, "Endpoints"), endpointsTable, errors),
    workersCard,
    h("div", { class: "row" },
      h("div", { class: "card grow" }, h("h2", {}, "Events"), log),
      h("div", { class: "card grow" }, h("h2", {}, "Scores"), report)));

  function last(n) { return points.slice(Math.max(0, points.length - n)); }

  /**
   * Items a second: while the run goes, over its last ten seconds; once it
   * has stopped, over its last session, from the session's start to its
   * end (what `evalfleet run` prints), so that a run of a few seconds does
   * not read 0.
   */
  function itemsPerSecond() {
    if (run.state === "running") {
      const recent = last(10).filter((p) => p.items_per_s > 0);
      return recent.length ? recent.reduce((a, p) => a + p.items_per_s, 0) / recent.length : 0;
    }
    const started = events.filter((e) => e.kind === "session_started").pop();
    const ended = events.filter((e) => ["finished", "interrupted"].includes(e.kind) && (!started || e.at_ms >= started.at_ms)).pop();
    if (!started || !ended || ended.at_ms <= started.at_ms) return 0;
    const before = points.filter((p) => p.at_ms <= started.at_ms).pop();
    const endedBefore = before ? before.counts.done + before.counts.failed : 0;
    const endedNow = run.counts.done + run.counts.failed;
    return Math.max(0, endedNow - endedBefore) / ((ended.at_ms - started.at_ms) / 1000);
  }

  function renderHeader() {
    title.textContent = run.name;
    state.replaceChildren(runBadge(run));
    progress.replaceChildren(bar(run.counts, "progress"));
    const rate = itemsPerSecond();
    const inFlight = (endpoints ? endpoints.endpoints : []).reduce((a, e) => a + (e.in_flight || 0), 0);
    const eta = run.state === "running" && rate > 0 ? fmt.duration((1000 * run.counts.pending) / rate) : "–";
    const pauses = points.reduce((a, p) => a + p.endpoints.reduce((b, e) => b + e.quota_pauses, 0), 0);
    stats.replaceChildren(
      stat("done", fmt.int(run.counts.done), "stat-done"),
      stat("failed", fmt.int(run.counts.failed), "stat-failed"),
      stat("pending", fmt.int(run.counts.pending), "stat-pending"),
      stat("items/s", fmt.num(rate, 1), "stat-rate"),
      stat("ETA", eta, "stat-eta"),
      stat("in flight", fmt.int(inFlight), "stat-in-flight"),
      stat("quota pauses", fmt.int(pauses), "stat-pauses"),
      stat("workers", fmt.int(run.workers), "stat-workers"));
    const here = server.running.includes(runId);
    const shape = JSON.stringify([server.runs_evaluations, here, run.state, run.counts.pending > 0, run.counts.failed > 0]);
    if (actions.dataset.shape === shape) return;
    actions.dataset.shape = shape;
    const buttons = [];
    const post = async (path, body = {}) => {
      try { await api(`/runs/${encodeURIComponent(runId)}/${path}`, { method: "POST", body }); showError(null); await loadServer(); connect(); }
      catch (e) { showError(e); }
    };
    if (server.runs_evaluations && here) buttons.push(h("button", { class: "danger", id: "stop", onclick: () => post("cancel") }, "Stop"));
    if (server.runs_evaluations && !here && run.state !== "running") {
      if (run.counts.pending > 0) buttons.push(h("button", { id: "resume", onclick: () => post("resume") }, "Resume"));
      if (run.counts.failed > 0) buttons.push(h("button", { id: "retry", onclick: () => post("resume", { retry_failed: true }) }, "Retry failed"));
      buttons.push(h("button", { id: "rescore", onclick: async () => {
        try { await api(`/runs/${encodeURIComponent(runId)}/rescore`, { method: "POST", body: {} }); loadReport(); }
        catch (e) { showError(e); } } }, "Score again"));
    }
    buttons.push(h("a", { class: "button", href: `/runs/${encodeURIComponent(runId)}/items` }, "Results"));
    actions.replaceChildren(...buttons);
  }

  function series(pick, stats) {
    const names = [...new Set(points.flatMap((p) => p.endpoints.map((e) => e.endpoint)))];
    const xs = points.map((p) => p.at_ms / 1000);
    const out = [];
    const data = [xs];
    for (const name of names) {
      for (const [label, get, dash] of stats) {
        out.push({ label: `${name} ${label}`, dash });
        data.push(points.map((p) => {
          const e = p.endpoints.find((x) => x.endpoint === name);
          const v = e ? get(pick(e)) : null;
          return v === undefined ? null : v;
        }));
      }
    }
    return [out, data];
  }

  function renderCharts() {
    if (!points.length) {
      plots.items.empty("No timeline yet: it fills a point a second while the run goes.");
      return;
    }
    const xs = points.map((p) => p.at_ms / 1000);
    plots.items.update([{ label: "items/s" }, { label: "calls/s", dash: [4, 4] }],
      [xs, points.map((p) => p.items_per_s), points.map((p) => p.endpoints.reduce((a, e) => a + e.calls_per_s, 0))]);
    const q = () => [["p50", (v) => (v ? v.p50 : null)], ["p99", (v) => (v ? v.p99 : null), [4, 4]]];
    plots.latency.update(...series((e) => e.latency_ms, q()));
    plots.limit.update(...series((e) => e, [["limit", (e) => e.limit], ["in flight", (e) => e.in_flight, [4, 4]]]));
    const hasTtft = points.some((p) => p.endpoints.some((e) => e.ttft_ms));
    if (hasTtft) {
      plots.ttft.update(...series((e) => e, [["TTFT p50", (e) => (e.ttft_ms ? e.ttft_ms.p50 : null)], ["TPOT p50", (e) => (e.tpot_ms ? e.tpot_ms.p50 : null), [4, 4]]]));
    } else {
      plots.ttft.update(...series((e) => e, [["tokens/s", (e) => e.tokens_per_s]]), "Completion tokens per second");
    }
  }

  /** Series of `points` whose metric is one of `metrics`, on one time axis. */
  function resourceSeries(points, metrics) {
    const picked = points.filter((p) => metrics.includes(p.series.metric));
    const key = (s) => `${s.source} ${s.name} ${s.metric}`;
    const labels = [...new Set(picked.map((p) => key(p.series)))];
    const xs = [...new Set(picked.map((p) => p.until_ms))].sort((a, b) => a - b);
    const at = new Map(xs.map((x, i) => [x, i]));
    const data = [xs.map((x) => x / 1000), ...labels.map(() => xs.map(() => null))];
    for (const p of picked) data[1 + labels.indexOf(key(p.series))][at.get(p.until_ms)] = p.mean;
    return [labels.map((label) => ({ label: label.replace(/^evalfleet  /, "evalfleet ") })), data];
  }

  let resourcesAt = 0;
  /** The run's resource telemetry: at most every 5 s while it runs, once after. */
  async function loadResources(force) {
    const now = Date.now();
    if (!force && now - resourcesAt < 5000) return;
    resourcesAt = now;
    try {
      const r = await api(`/runs/${encodeURIComponent(runId)}/resources`);
      if (!r.points.length) {
        resourcePlots.memory.empty("No resource telemetry (telemetry: is off, or nothing was sampled yet).");
        resourcePlots.share.empty("");
        resourcesNote.textContent = "";
        return;
      }
      resourcePlots.memory.update(...resourceSeries(r.points, ["gpu_memory_mb", "rss_mb"]));
      resourcePlots.share.update(...resourceSeries(r.points, ["cpu_pct", "gpu_utilization_pct", "kv_cache_pct"]));
      resourcesNote.textContent = r.summary.series
        .filter((s) => ["gpu_memory_mb", "rss_mb"].includes(s.series.metric))
        .map((s) => `${s.series.source} ${s.series.name} ${s.series.metric}: peak ${fmt.num(s.peak, 0)}, mean ${fmt.num(s.mean, 0)}`)
        .join("; ");
    } catch (e) {
      resourcesNote.textContent = e.message;
    }
  }

  function renderEndpoints() {
    const list = endpoints ? endpoints.endpoints : [];
    const classes = [...new Set(list.flatMap((e) => Object.keys(e.errors || {})))].sort();
    endpointsTable.replaceChildren(
      h("thead", {}, h("tr", {}, h("th", {}, "Endpoint"), h("th", {}, "State"), h("th", { class: "num" }, "Limit"),
        h("th", { class: "num" }, "In flight"), h("th", { class: "num" }, "Calls/min"), h("th", { class: "num" }, "Learned rate/s"),
        h("th", { class: "num" }, "Restarts"), ...classes.map((c) => h("th", { class: "num" }, c)))),
      h("tbody", {}, list.map((e) => h("tr", { "data-endpoint": e.endpoint },
        h("td", {}, e.endpoint, h("div", { class: "sub" }, e.kind)),
        h("td", {}, badge(e.state)),
        h("td", { class: "num" }, fmt.int(e.limit), e.adaptive ? h("span", { class: "sub" }, " adaptive") : ""),
        h("td", { class: "num" }, fmt.int(e.in_flight)),
        h("td", { class: "num" }, fmt.int(e.requests_per_minute)),
        h("td", { class: "num" }, e.learned_rate ? fmt.num(e.learned_rate, 1) : "–"),
        h("td", { class: "num" }, fmt.int(e.restarts)),
        ...classes.map((c) => h("td", { class: "num" }, fmt.int((e.errors || {})[c] || 0)))))));
    errors.textContent = endpoints
      ? `As ${endpoints.live ? "seen live" : "last seen"} at ${fmt.clock(endpoints.updated_at_ms)}.` : "No endpoint has reported yet.";
    errors.className = "sub";
  }

  /** Which worker did what: shown once more than one worker committed results. */
  function renderWorkers() {
    const work = run.work_by_worker || [];
    workersCard.style.display = work.length > 1 ? "" : "none";
    if (work.length <= 1) return;
    const live = new Set((run.live_workers || []).map((w) => w.worker));
    workersCard.replaceChildren(h("h2", {}, "Workers"), h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "Worker"), h("th", { class: "num" }, "Done"),
        h("th", { class: "num" }, "Failed"), h("th", {}, "Now"))),
      h("tbody", {}, work.map((w) => h("tr", { "data-worker": w.worker },
        h("td", {}, w.worker), h("td", { class: "num" }, fmt.int(w.done)),
        h("td", { class: "num" }, fmt.int(w.failed)),
        h("td", {}, live.has(w.worker) ? "working" : (run.state === "running" ? "gone" : "–")))))));
  }

  function renderLog() {
    const newest = events.length ? `${events.length}:${events[events.length - 1].at_ms}` : "";
    if (log.dataset.newest === newest) return;
    log.dataset.newest = newest;
    const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.replaceChildren(...events.map((e) =>
      h("div", { class: ["unhealthy", "ejected", "died", "excluded", "start_failed", "interrupted", "resource_limit"].includes(e.kind) ? "warn" : "" },
        fmt.clock(e.at_ms), "  ", e.message)));
    if (atBottom) log.scrollTop = log.scrollHeight;
  }

  async function loadReport() {
    // A first report of a large run takes a while: say so while it computes.
    const done = EFReport.waiting(report, "the scores");
    try {
      const r = await api(`/runs/${encodeURIComponent(runId)}/report`);
      EFReport.render(report, r);
    } catch (e) {
      report.replaceChildren(h("div", { class: "note" }, e.message));
    } finally {
      done();
    }
  }

  let source = null;
  function connect() {
    if (source) source.close();
    source = new EventSource(`/api/v1/runs/${encodeURIComponent(runId)}/stream`);
    source.addEventListener("snapshot", (m) => {
      const s = JSON.parse(m.data);
      run = s.run; endpoints = s.run.endpoints; events = s.run.events.slice(-LOG); points = s.timeline.slice(-WINDOW);
      loadServer().then(renderAll);
    });
    source.addEventListener("update", (m) => {
      const u = JSON.parse(m.data);
      run = { ...run, ...u.run, work_by_worker: u.work_by_worker }; endpoints = u.endpoints; events = events.concat(u.events).slice(-LOG);
      points = points.concat(u.points).slice(-WINDOW);
      renderAll();
      if (u.run.state !== "running") { source.close(); loadReport(); }
    });
    source.addEventListener("error", (m) => {
      if (!m.data) return;
      try { showError(new Error(JSON.parse(m.data).error.message)); } catch (_) { showError(new Error(m.data)); }
    });
  }

  /** What this server runs: asked on each connection and after an action, not every second. */
  async function loadServer() {
    try { server = await api("/server"); } catch (_) { /* the page still shows the run */ }
  }

  function renderAll() {
    renderHeader(); renderCharts(); renderEndpoints(); renderWorkers(); renderLog();
    loadResources(run.state !== "running" && !report.dataset.loaded);
    if (run.state !== "running" && !report.dataset.loaded) { report.dataset.loaded = "1"; loadReport(); }
  }
  connect();
})();
