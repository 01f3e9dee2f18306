// evalfleet's dashboard: what every page shares. No framework, no build
// step: each page has a script of its own that uses these helpers.
"use strict";

const EF = (() => {
  /** The API's answer to `path` (under /api/v1), or an Error with its message. */
  async function api(path, options = {}) {
    const init = { headers: { accept: "application/json" }, ...options };
    if (init.body !== undefined && typeof init.body !== "string") {
      init.body = JSON.stringify(init.body);
      init.headers["content-type"] = "application/json";
    }
    const response = await fetch("/api/v1" + path, init);
    const text = await response.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (_) { body = text; }
    if (!response.ok) {
      const message = body && body.error ? body.error.message : response.statusText;
      const error = new Error(message);
      error.status = response.status;
      error.problems = body && body.error ? body.error.problems || [] : [];
      throw error;
    }
    return body;
  }

  /** An element: h("td", {class: "num"}, "3", child, ...). */
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else if (key === "text") el.textContent = value;
      else el.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  const nf = new Intl.NumberFormat();
  const fmt = {
    int: (v) => (v === null || v === undefined ? "–" : nf.format(Math.round(v))),
    num: (v, digits = 2) =>
      v === null || v === undefined || Number.isNaN(v) ? "–" : Number(v).toFixed(digits),
    ms: (v) => (v === null || v === undefined ? "–" : v >= 10000 ? (v / 1000).toFixed(1) + " s" : Math.round(v) + " ms"),
    pct: (v) => (v === null || v === undefined || Number.isNaN(v) ? "–" : (100 * v).toFixed(1) + "%"),
    time: (ms) => (ms ? new Date(ms).toLocaleString() : "–"),
    clock: (ms) => (ms ? new Date(ms).toLocaleTimeString() : "–"),
    duration: (ms) => {
      if (ms === null || ms === undefined || ms < 0) return "–";
      const s = Math.round(ms / 1000);
      if (s < 60) return s + " s";
      const m = Math.floor(s / 60);
      if (m < 60) return m + " min " + (s % 60) + " s";
      return Math.floor(m / 60) + " h " + (m % 60) + " min";
    },
  };

  function badge(text) {
    return h("span", { class: "badge " + String(text).replace(/[^a-z_]/gi, "") }, text);
  }

  /** A bar of done (green) and failed (red) out of total. */
  function bar(counts, cls = "") {
    const total = counts.pending + counts.done + counts.failed || 1;
    return h("div", { class: "bar " + cls, title: `${counts.done} done, ${counts.failed} failed, ${counts.pending} pending` },
      h("div", { class: "done", style: `width:${(100 * counts.done) / total}%` }),
      h("div", { class: "failed", style: `width:${(100 * counts.failed) / total}%` }));
  }

  /** Shows an error at the top of the page (none: clears it). */
  function showError(error) {
    let banner = document.getElementById("error");
    if (!banner) {
      banner = h("div", { id: "error", class: "error-banner", role: "alert" });
      document.querySelector("main").prepend(banner);
    }
    if (!error) { banner.remove(); return; }
    const problems = (error.problems || []).map((p) => `\n  ${p.line ? "line " + p.line + ": " : ""}${p.message}`).join("");
    banner.textContent = (error.message || String(error)) + problems;
  }

  /** A stat box. */
  function stat(key, value, id) {
    return h("div", { class: "stat" }, h("div", { class: "v", id }, value), h("div", { class: "k" }, key));
  }

  /**
   * A chart in `container` that lives as long as the page: made once, fed
   * new data with uPlot's setData, and made again only when its series
   * change (an endpoint added), with one ResizeObserver for its whole life,
   * so that nothing grows with the time a page stays open.
   */
  function liveChart(container, title, yLabel) {
    const palette = ["#3559e0", "#12805c", "#c2322b", "#b45309", "#7c3aed", "#0e7490", "#be185d", "#4d7c0f"];
    let plot = null;
    let shape = null;
    const width = () => Math.max(300, container.clientWidth - 4);
    new ResizeObserver(() => { if (plot) plot.setSize({ width: width(), height: 220 }); }).observe(container);
    return {
      update(series, data, heading = title) {
        const key = JSON.stringify([heading, series.map((s) => s.label)]);
        if (plot && key === shape) { plot.setData(data); return; }
        if (plot) plot.destroy();
        container.replaceChildren();
        shape = key;
        plot = new uPlot({
          title: heading, width: width(), height: 220,
          // A short run's axis spans its seconds: at least ten of them.
          scales: { x: { time: true, range: (u, min, max) => (max - min < 10 ? [max - 10, max] : [min, max]) } },
          axes: [{}, { label: yLabel, size: 60 }],
          series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: s.color || palette[i % palette.length], width: 1.5, dash: s.dash, spanGaps: true }))],
          legend: { live: true },
        }, data, container);
      },
      /** Shows `text` instead of a chart. */
      empty(text) {
        if (plot) { plot.destroy(); plot = null; shape = null; }
        container.replaceChildren(h("div", { class: "empty" }, text));
      },
    };
  }

  /**
   * A run's state as a badge that does not hide failures: a finished run
   * with failed items says how many, and one whose every item failed says
   * it failed.
   */
  function runBadge(run) {
    const { done, failed } = run.counts;
    if (run.state === "finished" && failed > 0) {
      if (done === 0) return h("span", { class: "badge failed", title: `all ${failed} items failed` }, "failed");
      return h("span", { class: "badge partial", title: `${fmt.int(failed)} of ${fmt.int(done + failed)} items failed` },
        `finished, ${fmt.int(failed)} failed`);
    }
    return badge(run.state);
  }

  /** Query parameters of the page as an object. */
  function params() {
    return Object.fromEntries(new URLSearchParams(location.search));
  }

  return { api, h, fmt, badge, runBadge, bar, showError, stat, liveChart, params };
})();
