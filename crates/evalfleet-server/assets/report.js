// A run's report (the core's typed report, as the API gives it): each
// metric overall and by category with its 95% interval drawn, what could be
// used, pass@k, the code judge's verdicts and each endpoint's latency and
// tokens. The dashboard's run page and `evalfleet report --html` both draw
// it with this.
"use strict";
const EFReport = (() => {
  const { h, fmt } = EF;
  const SVG = "http://www.w3.org/2000/svg";

  function svg(tag, attrs, ...children) {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
    for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return el;
  }

  /** A mean and its interval on [lo, hi], as a small inline chart. */
  function interval(mean, low, high, lo = 0, hi = 1, width = 180) {
    const x = (v) => 4 + ((Math.min(Math.max(v, lo), hi) - lo) / (hi - lo || 1)) * (width - 8);
    const ok = [mean, low, high].every((v) => typeof v === "number" && !Number.isNaN(v));
    const box = svg("svg", { width, height: 16, role: "img", "aria-label": ok ? `${fmt.num(mean, 3)} [${fmt.num(low, 3)}, ${fmt.num(high, 3)}]` : "no estimate" },
      svg("line", { x1: 4, x2: width - 4, y1: 8, y2: 8, stroke: "#e4e7ec" }));
    if (ok) {
      box.append(svg("line", { x1: x(low), x2: x(high), y1: 8, y2: 8, stroke: "#3559e0", "stroke-width": 3, "stroke-linecap": "round" }));
      box.append(svg("circle", { cx: x(mean), cy: 8, r: 4, fill: "#141a2a" }));
    }
    return box;
  }

  /** A table that fits its card: it scrolls within it when wider. */
  function fit(table) {
    return h("div", { class: "table-fit", style: "max-width:100%;overflow-x:auto" }, table);
  }

  /**
   * Shows, in `container`, that `what` is being computed and for how long,
   * until the returned function is called. A first report of a large run
   * reads the whole run (seconds); later ones are kept.
   */
  function waiting(container, what) {
    const started = Date.now();
    const bar = h("div", { class: "bar", style: "width:240px;margin-top:8px" },
      h("span", { class: "waiting-fill", style: "width:30%;background:#3559e0" }));
    const line = h("div", { class: "note" }, `Computing ${what}…`);
    container.replaceChildren(h("div", { class: "waiting", role: "status", "aria-live": "polite" }, line, bar));
    const fill = bar.firstChild;
    const tick = () => {
      const s = (Date.now() - started) / 1000;
      line.textContent = `Computing ${what}… ${s.toFixed(0)} s (a first report reads the whole run; it is kept once the run has stopped).`;
      // An indeterminate bar: it moves while the server works.
      fill.style.marginLeft = `${(s * 25) % 70}%`;
    };
    const timer = setInterval(tick, 250);
    return () => clearInterval(timer);
  }

  /** Whether a metric's summary has a value to show (some item answered, and scored or counted at the worst value). */
  function valued(s) {
    return s.status !== "no answers" && s.status !== "not scored";
  }

  /** Why a metric has no value: no item was answered, or none could be scored. */
  function noValue(s) {
    return s.status === "no answers" ? `no score: 0 of ${fmt.int(s.n)} answered` : "not scored";
  }

  /** The run's outcome (complete, incomplete, failed) first, with its causes when it is not complete. */
  function outcome(report) {
    const o = report.outcome;
    if (!o) return null;
    const parts = [["failed", o.failed], ["unusable", o.unusable], ["not scored", o.not_scored], ["pending", o.pending]]
      .filter(([, n]) => n > 0).map(([what, n]) => `${fmt.int(n)} ${what}`);
    const head = o.outcome === "failed"
      ? `Failed: 0 of ${fmt.int(o.items)} items answered`
      : `${o.outcome === "complete" ? "Complete" : "Incomplete"}: ${fmt.int(o.scored)} of ${fmt.int(o.items)} items scored`;
    const line = parts.length ? `${head} (${parts.join(", ")})` : head;
    if (o.outcome === "complete") return h("div", { class: "note outcome", "data-outcome": o.outcome }, line);
    return h("div", { class: "error-banner outcome", "data-outcome": o.outcome }, h("strong", {}, line),
      h("ul", {}, [...o.causes.map((c) => h("li", {}, `${fmt.int(c.count)} × ${c.cause.replace("_", " ")}: ${c.reason}`,
        c.example ? h("span", { class: "sub" }, ` (e.g. item ${c.example})`) : "")),
      ...(o.other_causes ? [h("li", {}, `${fmt.int(o.other_causes)} × other causes`)] : [])]));
  }

  function metrics(report) {
    if (!report.metrics.length) return h("div", { class: "note" }, "The task has no metrics (task.metrics).");
    const range = (s) => (s.higher_is_better === false || s.mean > 1 || s.ci_high > 1 ? [Math.min(0, s.ci_low), Math.max(1, s.ci_high)] : [0, 1]);
    return fit(h("table", { class: "metrics" },
      h("thead", {}, h("tr", {}, h("th", {}, "Metric"), h("th", {}, "Category"), h("th", { class: "num" }, "n"),
        h("th", { class: "num" }, "Mean"), h("th", {}, "95% interval"), h("th", {}, ""), h("th", {}, "Scored"))),
      h("tbody", {}, report.metrics.map((s) => {
        const [lo, hi] = range(s);
        return h("tr", { "data-metric": s.metric, "data-group": s.group },
          h("td", { class: "mono" }, s.metric), h("td", {}, s.group), h("td", { class: "num" }, fmt.int(s.n)),
          h("td", { class: "num" }, valued(s) ? fmt.num(s.mean, 4) : noValue(s)),
          h("td", { class: "num mono" }, valued(s) ? `[${fmt.num(s.ci_low, 3)}, ${fmt.num(s.ci_high, 3)}]` : "–"),
          h("td", {}, valued(s) ? interval(s.mean, s.ci_low, s.ci_high, lo, hi) : ""),
          h("td", {}, s.status, s.errors ? h("div", { class: "sub" }, `${s.errors} not scored`) : ""));
      }))));
  }

  function endpoints(report) {
    if (!report.endpoints || !report.endpoints.length) return null;
    const p = (x) => (x ? `${fmt.ms(x.p50)} / ${fmt.ms(x.p90)} / ${fmt.ms(x.p99)}` : "–");
    return fit(h("table", { class: "endpoints" },
      h("thead", {}, h("tr", {}, h("th", {}, "Endpoint"), h("th", { class: "num" }, "Calls"), h("th", { class: "num" }, "Answered"),
        h("th", {}, "Latency p50/p90/p99"), h("th", {}, "TTFT"), h("th", {}, "TPOT"), h("th", { class: "num" }, "Tokens/s a call"))),
      h("tbody", {}, report.endpoints.map((e) => h("tr", {},
        h("td", {}, e.endpoint), h("td", { class: "num" }, fmt.int(e.attempts)), h("td", { class: "num" }, fmt.int(e.successes)),
        h("td", {}, p(e.latency_ms)), h("td", {}, p(e.ttft_ms)), h("td", {}, p(e.tpot_ms)),
        h("td", { class: "num" }, fmt.num(e.tokens_per_second_per_call, 1)))))));
  }

  function resources(report) {
    const r = report.resources;
    if (!r || !r.series || !r.series.length) return null;
    return fit(h("table", { class: "resources" },
      h("thead", {}, h("tr", {}, h("th", {}, "Source"), h("th", {}, "Series"), h("th", { class: "num" }, "Peak"), h("th", { class: "num" }, "Mean"), h("th", { class: "num" }, "Samples"))),
      h("tbody", {}, r.series.map((s) => h("tr", {},
        h("td", {}, `${s.series.source} ${s.series.name}`), h("td", { class: "mono" }, s.series.metric),
        h("td", { class: "num" }, fmt.num(s.peak, 1)), h("td", { class: "num" }, fmt.num(s.mean, 1)),
        h("td", { class: "num" }, fmt.int(s.samples)))))));
  }

  /** An exec task's agents: calls, tokens, call time and attempts per item, each with its interval. */
  function agents(report) {
    const a = report.agents;
    if (!a) return null;
    const row = (what, e, digits) => h("tr", {}, h("td", {}, what), h("td", { class: "num" }, fmt.num(e.mean, digits)),
      h("td", { class: "num mono" }, `[${fmt.num(e.ci_low, digits)}, ${fmt.num(e.ci_high, digits)}]`));
    return h("div", { style: "margin-top:12px" }, h("h2", {}, "Agents"),
      h("div", { class: "sub" }, `${fmt.int(a.calls)} calls for ${fmt.int(a.items)} items; ${fmt.int(a.failed_calls)} failed, ${fmt.int(a.cached_calls)} from the cache; ` +
        Object.entries(a.apis || {}).map(([k, v]) => `${k} ${fmt.int(v)}`).join(", ")),
      fit(h("table", { class: "agents" },
        h("thead", {}, h("tr", {}, h("th", {}, "Per item"), h("th", { class: "num" }, "Mean"), h("th", {}, "95% interval"))),
        h("tbody", {}, row("calls", a.calls_per_item, 2), row("tokens", a.tokens_per_item, 0),
          row("call time (ms)", a.call_ms_per_item, 0), row("attempts", a.attempts_per_item, 2)))));
  }

  function fidelity(report) {
    const f = report.fidelity;
    const prompts = Object.entries(report.prompts || {});
    return h("div", { class: "sub" },
      `${fmt.int(report.items)} items; answers usable at once ${fmt.int(f.valid_first_try)}, after re-asks ${fmt.int(f.valid_after_reasks)}, ` +
      `unparsed ${fmt.int(f.unparsed)}, invalid ${fmt.int(f.invalid)}, not checked ${fmt.int(f.not_checked)}, failed ${fmt.int(f.failed)}.` +
      (prompts.length ? ` Prompts: ${prompts.map(([k, v]) => `${k} ${fmt.int(v)}`).join(", ")}.` : ""));
  }

  /** Overall and each category in one row: every metric's mean and interval, and how its answers turned out. */
  function groups(report) {
    if (!report.group_by || !report.group_by.length || !report.groups || !report.groups.length) return null;
    const keys = report.groups[0].metrics.map((m) => m.metric);
    const share = (e) => (e ? `${fmt.num(e.mean, 3)} [${fmt.num(e.ci_low, 3)}, ${fmt.num(e.ci_high, 3)}]` : "–");
    return h("div", { style: "margin-top:12px" }, h("h2", {}, `By ${report.group_by.join(" / ")}`),
      fit(h("table", { class: "groups" },
        h("thead", {}, h("tr", {}, h("th", {}, report.group_by.join(" / ")), h("th", { class: "num" }, "Items"),
          ...keys.map((k) => h("th", { class: "mono" }, k)),
          h("th", {}, "Valid at first"), h("th", {}, "Valid in the end"), h("th", { class: "num" }, "After re-asks"),
          h("th", { class: "num" }, "Invalid"), h("th", { class: "num" }, "Failed"))),
        h("tbody", {}, report.groups.map((g) => h("tr", { "data-group": g.group },
          h("td", {}, g.group), h("td", { class: "num" }, fmt.int(g.items)),
          ...g.metrics.map((m) => h("td", { class: "num mono" }, valued(m) ? `${fmt.num(m.mean, 4)} [${fmt.num(m.ci_low, 3)}, ${fmt.num(m.ci_high, 3)}]` : noValue(m))),
          h("td", { class: "mono" }, share(g.valid_first)), h("td", { class: "mono" }, share(g.valid_final)),
          h("td", { class: "num" }, fmt.int(g.fidelity.valid_after_reasks)),
          h("td", { class: "num" }, fmt.int(g.fidelity.unparsed + g.fidelity.invalid)),
          h("td", { class: "num" }, fmt.int(g.fidelity.failed))))))));
  }

  function samples(report) {
    const s = report.samples;
    if (!s) return null;
    const ks = [...new Set(s.metrics.flatMap((m) => Object.keys(m.pass_at || {})))].sort((a, b) => a - b);
    return h("div", { style: "margin-top:12px" }, h("h2", {}, `pass@k and majority vote (${s.n} samples of each of ${fmt.int(s.rows)} rows)`),
      fit(h("table", {}, h("thead", {}, h("tr", {}, h("th", {}, "Metric"), ...ks.map((k) => h("th", { class: "num" }, `pass@${k}`)), h("th", { class: "num" }, "Majority"))),
        h("tbody", {}, s.metrics.map((m) => h("tr", {}, h("td", { class: "mono" }, m.metric),
          ...ks.map((k) => h("td", { class: "num" }, m.pass_at && k in m.pass_at ? fmt.num(m.pass_at[k], 4) : "–")),
          h("td", { class: "num" }, fmt.num(m.majority, 4))))))));
  }

  function verdicts(report) {
    const all = report.code_verdicts && report.code_verdicts.all;
    if (!all) return null;
    return h("div", {}, h("h2", {}, "Code verdicts"),
      h("div", {}, Object.entries(all).map(([k, v]) => h("span", { class: "legend" }, EF.badge(k), fmt.int(v)))));
  }

  /** Draws `report` into `container`. */
  function render(container, report) {
    const table = endpoints(report);
    const used = resources(report);
    container.replaceChildren(...[
      outcome(report),
      fidelity(report),
      ...(report.problems || []).map((p) => h("div", { class: "error-banner" }, p)),
      metrics(report),
      groups(report),
      samples(report),
      verdicts(report),
      agents(report),
      table ? h("div", { style: "margin-top:12px" }, h("h2", {}, "Endpoints"), table) : null,
      used ? h("div", { style: "margin-top:12px" }, h("h2", {}, "Resources (peak and mean)"), used) : null,
    ].filter(Boolean));
  }

  return { render, interval, svg, waiting, fit, valued, noValue };
})();
