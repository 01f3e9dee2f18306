// The runs list: every run in the store, its state, progress and times;
// refreshed every few seconds; pick two or more to compare.
"use strict";
(() => {
  const { api, h, fmt, runBadge, bar, showError } = EF;
  const root = document.getElementById("content");
  const chosen = new Set();
  let server = { runs_evaluations: false, running: [] };

  const q = h("input", { type: "search", placeholder: "name or id", id: "filter-q" });
  const state = h("select", { id: "filter-state" },
    ["", "running", "stopped", "interrupted", "finished"].map((s) => h("option", { value: s }, s || "any state")));
  const compare = h("button", { class: "primary", id: "compare", disabled: true, onclick: () => {
    location.href = "/compare?runs=" + encodeURIComponent([...chosen].join(","));
  } }, "Compare selected");
  const table = h("table", { id: "runs" });
  root.append(
    h("div", { class: "row", style: "justify-content: space-between; align-items: center" },
      h("div", {}, h("h1", {}, "Runs"), h("div", { class: "sub", id: "summary" })),
      h("div", { class: "actions" }, h("a", { class: "button", href: "/new" }, "New run"), compare)),
    h("div", { class: "card" }, h("div", { class: "filters" },
      h("label", {}, "Search", q), h("label", {}, "State", state)), table));

  async function act(path, run) {
    try { await api(`/runs/${encodeURIComponent(run)}/${path}`, { method: "POST", body: {} }); await load(); }
    catch (e) { showError(e); }
  }

  function render(runs) {
    const head = h("thead", {}, h("tr", {},
      h("th", {}, ""), h("th", {}, "Run"), h("th", {}, "State"), h("th", {}, "Progress"),
      h("th", { class: "num" }, "Done"), h("th", { class: "num" }, "Failed"), h("th", { class: "num" }, "Pending"),
      h("th", {}, "Started"), h("th", {}, "Duration"), h("th", {}, "")));
    const body = h("tbody", {});
    for (const run of runs) {
      const here = server.running.includes(run.run_id);
      const check = h("input", { type: "checkbox", "aria-label": "compare " + run.run_id, onchange: (e) => {
        if (e.target.checked) chosen.add(run.run_id); else chosen.delete(run.run_id);
        compare.disabled = chosen.size < 2;
      } });
      check.checked = chosen.has(run.run_id);
      const actions = [];
      if (server.runs_evaluations && here) actions.push(h("button", { class: "danger", onclick: () => act("cancel", run.run_id) }, "Stop"));
      if (server.runs_evaluations && !here && (run.state === "stopped" || run.state === "interrupted"))
        actions.push(h("button", { onclick: () => act("resume", run.run_id) }, "Resume"));
      const end = run.state === "running" ? Date.now() : run.updated_at_ms;
      body.append(h("tr", { "data-run": run.run_id },
        h("td", {}, check),
        h("td", {}, h("a", { href: "/runs/" + encodeURIComponent(run.run_id) }, run.name), h("div", { class: "sub mono" }, run.run_id)),
        h("td", {}, runBadge(run)),
        h("td", {}, bar(run.counts)),
        h("td", { class: "num" }, fmt.int(run.counts.done)),
        h("td", { class: "num" }, fmt.int(run.counts.failed)),
        h("td", { class: "num" }, fmt.int(run.counts.pending)),
        h("td", {}, fmt.time(run.created_at_ms)),
        h("td", {}, fmt.duration(end - run.created_at_ms)),
        h("td", {}, h("div", { class: "actions", style: "margin:0" },
          h("a", { href: `/runs/${encodeURIComponent(run.run_id)}/items` }, "results"), actions))));
    }
    table.replaceChildren(head, body);
    if (!runs.length) table.append(h("caption", { class: "empty" }, "No runs yet. Start one with “New run”, or `evalfleet run CONFIG`."));
    document.getElementById("summary").textContent =
      `${runs.length} run${runs.length === 1 ? "" : "s"}; ${runs.filter((r) => r.state === "running").length} running`;
  }

  async function load() {
    try {
      const query = new URLSearchParams();
      if (q.value) query.set("q", q.value);
      if (state.value) query.set("state", state.value);
      const [runs, info] = await Promise.all([api("/runs?" + query), api("/server")]);
      server = info;
      render(runs);
      showError(null);
    } catch (e) { showError(e); }
  }
  q.addEventListener("input", load);
  state.addEventListener("change", load);
  load();
  setInterval(load, 3000);
})();
