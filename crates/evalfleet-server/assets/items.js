// A run's results: a table of its items, filtered and sorted in the store
// and paged (the browser never holds more than a page), each row linking to
// the item in full. The filters live in the page's address, so a view can
// be shared and the back button works.
"use strict";
(() => {
  const { api, h, fmt, badge, showError } = EF;
  const runId = document.body.dataset.run;
  const root = document.getElementById("content");
  const params = new URLSearchParams(location.search);
  const input = (name, placeholder, width) => {
    const el = h("input", { name, placeholder, id: "f-" + name, style: width ? `width:${width}px` : null });
    el.value = params.get(name) || "";
    return el;
  };
  const select = (name, options) => {
    const el = h("select", { name, id: "f-" + name }, options.map(([v, label]) => h("option", { value: v }, label)));
    el.value = params.get(name) || "";
    return el;
  };
  const fields = {
    state: select("state", [["", "any"], ["done", "done"], ["failed", "failed"], ["pending", "pending"]]),
    q: input("q", "text in the answer or error", 200),
    field: input("field", "field:value"),
    score: input("score", "metric:min:max"),
    error_class: select("error_class", [["", "any"], ["retryable", "retryable"], ["back_pressure", "back pressure"],
      ["first_byte_timeout", "no first byte"], ["stalled", "stalled"], ["bad_response", "bad response"], ["fatal", "fatal"]]),
    endpoint: input("endpoint", "name", 110),
    latency_ms: input("latency_ms", "min:max", 100),
    tokens: input("tokens", "min:max", 100),
    sort: select("sort", [["seq", "dataset order"], ["latency", "latency"], ["ttft", "TTFT"], ["tpot", "TPOT"], ["tokens", "tokens"],
      ["attempts", "attempts"], ["finished", "finished"]]),
    order: select("order", [["asc", "ascending"], ["desc", "descending"]]),
  };
  const labels = { state: "State", q: "Search", field: "Field", score: "Score", error_class: "Error class", endpoint: "Endpoint",
    latency_ms: "Latency ms", tokens: "Tokens", sort: "Sort by", order: "Order" };
  const table = h("table", { id: "items" });
  const pager = h("div", { class: "pager" });
  const form = h("form", { class: "filters", id: "filters", onsubmit: (e) => { e.preventDefault(); apply(); } },
    Object.entries(fields).map(([k, el]) => h("label", {}, labels[k], el)),
    h("button", { class: "primary", type: "submit", id: "apply" }, "Apply"),
    h("a", { class: "button", href: location.pathname }, "Clear"));
  root.append(
    h("div", {}, h("h1", {}, "Results"), h("div", { class: "sub" },
      h("a", { href: `/runs/${encodeURIComponent(runId)}` }, runId))),
    h("div", { class: "card" }, form),
    h("div", { class: "card" }, table, pager));

  // Cursors of the pages seen, to go back.
  const trail = [];
  let after = params.get("after") || null;
  let metrics = [];

  function query() {
    const q = new URLSearchParams();
    for (const [k, el] of Object.entries(fields)) if (el.value && !(k === "sort" && el.value === "seq") && !(k === "order" && el.value === "asc")) q.set(k, el.value);
    return q;
  }

  function apply() {
    const q = query();
    history.pushState(null, "", location.pathname + (q.toString() ? "?" + q : ""));
    trail.length = 0; after = null; load();
  }

  function scoreCell(scores, key) {
    const s = scores && scores[key];
    if (!s) return h("td", { class: "num" }, "–");
    if (s.value === undefined || s.value === null) return h("td", { class: "num", title: s.error || "" }, "n/a");
    return h("td", { class: "num" }, fmt.num(s.value, 3));
  }

  /** An answer cell: a conversation episode's record shows its first turns, not its JSON. */
  function answerText(r) {
    const text = r.output || r.error || "";
    // The page holds the record's first characters: its turns are read in
    // place, one after another, from the start of its conversation.
    const at = r.output && r.output.startsWith("{") ? r.output.indexOf('"conversation":[') : -1;
    if (at >= 0) {
      const turn = /\{"speaker":"([^"]*)","text":"((?:[^"\\]|\\.)*)"\},?/y;
      turn.lastIndex = at + '"conversation":['.length;
      const turns = [];
      for (let m = turn.exec(r.output); m; m = turn.exec(r.output)) {
        turns.push(`${m[1]}: ${m[2].replace(/\\"/g, '"').replace(/\\n/g, " ")}`);
      }
      if (turns.length) return turns.join("  ·  ");
    }
    return text;
  }

  async function load() {
    const q = query();
    q.set("limit", "50");
    if (after) q.set("after", after);
    try {
      const page = await api(`/runs/${encodeURIComponent(runId)}/items?${q}`);
      showError(null);
      if (!metrics.length) metrics = [...new Set(page.rows.flatMap((r) => Object.keys(r.scores || {})))];
      const judged = page.rows.some((r) => r.judged);
      table.replaceChildren(
        h("thead", {}, h("tr", {}, h("th", {}, "Item"), h("th", {}, "State"), h("th", {}, "Answer or error"),
          judged ? h("th", {}, "Verdict") : null, ...metrics.map((m) => h("th", { class: "num mono" }, m)),
          h("th", { class: "num" }, "Latency"), h("th", { class: "num" }, "Tokens"), h("th", {}, "Endpoint"), h("th", { class: "num" }, "Attempts"))),
        h("tbody", {}, page.rows.map((r) => h("tr", { "data-item": r.item_id },
          h("td", { class: "mono" }, h("a", { href: `/runs/${encodeURIComponent(runId)}/items/${encodeURIComponent(r.item_id)}` }, r.item_id)),
          h("td", {}, badge(r.state), r.verdict && r.verdict !== "ok" ? [" ", badge(r.verdict)] : null),
          h("td", { class: "clip", title: answerText(r) }, answerText(r)),
          judged ? h("td", { class: "verdict" }, r.judged ? [badge(r.judged.verdict), h("span", { class: "sub" }, ` ${r.judged.passed}/${r.judged.total}`)] : "–") : null,
          ...metrics.map((m) => scoreCell(r.scores, m)),
          h("td", { class: "num" }, fmt.ms(r.latency_ms)),
          h("td", { class: "num" }, fmt.int(r.completion_tokens)),
          h("td", {}, r.endpoint || "–"),
          h("td", { class: "num" }, fmt.int(r.attempts))))));
      if (!page.rows.length) table.append(h("caption", { class: "empty" }, "No item matches."));
      pager.replaceChildren(
        h("button", { id: "prev", disabled: !trail.length, onclick: () => { after = trail.pop() || null; load(); } }, "← Previous"),
        h("button", { id: "next", disabled: !page.next, onclick: () => { trail.push(after); after = page.next; load(); } }, "Next →"),
        h("span", { class: "sub" }, `page ${trail.length + 1}; ${page.rows.length} rows`));
    } catch (e) { showError(e); }
  }
  window.addEventListener("popstate", () => location.reload());
  load();
})();
