// Runs side by side: first, when the runs' items differ, how many each has
// and how many were paired; per metric and category, each run's mean with
// its 95% interval (the figure its run page shows) and each run's difference
// from the first with its interval and p-values (a forest plot), quality
// against latency and tokens per second, and the items where the runs
// disagree, answers side by side.
"use strict";
(() => {
  const { api, h, fmt, showError } = EF;
  const { svg, waiting, fit } = EFReport;
  const root = document.getElementById("content");
  const params = new URLSearchParams(location.search);
  const runsInput = h("input", { id: "runs", placeholder: "run ids, comma-separated", style: "width:420px" });
  runsInput.value = params.get("runs") || "";
  const byInput = h("input", { id: "by", placeholder: "field, field" });
  byInput.value = params.get("by") || "";
  const result = h("div", { id: "result" });
  root.append(
    h("h1", {}, "Compare runs"),
    h("div", { class: "card" }, h("form", { class: "filters", onsubmit: (e) => {
      e.preventDefault();
      const q = new URLSearchParams({ runs: runsInput.value });
      if (byInput.value) q.set("by", byInput.value);
      location.search = q;
    } }, h("label", {}, "Runs (the first is the baseline)", runsInput), h("label", {}, "By category", byInput),
      h("button", { class: "primary", type: "submit" }, "Compare"))),
    result);

  const p = (v) => (v === null || v === undefined ? "–" : v < 1e-4 ? "< 0.0001" : fmt.num(v, 4));
  const colors = ["#141a2a", "#3559e0", "#12805c", "#c2322b", "#b45309", "#7c3aed"];

  /** A forest plot: one row per (label, mean, low, high, color). */
  function forest(rows, { lo, hi, zero }) {
    const width = 560, rowH = 22, left = 190, right = 20, top = 10;
    const height = top + rows.length * rowH + 24;
    const x = (v) => left + ((Math.min(Math.max(v, lo), hi) - lo) / (hi - lo || 1)) * (width - left - right);
    const plot = svg("svg", { width, height, class: "forest", role: "img" });
    if (zero !== undefined) plot.append(svg("line", { x1: x(zero), x2: x(zero), y1: top, y2: height - 20, stroke: "#98a2b3", "stroke-dasharray": "3 3" }));
    rows.forEach((r, i) => {
      const y = top + i * rowH + rowH / 2;
      plot.append(svg("text", { x: 4, y: y + 4 }, r.label));
      if ([r.mean, r.low, r.high].every((v) => typeof v === "number" && !Number.isNaN(v))) {
        plot.append(svg("line", { x1: x(r.low), x2: x(r.high), y1: y, y2: y, stroke: r.color, "stroke-width": 2 }));
        plot.append(svg("line", { x1: x(r.low), x2: x(r.low), y1: y - 4, y2: y + 4, stroke: r.color }));
        plot.append(svg("line", { x1: x(r.high), x2: x(r.high), y1: y - 4, y2: y + 4, stroke: r.color }));
        plot.append(svg("rect", { x: x(r.mean) - 4, y: y - 4, width: 8, height: 8, fill: r.color }));
      }
    });
    for (const t of [lo, (lo + hi) / 2, hi]) plot.append(svg("text", { x: x(t) - 10, y: height - 6 }, fmt.num(t, 2)));
    return plot;
  }

  /** Quality (y) against a measure of speed (x), a point per run. */
  function scatter(points, xLabel) {
    const width = 420, height = 260, pad = 44;
    const xs = points.map((p) => p.x).filter((v) => typeof v === "number");
    const ys = points.map((p) => p.y).filter((v) => typeof v === "number");
    if (!xs.length || !ys.length) return h("div", { class: "note" }, "Not enough data.");
    const [x0, x1] = [Math.min(...xs) * 0.9, Math.max(...xs) * 1.1 || 1];
    const [y0, y1] = [Math.min(0, ...ys), Math.max(1, ...ys)];
    const X = (v) => pad + ((v - x0) / (x1 - x0 || 1)) * (width - 2 * pad);
    const Y = (v) => height - pad - ((v - y0) / (y1 - y0 || 1)) * (height - 2 * pad);
    const plot = svg("svg", { width, height, role: "img" },
      svg("line", { x1: pad, x2: width - pad, y1: height - pad, y2: height - pad, stroke: "#98a2b3" }),
      svg("line", { x1: pad, x2: pad, y1: pad, y2: height - pad, stroke: "#98a2b3" }),
      svg("text", { x: width / 2 - 40, y: height - 8 }, xLabel),
      svg("text", { x: 4, y: pad - 10 }, "score"),
      svg("text", { x: pad - 34, y: Y(y0) }, fmt.num(y0, 2)), svg("text", { x: pad - 34, y: Y(y1) + 8 }, fmt.num(y1, 2)),
      svg("text", { x: X(x0), y: height - pad + 14 }, fmt.num(x0, 1)), svg("text", { x: X(x1) - 24, y: height - pad + 14 }, fmt.num(x1, 1)));
    points.forEach((p, i) => {
      if (typeof p.x !== "number" || typeof p.y !== "number") return;
      plot.append(svg("circle", { cx: X(p.x), cy: Y(p.y), r: 6, fill: colors[i % colors.length] }));
      plot.append(svg("text", { x: X(p.x) + 8, y: Y(p.y) - 6 }, p.label));
    });
    return plot;
  }

  function speed(report) {
    const eps = report.endpoints || [];
    const calls = eps.reduce((a, e) => a + (e.latency_ms ? e.latency_ms.count : 0), 0) || 1;
    const latency = eps.reduce((a, e) => a + (e.latency_ms ? e.latency_ms.p50 * e.latency_ms.count : 0), 0) / calls;
    const tps = eps.reduce((a, e) => a + (e.tokens_per_second_per_call || 0) * (e.latency_ms ? e.latency_ms.count : 0), 0) / calls;
    return { latency, tps };
  }

  async function load() {
    const runs = (params.get("runs") || "").split(",").map((s) => s.trim()).filter(Boolean);
    if (runs.length < 2) {
      result.replaceChildren(h("div", { class: "card note" }, "Give two or more run ids (or pick them on the runs page)."));
      return;
    }
    const progress = h("div", { class: "card", id: "computing" });
    result.replaceChildren(progress);
    const done = waiting(progress, `the comparison of ${runs.join(", ")}`);
    try {
      const q = new URLSearchParams({ runs: runs.join(",") });
      if (params.get("by")) q.set("by", params.get("by"));
      const [body, ...reports] = await Promise.all([api("/compare?" + q), ...runs.map((r) => api(`/runs/${encodeURIComponent(r)}/report`))]);
      done();
      showError(null);
      // Runs of different items are compared on the items both have: said
      // before any figure.
      const coverage = (body.coverage || []).filter((c) => !c.same_dataset || c.paired !== c.items_a || c.paired !== c.items_b)
        .map((c) => h("div", { class: "error-banner", "data-coverage": c.b },
          `${c.same_dataset ? "These runs have different items" : "These runs read different datasets"}: ` +
          `${c.a} has ${fmt.int(c.items_a)} items, ${c.b} has ${fmt.int(c.items_b)}, and ${fmt.int(c.paired)} were paired by item id. ` +
          `The paired figures below (n, the means on shared items, the difference) are on those ${fmt.int(c.paired)} items only.`));
      const byMetric = new Map();
      for (const c of body.comparisons) {
        const key = c.metric;
        if (!byMetric.has(key)) byMetric.set(key, []);
        byMetric.get(key).push(c);
      }
      const sections = [];
      for (const [metric, rows] of byMetric) {
        const means = [];
        const diffs = [];
        const groups = [...new Set(rows.map((c) => c.group))];
        for (const g of groups) {
          const cs = rows.filter((c) => c.group === g);
          means.push({ label: `${g} · ${runs[0]}`.slice(0, 30), mean: cs[0].estimate_a.mean, low: cs[0].estimate_a.ci_low, high: cs[0].estimate_a.ci_high, color: colors[0] });
          cs.forEach((c, i) => {
            means.push({ label: `${g} · ${c.b}`.slice(0, 30), mean: c.estimate_b.mean, low: c.estimate_b.ci_low, high: c.estimate_b.ci_high, color: colors[(i + 1) % colors.length] });
            diffs.push({ label: `${g} · ${c.b}`.slice(0, 30), mean: c.paired.diff, low: c.paired.ci_low, high: c.paired.ci_high, color: colors[(i + 1) % colors.length] });
          });
        }
        const all = means.flatMap((m) => [m.low, m.high]).filter((v) => typeof v === "number" && !Number.isNaN(v));
        const spread = Math.max(0.05, ...diffs.flatMap((d) => [Math.abs(d.low), Math.abs(d.high)]).filter((v) => !Number.isNaN(v)));
        sections.push(h("div", { class: "card", "data-metric": metric },
          h("h2", {}, metric),
          h("div", { class: "row" },
            h("div", { class: "grow" }, h("div", { class: "sub" }, "Means with 95% intervals"),
              forest(means, { lo: Math.min(0, ...all), hi: Math.max(1, ...all) })),
            h("div", { class: "grow" }, h("div", { class: "sub" }, `Difference from ${runs[0]} (paired, 95% interval)`),
              forest(diffs, { lo: -spread, hi: spread, zero: 0 }))),
          fit(h("table", { class: "comparisons" },
            h("thead", {}, h("tr", {}, h("th", {}, "Category"), h("th", {}, "Run"), h("th", { class: "num" }, "n"),
              h("th", { class: "num" }, runs[0]), h("th", { class: "num" }, "This run"), h("th", { class: "num" }, "Difference [95%]"),
              h("th", { class: "num" }, "p (paired)"), h("th", { class: "num" }, "p (McNemar)"), h("th", { class: "num" }, "Only A / only B right"))),
            h("tbody", {}, rows.map((c) => h("tr", {},
              h("td", {}, c.group), h("td", { class: "mono" }, c.b), h("td", { class: "num" }, fmt.int(c.n)),
              h("td", { class: "num" }, fmt.num(c.mean_a, 4)), h("td", { class: "num" }, fmt.num(c.mean_b, 4)),
              h("td", { class: "num" }, `${fmt.num(c.paired.diff, 4)} [${fmt.num(c.paired.ci_low, 3)}, ${fmt.num(c.paired.ci_high, 3)}]`),
              h("td", { class: "num" }, p(c.paired.p_value)),
              h("td", { class: "num" }, p(c.paired.p_mcnemar)),
              h("td", { class: "num" }, c.paired.p_mcnemar === null ? "–" : `${c.paired.a_only} / ${c.paired.b_only}`))))))));
      }
      // Quality against speed, on the first metric overall.
      const first = body.comparisons.find((c) => c.group === "all");
      const quality = reports.map((r, i) => {
        const m = r.metrics.find((s) => first && s.metric === first.metric && s.group === "all");
        const s = speed(r);
        return { label: runs[i], y: m ? m.mean : null, latency: s.latency, tps: s.tps };
      });
      const tradeoff = h("div", { class: "card", id: "tradeoff" }, h("h2", {}, `${first ? first.metric : "score"} against speed`),
        h("div", { class: "row" },
          scatter(quality.map((p) => ({ label: p.label, x: p.latency, y: p.y })), "latency p50 (ms)"),
          scatter(quality.map((p) => ({ label: p.label, x: p.tps, y: p.y })), "tokens/s a call")));
      const disagreements = body.disagreements.map((d) => h("div", { class: "card", "data-disagreements": d.b },
        h("h2", {}, `Where ${d.a} and ${d.b} disagree on ${d.metric}: ${fmt.int(d.total)} of ${fmt.int(d.compared)} items`),
        fit(h("table", { class: "disagreements" },
          h("thead", {}, h("tr", {}, h("th", {}, "Item"), h("th", {}, "Category"), h("th", { class: "num" }, d.a), h("th", { class: "num" }, d.b),
            h("th", {}, `${d.a} answered`), h("th", {}, `${d.b} answered`))),
          h("tbody", {}, d.items.map((x) => h("tr", {},
            h("td", { class: "mono" }, h("a", { href: `/runs/${encodeURIComponent(d.a)}/items/${encodeURIComponent(x.item_id)}` }, x.item_id)),
            h("td", {}, x.group), h("td", { class: "num" }, fmt.num(x.a, 3)), h("td", { class: "num" }, fmt.num(x.b, 3)),
            h("td", { class: "msg" }, x.output_a || ""), h("td", { class: "msg" }, x.output_b || ""))))))));
      // A run not complete is compared over fewer items than it has: said first.
      const outcomes = (body.outcomes || []).filter((o) => o.outcome.outcome !== "complete")
        .map((o) => h("div", { class: "error-banner", "data-outcome-run": o.run_id },
          `Run ${o.run_id} is ${o.outcome.outcome}: ${fmt.int(o.outcome.scored)} of ${fmt.int(o.outcome.items)} items scored (${fmt.int(o.outcome.failed)} failed); its figures are over fewer items than it has.`));
      result.replaceChildren(...outcomes, ...coverage, ...sections, tradeoff, ...disagreements);
    } catch (e) {
      done();
      result.replaceChildren();
      showError(e);
    }
  }
  load();
})();
