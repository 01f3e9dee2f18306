// One item in full: the conversation (the rendered messages and the
// answer), what checking made of the answer, each metric's score, the
// judge's details, every attempt with its telemetry and error, and an
// agent's calls (kind: exec) as a timeline with their messages.
"use strict";
(() => {
  const { api, h, fmt, badge, showError } = EF;
  const runId = document.body.dataset.run;
  const itemId = document.body.dataset.item;
  const root = document.getElementById("content");

  function json(value) { return h("pre", { class: "json" }, JSON.stringify(value, null, 2)); }

  /** An answer that is a conversation episode's record, or null. */
  function episode(output) {
    if (typeof output !== "string" || !output.startsWith("{")) return null;
    try {
      const record = JSON.parse(output);
      return record && Array.isArray(record.conversation) && Array.isArray(record.steps) ? record : null;
    } catch (_) { return null; }
  }

  /** An episode: its turns as a conversation, then its decisions. */
  function episodeView(record) {
    const needs = record.needs || {};
    const turns = h("div", { id: "turns" }, record.conversation.map((u) =>
      h("div", { class: "msg " + (u.speaker === "robot" ? "assistant" : "user") },
        h("div", { class: "role" }, u.speaker === "robot" ? "robot" : `${u.speaker}${needs[u.speaker] ? " · " + needs[u.speaker] : ""}`),
        u.text)));
    const steps = h("table", { id: "steps" },
      h("thead", {}, h("tr", {}, h("th", { class: "num" }, "Step"), h("th", { class: "num" }, "Turn"), h("th", {}, "Relations"),
        h("th", {}, "Target"), h("th", {}, "Strategy"), h("th", {}, "Robot"), h("th", { class: "num" }, "Reward"))),
      h("tbody", {}, record.steps.map((s) => h("tr", {},
        h("td", { class: "num" }, s.step), h("td", { class: "num" }, s.turn),
        h("td", { class: "mono" }, s.pattern || "", s.stable ? " stable" : ""),
        h("td", {}, s.target_edge ? String(s.target_edge) : "–", s.target_speaker ? ` → ${s.target_speaker}` : ""),
        h("td", {}, s.valid ? (s.strategy || "–") : badge("invalid")),
        h("td", { class: "clip", title: s.robot || "" }, s.robot || "–"),
        h("td", { class: "num" }, s.reward && s.reward.total !== undefined ? fmt.num(s.reward.total, 2) : "–")))));
    return h("div", {},
      h("div", { class: "sub" }, `Topics: ${(record.topics || []).join(" · ") || "–"}; ended: ${record.ending || "–"}; total reward ${fmt.num(record.total_reward, 2)}`),
      turns,
      h("h2", { style: "margin-top:10px" }, "Decisions"), steps);
  }

  /** The code judge's judgement: its verdict, then each test that did not pass, as a table. */
  function judgeView(judge) {
    const counts = Object.entries(judge.error_type_counts || {});
    const failing = judge.test_case_errors || [];
    return h("div", { id: "judge" },
      h("div", {}, "Verdict: ", badge(judge.verdict || "–"), ` ${fmt.int(judge.passed)} of ${fmt.int(judge.total)} tests passed`,
        judge.extraction ? h("span", { class: "sub" }, ` · program taken from: ${judge.extraction}`) : null),
      judge.compile && !judge.compile.ok ? h("pre", { class: "json" }, judge.compile.message || "did not compile") : null,
      counts.length ? h("table", { id: "judge-counts", style: "margin-top:8px" },
        h("thead", {}, h("tr", {}, h("th", {}, "Verdict"), h("th", { class: "num" }, "Tests"))),
        h("tbody", {}, counts.map(([v, n]) => h("tr", {}, h("td", {}, badge(v)), h("td", { class: "num" }, fmt.int(n)))))) : null,
      failing.length ? h("table", { id: "judge-tests", style: "margin-top:8px" },
        h("thead", {}, h("tr", {}, h("th", { class: "num" }, "Test"), h("th", {}, "Verdict"), h("th", { class: "num" }, "Seconds"),
          h("th", {}, "Expected"), h("th", {}, "Got"), h("th", {}, "Message"))),
        h("tbody", {}, failing.map((t) => h("tr", {},
          h("td", { class: "num" }, t.index), h("td", {}, badge(t.verdict)), h("td", { class: "num" }, fmt.num(t.seconds, 3)),
          h("td", { class: "mono clip", title: t.expected || "" }, t.expected || ""),
          h("td", { class: "mono clip", title: t.got || "" }, t.got || ""),
          h("td", { class: "clip", title: t.message || "" }, t.message || ""))))) : null);
  }

  /** Parses JSON text, or null when it is not JSON (a body cut when stored). */
  function parsed(text) {
    if (typeof text !== "string") return null;
    try { return JSON.parse(text); } catch (_) { return null; }
  }

  /** A message's content as text: a string as it is, parts by their text, the rest as JSON. */
  function contentText(content) {
    if (content === null || content === undefined) return "";
    if (typeof content === "string") return content;
    if (Array.isArray(content)) return content.map((p) => (p && typeof p.text === "string" ? p.text : JSON.stringify(p))).join("\n");
    return JSON.stringify(content, null, 2);
  }

  /** A chat message with its tool calls (name and arguments) or the tool call it answers. */
  function chatMessage(m) {
    const role = String((m && m.role) || "?");
    const calls = Array.isArray(m && m.tool_calls) ? m.tool_calls : [];
    return h("div", { class: "msg " + (role === "assistant" ? "assistant" : "user") },
      h("div", { class: "role" }, role, m && m.tool_call_id ? ` · answers ${m.tool_call_id}` : "", m && m.name ? ` · ${m.name}` : ""),
      contentText(m && m.content),
      calls.map((c) => h("div", { class: "tool-call mono" },
        "→ ", String((c.function && c.function.name) || c.type || "tool"), "(",
        String((c.function && c.function.arguments) || ""), ")", c.id ? ` · ${c.id}` : "")));
  }

  /** What a call sent and got: the chat messages and the answer, or the bodies as they are. */
  function callDetail(c) {
    const request = parsed(c.request);
    const response = parsed(c.response);
    const parts = [];
    if (request && Array.isArray(request.messages)) {
      parts.push(h("div", { class: "sub" }, "Sent"), ...request.messages.map(chatMessage));
      if (Array.isArray(request.tools) && request.tools.length) {
        parts.push(h("div", { class: "sub" }, "Tools offered: ",
          request.tools.map((t) => String((t.function && t.function.name) || t.type || "?")).join(", ")));
      }
    } else {
      parts.push(h("div", { class: "sub" }, c.request_cut ? "Sent (cut when stored)" : "Sent"),
        h("pre", { class: "json" }, request ? JSON.stringify(request, null, 2) : String(c.request || "")));
    }
    if (c.api === "chat.completions" && response && typeof response === "object" && !Array.isArray(response)) {
      parts.push(h("div", { class: "sub" }, "Got"), chatMessage(Object.assign({ role: "assistant" }, response)));
    } else if (c.response !== null && c.response !== undefined) {
      parts.push(h("div", { class: "sub" }, "Got"),
        h("pre", { class: "json" }, response ? JSON.stringify(response, null, 2) : String(c.response)));
    }
    if (c.tags) parts.push(h("div", { class: "sub" }, "Tags: ", String(c.tags)));
    return parts;
  }

  /** The agent's calls (kind: exec) in order: one row each, a bar placing it in time, its messages on demand. */
  function callsView(calls) {
    const start = Math.min(...calls.map((c) => c.sent_at_ms));
    const end = Math.max(...calls.map((c) => c.sent_at_ms + (c.latency_ms || 0)));
    const span = Math.max(end - start, 1);
    const rows = [];
    for (const c of calls) {
      const left = (100 * (c.sent_at_ms - start)) / span;
      const width = Math.max((100 * (c.latency_ms || 0)) / span, 0.5);
      const detail = h("tr", { class: "call-detail", hidden: true },
        h("td", { colspan: "10" }, h("div", { class: "call-messages" }, callDetail(c))));
      const toggle = h("button", { type: "button", class: "link", onclick: () => {
        detail.hidden = !detail.hidden;
        toggle.textContent = detail.hidden ? "show" : "hide";
      } }, "show");
      const tokens = c.prompt_tokens === null && c.completion_tokens === null ? "–"
        : `${fmt.int(c.prompt_tokens)} + ${fmt.int(c.completion_tokens)}${c.tokens_estimated ? " est." : ""}`;
      rows.push(h("tr", { class: "call" },
        h("td", { class: "mono" }, c.call_id),
        h("td", { class: "timeline" }, h("div", { class: "bar", style: `margin-left:${left.toFixed(2)}%;width:${width.toFixed(2)}%` })),
        h("td", {}, c.api, c.stream ? " · stream" : ""),
        h("td", {}, c.endpoint || "–"),
        h("td", { class: "clip", title: `${c.asked_model} → ${c.model}` }, c.model || c.asked_model || "–"),
        h("td", { class: "num" }, fmt.ms(c.latency_ms)),
        h("td", { class: "num" }, fmt.ms(c.ttft_ms)),
        h("td", { class: "num" }, tokens),
        h("td", {}, String(c.http_status), c.cached ? [" ", badge("cached")] : null,
          c.error_class ? [" ", badge(c.error_class)] : null, c.error ? h("div", { class: "note" }, c.error) : null),
        h("td", {}, toggle)));
      rows.push(detail);
    }
    return h("table", { id: "calls" },
      h("thead", {}, h("tr", {}, h("th", {}, "Call"), h("th", {}, "Timeline"), h("th", {}, "API"), h("th", {}, "Endpoint"),
        h("th", {}, "Model"), h("th", { class: "num" }, "Latency"), h("th", { class: "num" }, "TTFT"),
        h("th", { class: "num" }, "Tokens (in + out)"), h("th", {}, "Status"), h("th", {}, "Messages"))),
      h("tbody", {}, rows));
  }

  async function load() {
    try {
      const item = await api(`/runs/${encodeURIComponent(runId)}/items/${encodeURIComponent(itemId)}`);
      const played = episode(item.output);
      const conversation = played ? h("div", { id: "conversation" }, episodeView(played)) : h("div", { id: "conversation" },
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
          EF.stat("tokens", fmt.int(item.completion_tokens)), EF.stat("attempts", fmt.int(item.attempts)), EF.stat("re-asks", fmt.int(item.reasks)),
          item.prompt ? EF.stat("prompt", item.prompt) : null),
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
            item.judge ? [h("h2", { style: "margin-top:10px" }, "Code judge"), judgeView(item.judge)] : null)),
        h("div", { class: "card" }, h("h2", {}, "Attempts"), attempts),
        item.calls && item.calls.length
          ? h("div", { class: "card" }, h("h2", {}, `Agent calls (${item.calls.length})`), callsView(item.calls)) : null,
        h("div", { class: "card" }, h("h2", {}, "Dataset row"), json(item.item)));
    } catch (e) { showError(e); }
  }
  load();
})();
