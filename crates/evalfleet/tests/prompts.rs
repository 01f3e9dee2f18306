//! Prompts per document type and model (`task.prompts`), and the report by
//! document type: every metric and how the answers turned out (structural
//! fidelity), by `doc_type` and overall.

use evalfleet_store::prelude::*;
use serde_json::Value;

use crate::util::*;

/// Items of three document types and one without a type; the mock echoes
/// the last user message, so each answer shows the prompt it was sent.
const DOCS: &str = r#"{"id": "inv", "doc_type": "invoice", "question": "q-inv"}
{"id": "rec", "doc_type": "receipt", "question": "q-rec"}
{"id": "form", "doc_type": "form", "question": "q-form"}
{"id": "none", "question": "q-none"}
"#;

fn rules_config(model: &str) -> String {
    format!(
        r#"name: rules
dataset:
  path: docs.jsonl
  id_field: id
endpoints:
  - {{ name: m, kind: mock, model: {model} }}
task:
  messages:
    - {{ role: user, content: "DEFAULT {{{{ question }}}}" }}
  prompts:
    - name: money
      when: {{ doc_type: [invoice, receipt] }}
      messages:
        - {{ role: system, content: "You read invoices." }}
        - {{ role: user, content: "MONEY {{{{ question }}}}" }}
    - when: {{ doc_type: form }}
      model: "vision-*"
      messages:
        - {{ role: user, content: "VISION FORM {{{{ question }}}}" }}
    - model: "text-*"
      messages:
        - {{ role: user, content: "TEXT {{{{ question }}}}" }}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_document_type_and_model_gets_its_prompt_and_the_choice_is_recorded() {
    let env = Env::new();
    env.write("docs.jsonl", DOCS);
    let mut runs = Vec::new();
    for (model, expected) in [
        (
            "vision-1",
            [
                ("inv", "MONEY q-inv", "money"),
                ("rec", "MONEY q-rec", "money"),
                ("form", "VISION FORM q-form", "doc_type=form model=vision-*"),
                ("none", "DEFAULT q-none", "default"),
            ],
        ),
        (
            "text-1",
            [
                ("inv", "MONEY q-inv", "money"),
                ("rec", "MONEY q-rec", "money"),
                ("form", "TEXT q-form", "model=text-*"),
                ("none", "TEXT q-none", "model=text-*"),
            ],
        ),
    ] {
        env.write("run.yaml", &rules_config(model));
        let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
        assert_eq!(ran.code, Some(0), "{}", ran.stderr);
        let run_id = ran.run_id();
        runs.push(run_id.clone());

        // The export: each answer echoes its prompt, and names its rule.
        let rows = by_id(&env.export(&run_id).await);
        for (id, output, prompt) in expected {
            assert_eq!(rows[id]["output"], output, "{model}: {}", rows[id]);
            assert_eq!(rows[id]["prompt"], prompt, "{model}: {}", rows[id]);
        }

        // The store holds the choice with each result.
        let mut stored = std::collections::BTreeMap::new();
        env.store()
            .scan_results(&run_id, &mut |r| {
                stored.insert(r.item_id.clone(), r.prompt.clone());
            })
            .unwrap();
        for (id, _, prompt) in expected {
            assert_eq!(stored[id].as_deref(), Some(prompt), "{model}: {id}");
        }
        // So does an item's page (the API's item, the dashboard's item page).
        let item = env.store().item(&run_id, "form").unwrap().unwrap();
        assert_eq!(item.prompt.as_deref(), Some(expected[2].2));

        // CSV has the column too, after the fixed ones it had.
        let (header, records) = env.export_csv(&run_id).await;
        let at = header.iter().position(|h| h == "prompt").unwrap();
        assert_eq!(header[at - 1], "check_error", "{header:?}");
        let ids = header.iter().position(|h| h == "item_id").unwrap();
        for record in records {
            let (_, _, prompt) = expected
                .iter()
                .find(|(id, _, _)| *id == &record[ids])
                .unwrap();
            assert_eq!(&record[at], *prompt);
        }

        // The report counts results by rule and groups by it when asked.
        let report = report_json(&env, &run_id, &["--by", "@prompt"]).await;
        assert_eq!(report["group_by"], serde_json::json!(["@prompt"]));
        let mut counts = std::collections::BTreeMap::new();
        for (_, _, prompt) in expected {
            *counts.entry(prompt.to_owned()).or_insert(0u64) += 1;
        }
        assert_eq!(report["prompts"], serde_json::to_value(&counts).unwrap());
        let groups: Vec<(String, u64)> = report["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                (
                    g["group"].as_str().unwrap().to_owned(),
                    g["items"].as_u64().unwrap(),
                )
            })
            .collect();
        let mut wanted = vec![("all".to_owned(), 4)];
        wanted.extend(counts.into_iter());
        assert_eq!(groups, wanted, "{model}");
    }
    // A comparison pairs items across runs, whose prompts may differ: it
    // groups by item fields only, and says so.
    let compared = env
        .evalfleet(&["compare", &runs[0], &runs[1], "--by", "@prompt"])
        .await;
    assert_eq!(compared.code, Some(2), "{}", compared.stderr);
    assert!(
        compared
            .stderr
            .contains("--by @prompt: a comparison groups by item fields only"),
        "{}",
        compared.stderr
    );
}

/// Runs `config` and checks that it is refused (exit 2) saying `expected`.
async fn refused(env: &Env, config: &str, expected: &str) {
    env.write("run.yaml", config);
    let ran = env.evalfleet(&["run", "run.yaml"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(ran.stderr.contains(expected), "{expected}\n{}", ran.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_prompt_rule_is_refused_with_its_line_before_any_call() {
    let env = Env::new();
    env.write("docs.jsonl", DOCS);
    // A field no row has, caught where the templates' fields are checked.
    refused(
        &env,
        &rules_config("vision-1").replace("when: { doc_type: form }", "when: { doc_typ: form }"),
        "run.yaml:16: task.prompts[1].when.doc_typ: the rule's condition names 'doc_typ', which no row of the dataset has (fields: doc_type, id, question)",
    )
    .await;
    // A model condition that splits the run's endpoints.
    refused(
        &env,
        &rules_config("vision-1").replace(
            "  - { name: m, kind: mock, model: vision-1 }\n",
            "  - { name: m, kind: mock, model: vision-1 }\n  - { name: n, kind: mock, model: text-1 }\n",
        ),
        "run.yaml:18: task.prompts[1].model: 'vision-*' matches the model of endpoints m (vision-1) but not of n (text-1)",
    )
    .await;
    // A template of a rule's messages that reads a field the first rows lack.
    refused(
        &env,
        &rules_config("vision-1").replace("MONEY {{ question }}", "MONEY {{ total }}"),
        "run.yaml:15: task.prompts[0].messages[1].content: for row 1 (line 1 of docs.jsonl): this item has no field 'total'",
    )
    .await;
}

async fn report_json(env: &Env, run_id: &str, extra: &[&str]) -> Value {
    let mut args = vec!["report", run_id, "--json", "--out", "reports"];
    args.extend_from_slice(extra);
    let ran = env.evalfleet(&args).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    serde_json::from_str(&ran.stdout).unwrap_or_else(|err| panic!("{err}: {}", ran.stdout))
}

/// The figures of `metric` in `group` of a report's `groups`.
fn figures<'a>(report: &'a Value, group: &str, metric: &str) -> &'a Value {
    report["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["group"] == group)
        .unwrap_or_else(|| panic!("no group {group}: {report}"))["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["metric"] == metric)
        .unwrap_or_else(|| panic!("no metric {metric} in {group}"))
}

fn group<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["group"] == name)
        .unwrap_or_else(|| panic!("no group {name}: {report}"))
}

fn close(value: &Value, expected: f64, what: &str) {
    let got = value.as_f64().unwrap_or_else(|| panic!("{what}: {value}"));
    assert!((got - expected).abs() < 1e-9, "{what}: {got} != {expected}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_by_document_type_gives_every_metric_by_type_and_overall() {
    // The mock echoes the question, so each answer is set by its row.
    let env = Env::new();
    env.write(
        "docs.jsonl",
        r#"{"id": "i1", "doc_type": "invoice", "question": "hello world", "answer": "hello world"}
{"id": "i2", "doc_type": "invoice", "question": "abce", "answer": "abcd"}
{"id": "f1", "doc_type": "form", "question": "form two", "answer": "form one"}
{"id": "f2", "doc_type": "form", "question": "abc", "answer": "xyz"}
"#,
    );
    env.write(
        "run.yaml",
        r#"name: docs
dataset: { path: docs.jsonl, id_field: id }
endpoints:
  - { name: m, kind: mock }
task:
  messages:
    - { role: user, content: "{{ question }}" }
  metrics:
    - { name: cer, as: cer, reference: "{{ answer }}" }
    - { name: wer, as: wer, reference: "{{ answer }}" }
    - { name: anls, as: anls, reference: "{{ answer }}" }
"#,
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    // No --by: the items have a doc_type, so the report groups by it.
    let report = report_json(&env, &ran.run_id(), &[]).await;
    assert_eq!(report["group_by"], serde_json::json!(["doc_type"]));
    let names: Vec<&str> = report["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["group"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["all", "form", "invoice"]);
    // By hand. i1: exact. i2: one substitution in 4 characters, 1 word of
    // 1; ANLS 1 - 1/4. f1: "one" -> "two", 3 of 8 characters, 1 word of
    // 2; ANLS 1 - 3/8. f2: 3 of 3, 1 of 1; NL 1 is past the threshold: 0.
    let cer = [
        ("all", (0.0 + 0.25 + 0.375 + 1.0) / 4.0),
        ("invoice", 0.125),
        ("form", 0.6875),
    ];
    for (g, mean) in cer {
        close(
            &figures(&report, g, "cer")["mean"],
            mean,
            &format!("cer {g}"),
        );
    }
    close(
        &figures(&report, "invoice", "cer")["pooled"],
        1.0 / 15.0,
        "pooled cer invoice",
    );
    close(
        &figures(&report, "form", "cer")["pooled"],
        6.0 / 11.0,
        "pooled cer form",
    );
    close(
        &figures(&report, "all", "cer")["pooled"],
        7.0 / 26.0,
        "pooled cer all",
    );
    for (g, mean) in [("all", 2.5 / 4.0), ("invoice", 0.5), ("form", 0.75)] {
        close(
            &figures(&report, g, "wer")["mean"],
            mean,
            &format!("wer {g}"),
        );
    }
    for (g, mean) in [("all", 2.375 / 4.0), ("invoice", 0.875), ("form", 0.3125)] {
        close(
            &figures(&report, g, "anls")["mean"],
            mean,
            &format!("anls {g}"),
        );
    }
    // The interval of two values {0, 0.25}: mean ± 1.96 × sd/√2, kept
    // inside [0, 1] where the values are.
    let se = (2.0f64 * 0.125 * 0.125).sqrt() / 2.0f64.sqrt();
    let z = 1.959_963_984_540_054;
    close(&figures(&report, "invoice", "cer")["stderr"], se, "se");
    assert!(0.125 - z * se < 0.0);
    close(&figures(&report, "invoice", "cer")["ci_low"], 0.0, "ci_low");
    close(
        &figures(&report, "invoice", "cer")["ci_high"],
        0.125 + z * se,
        "ci_high",
    );
    // A whole answer is always usable: both at the first answer.
    assert_eq!(group(&report, "form")["fidelity"]["valid_first_try"], 2);
    close(
        &group(&report, "form")["valid_first"]["mean"],
        1.0,
        "valid first",
    );

    // The table says the same.
    let table = env
        .evalfleet(&["report", &ran.run_id(), "--out", "reports"])
        .await;
    assert_eq!(table.code, Some(0), "{}", table.stderr);
    assert!(table.stdout.contains("By doc_type:"), "{}", table.stdout);
    let invoice = table
        .stdout
        .lines()
        .skip_while(|l| !l.starts_with("By doc_type:"))
        .find(|l| l.starts_with("invoice"))
        .unwrap_or_else(|| panic!("{}", table.stdout));
    assert!(invoice.contains("0.1250 ["), "{invoice}");
    // --by another field, or the run's report.by, replaces the default.
    let report = report_json(&env, &ran.run_id(), &["--by", "id"]).await;
    assert_eq!(report["groups"].as_array().unwrap().len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structural_fidelity_counts_first_answers_re_asks_and_invalid_ones_by_type() {
    let env = Env::new();
    env.write(
        "docs.jsonl",
        r#"{"id": "i1", "doc_type": "invoice", "question": "q-i1", "fields": {"total": "12"}}
{"id": "i2", "doc_type": "invoice", "question": "q-i2", "fields": {"total": "31"}}
{"id": "f1", "doc_type": "form", "question": "q-f1", "fields": {"name": "Bo"}}
{"id": "f2", "doc_type": "form", "question": "q-f2", "fields": {"name": "Ann"}}
"#,
    );
    // Replies by the number of answers already in the request: a re-ask
    // gets the next one.
    let answers = env.write(
        "answers.jsonl",
        r#"{"prompt": "q-i1", "replies": ["{\"total\": \"12\"}"]}
{"prompt": "q-i2", "replies": ["the total is 30", "{\"total\": \"30\"}"]}
{"prompt": "q-f1", "replies": ["name: Bo", "still no JSON"]}
{"prompt": "q-f2", "replies": ["```json\n{\"name\": \"Ann\"}\n```"]}
"#,
    );
    let server = scripted(answers).await;
    env.write(
        "run.yaml",
        &format!(
            r#"name: fields
dataset: {{ path: docs.jsonl, id_field: id }}
endpoints:
{}
task:
  messages:
    - {{ role: user, content: "{{{{ question }}}}" }}
  parse: json
  max_reasks: 1
  metrics:
    - {{ name: json_field_match, as: json_field_match, reference: "{{{{ fields }}}}" }}
report:
  by: doc_type
"#,
            external("m", &server, 2)
        ),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    // Some answers are not scored: the run is incomplete, and says so.
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("finished, incomplete: "),
        "{}",
        ran.stderr
    );
    let report = report_json(&env, &ran.run_id(), &[]).await;
    assert_eq!(report["group_by"], serde_json::json!(["doc_type"]));
    let fidelity = |g: &str| group(&report, g)["fidelity"].clone();
    assert_eq!(
        fidelity("invoice"),
        serde_json::json!({"valid_first_try": 1, "valid_after_reasks": 1, "unparsed": 0,
            "invalid": 0, "not_checked": 0, "failed": 0})
    );
    assert_eq!(
        fidelity("form"),
        serde_json::json!({"valid_first_try": 1, "valid_after_reasks": 0, "unparsed": 1,
            "invalid": 0, "not_checked": 0, "failed": 0})
    );
    assert_eq!(fidelity("all")["valid_first_try"], 2);
    assert_eq!(fidelity("all")["valid_after_reasks"], 1);
    assert_eq!(fidelity("all")["unparsed"], 1);
    // Shares of the checked answers, with Wilson's interval.
    close(
        &group(&report, "invoice")["valid_first"]["mean"],
        0.5,
        "first invoice",
    );
    close(
        &group(&report, "invoice")["valid_final"]["mean"],
        1.0,
        "final invoice",
    );
    close(
        &group(&report, "form")["valid_final"]["mean"],
        0.5,
        "final form",
    );
    close(
        &group(&report, "all")["valid_final"]["mean"],
        0.75,
        "final all",
    );
    let (z, n, p) = (1.959_963_984_540_054f64, 4.0f64, 0.5f64);
    let centre = (p + z * z / (2.0 * n)) / (1.0 + z * z / n);
    let half = z / (1.0 + z * z / n) * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt();
    close(
        &group(&report, "all")["valid_first"]["ci_low"],
        centre - half,
        "wilson low",
    );
    close(
        &group(&report, "all")["valid_first"]["ci_high"],
        centre + half,
        "wilson high",
    );
    // Field match: i1 right, i2 wrong after its re-ask, f1 unusable (the
    // worst score, 0), f2 right.
    close(
        &figures(&report, "invoice", "json_field_match")["mean"],
        0.5,
        "invoice",
    );
    close(
        &figures(&report, "form", "json_field_match")["mean"],
        0.5,
        "form",
    );
    close(
        &figures(&report, "all", "json_field_match")["mean"],
        0.5,
        "all",
    );
    // The mock saw each re-ask: 4 first answers and 2 re-asks.
    assert_eq!(server.stats().requests, 6);
}
