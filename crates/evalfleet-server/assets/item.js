// One item in full: the conversation (the rendered messages and the
// answer), what checking made of the answer, each metric's score, the
// judge's details and every attempt with its telemetry and error.
"use strict";
(() => {
  const { api, h, fmt, badge, showError } = EF;
  const runId = document.body.dataset.run;
  const itemId = document.body.dataset.item;
  const root = document.getElementById("content");

  function json(value) { return h("pre", { class: "json" }, JSON.stringify(value, null, 2)); }

  async function load() {
    try {
      const item = await api(`/runs/${encodeURIComponent(runId)}/items/${encodeURIComponent(itemId)}`);
      const conversation = h("div", { id: "conversation" },
        (item.messages || []).map((m) => h("div", { class: "msg " + m.role }, h("div", { class: "role" }, m.role), m.content)),
        item.output !== null && item.output !== undefined
          ? h("div", { class: "msg assistant" }, h("div", { class: "role" }, "answer"), item.output) : null,
        item.messages_error ? h("div", { class: "note" }, "The messages cannot be shown: " + item.messages_error) : null,
        item.state === "pending" ? h("div", { class: "note" }, "Pending: not answered yet.") : null);
      const scores = Object.entries(item.scores || {});
      const attempts = h("table", { id: "attempts" },
        h("thead", {}, h("tr", {}, h("th", { class: "num" }, "#"), h("th", {}, "Sent"), h("th", {}, "Endpoint"), h("th", { class: "num" }, "Latency"),
          h("th", { class: "num" }, "TTFT"), h("th", { class: "num" }, "Tokens"), h("th", {}, "Status"), h("th", {}, "Error"))),
        h("tbody", {}, item.attempt_records.map((a) => h("tr", {},
          h("td", { class: "num" }, a.attempt), h("td", {}, fmt.time(a.sent_at_ms)), h("td", {}, a.endpoint),
          h("td", { class: "num" }, fmt.ms(a.latency_ms)), h("td", { class: "num" }, fmt.ms(a.ttft_ms)),
          h("td", { class: "num" }, fmt.int(a.completion_tokens), a.tokens_estimated ? " est." : ""),
          h("td", {}, a.http_status || "–"),
          h("td", {}, a.error_class ? [badge(a.error_class), " "] : null, a.error || "")))));
      root.replaceChildren(
        h("div", {}, h("h1", {}, itemId, " ", badge(item.state)),
          h("div", { class: "sub" }, h("a", { href: `/runs/${encodeURIComponent(runId)}` }, runId), " · ",
            h("a", { href: `/runs/${encodeURIComponent(runId)}/items` }, "results"))),
        h("div", { class: "stats" },
          EF.stat("latency", fmt.ms(item.latency_ms)), EF.stat("TTFT", fmt.ms(item.ttft_ms)), EF.stat("TPOT", fmt.ms(item.tpot_ms)),
          EF.stat("tokens", fmt.int(item.completion_tokens)), EF.stat("attempts", fmt.int(item.attempts)), EF.stat("re-asks", fmt.int(item.reasks))),
        h("div", { class: "row" },
          h("div", { class: "card grow" }, h("h2", {}, "Conversation"), conversation,
            item.error ? h("div", { class: "error-banner" }, item.error) : null),
          h("div", { class: "card grow" }, h("h2", {}, "Checking and scores"),
            h("div", {}, "Verdict: ", item.verdict ? badge(item.verdict) : "not checked",
              item.check_error ? h("div", { class: "note" }, item.check_error) : null),
            item.parsed !== null && item.parsed !== undefined ? [h("h2", { style: "margin-top:10px" }, "Parsed"), json(item.parsed)] : null,
            h("table", { id: "scores", style: "margin-top:10px" }, h("tbody", {}, scores.map(([k, s]) => h("tr", {},
              h("td", { class: "mono" }, k), h("td", { class: "num" }, s.value === undefined ? "n/a" : fmt.num(s.value, 4)),
              h("td", { class: "sub" }, s.error || Object.entries(s).filter(([x]) => x !== "value" && x !== "error").map(([x, v]) => `${x}: ${JSON.stringify(v)}`).join("; ")))))),
            item.judge ? [h("h2", { style: "margin-top:10px" }, "Code judge"), json(item.judge)] : null)),
        h("div", { class: "card" }, h("h2", {}, "Attempts"), attempts),
        h("div", { class: "card" }, h("h2", {}, "Dataset row"), json(item.item)));
    } catch (e) { showError(e); }
  }
  load();
})();
