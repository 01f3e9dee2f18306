// A new run, from a config: its YAML, or a file on the server (under the
// directories it reads configs from); started at once in the server.
"use strict";
(() => {
  const { api, h, showError } = EF;
  const root = document.getElementById("content");
  const yaml = h("textarea", { id: "config", rows: 22, placeholder: "name: my-eval\ndataset: { path: data/items.jsonl, id_field: id }\nendpoints:\n  - { name: m, kind: mock }\ntask:\n  messages:\n    - { role: user, content: \"{{ question }}\" }" });
  const path = h("input", { id: "config-path", placeholder: "configs/eval.yaml", style: "width:360px" });
  const runId = h("input", { id: "run-id", placeholder: "default: name and time" });
  const sample = h("input", { id: "n-sample", type: "number", min: 1, placeholder: "all" });
  const start = h("button", { class: "primary", id: "start", type: "submit" }, "Start");
  root.append(h("h1", {}, "New run"), h("div", { class: "card" }, h("form", { onsubmit: async (e) => {
    e.preventDefault();
    start.disabled = true;
    const body = {};
    if (path.value.trim()) body.config_path = path.value.trim(); else body.config = yaml.value;
    if (runId.value.trim()) body.run_id = runId.value.trim();
    if (sample.value) body.n_sample = Number(sample.value);
    try {
      const started = await api("/runs", { method: "POST", body });
      location.href = "/runs/" + encodeURIComponent(started.run_id);
    } catch (err) { showError(err); start.disabled = false; }
  } },
    h("p", { class: "sub" }, "Paste a config, or name a config file on the server. The run is registered, then answered by this server; its page follows it live."),
    yaml,
    h("div", { class: "filters", style: "margin-top:10px" },
      h("label", {}, "…or a config file on the server", path), h("label", {}, "Run id", runId), h("label", {}, "Sample of n items", sample), start))));
})();
