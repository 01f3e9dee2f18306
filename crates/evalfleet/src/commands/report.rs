//! `evalfleet score`, `report` and `compare`: what the stored answers are
//! worth. None of them calls a model.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use evalfleet_core::config::{self, LoadedConfig, Overrides};
use evalfleet_core::eval::aggregate::{self, Row, Summary};
use evalfleet_core::eval::{Evaluator, stats};
use evalfleet_core::store::{RunRecord, Store, StoredResult};
use evalfleet_core::summary::{self, EndpointSummary};
use evalfleet_core::types::{Assessment, ItemStatus, Scores, Verdict};
use serde_json::{Map, Value, json};

use super::inspect::{percentiles, print_table};
use super::open_existing;
use crate::cli::{CacheAction, CacheArgs, CompareArgs, ReportArgs, ScoreArgs};
use crate::{EXIT_OK, UsageError};

/// The task keys `score --config` takes from the new config.
const EVAL_KEYS: [&str; 7] = [
    "parse",
    "schema",
    "schema_file",
    "max_reasks",
    "structured_output",
    "metrics",
    "code",
];

fn stored_config(run: &RunRecord) -> anyhow::Result<LoadedConfig> {
    config::load_snapshot(&run.config, Path::new(&run.config_dir))
        .with_context(|| format!("the stored config of run {} cannot be used", run.run_id))
}

fn evaluator(loaded: &LoadedConfig) -> anyhow::Result<Evaluator> {
    Evaluator::new(&loaded.config.task.eval).map_err(|e| UsageError(e).into())
}

/// `evalfleet score`: parses, checks and scores the stored outputs again;
/// with `--rejudge` (or a changed `task.code`), runs the code judge again.
pub async fn score(args: ScoreArgs) -> anyhow::Result<u8> {
    let location = super::store_location(args.store.store, None)?;
    let mut store = evalfleet_store::open(&location, &evalfleet_store::OpenOptions::default())?;
    let run = store.run(&args.run_id)?;
    if !evalfleet_core::worker::live_workers(&mut *store, &args.run_id)?.is_empty() {
        return Err(UsageError(format!(
            "run {} is running; score it when it has stopped",
            args.run_id
        ))
        .into());
    }
    // The stored config, with the task's checking and scoring taken from
    // --config when given.
    let mut snapshot = run.config.clone();
    if let Some(file) = &args.config {
        let new = config::load_file(file, Overrides::default())?;
        let task = snapshot
            .get_mut("task")
            .and_then(Value::as_object_mut)
            .context("the stored config has no task")?;
        for key in EVAL_KEYS {
            task.remove(key);
            if let Some(value) = new.snapshot.get("task").and_then(|t| t.get(key)) {
                task.insert(key.to_owned(), value.clone());
            }
        }
        // A schema file is read now and stored inline: the stored config
        // must not depend on where the new file was.
        if task.remove("schema_file").is_some()
            && let Some(schema) = &new.config.task.eval.schema
        {
            task.insert("schema".to_owned(), schema.clone());
        }
    }
    let code_changed = snapshot.get("task").and_then(|t| t.get("code"))
        != run.config.get("task").and_then(|t| t.get("code"));
    let loaded = config::load_snapshot(&snapshot, Path::new(&run.config_dir))?;
    let eval = evaluator(&loaded)?;
    let rejudge = match loaded.config.task.kind.code() {
        Some(_) => args.rejudge || code_changed,
        None if args.rejudge => {
            return Err(UsageError(format!(
                "--rejudge: run {} has no code task (task.code)",
                args.run_id
            ))
            .into());
        }
        None => false,
    };
    let keys: Vec<String> = eval.metrics().map(|m| m.key.clone()).collect();
    let only = if args.metrics.is_empty() {
        None
    } else {
        let mut chosen = Vec::new();
        for name in &args.metrics {
            let found: Vec<&String> = keys
                .iter()
                .filter(|k| *k == name || k.split('@').next() == Some(name.as_str()))
                .collect();
            if found.is_empty() {
                return Err(UsageError(format!(
                    "--metrics: '{name}' is not among the task's metrics ({})",
                    keys.join(", ")
                ))
                .into());
            }
            chosen.extend(found.into_iter().cloned());
        }
        Some(chosen)
    };
    // Judge metrics read their judge's replies from the cache.
    let judge_identities: HashMap<String, String> = loaded
        .config
        .endpoints
        .iter()
        .filter(|e| e.judge)
        .map(|e| {
            let identity =
                evalfleet_core::cache::identity(&e.model, &loaded.config.task.params, &e.params);
            (e.name.clone(), identity)
        })
        .collect();
    if let Some(file) = &loaded.config.cache.path {
        store = evalfleet_store::open(
            &location,
            &evalfleet_store::OpenOptions {
                create: false,
                cache_file: Some(file.clone()),
            },
        )?;
    }
    let mut stored: Vec<StoredResult> = Vec::new();
    store.scan_results(&args.run_id, &mut |r: StoredResult| {
        if r.status == ItemStatus::Done {
            stored.push(r);
        }
    })?;
    let code_key = eval
        .metrics()
        .find(|m| matches!(m.kind, evalfleet_core::eval::metrics::Kind::CodeAccepted))
        .map(|m| m.key.clone());
    let mut judged: Vec<(u64, Assessment)> = Vec::with_capacity(stored.len());
    // The usable answers of a code task to judge again: (place in
    // `judged`, item, answer).
    let mut programs: Vec<(u64, Value, String)> = Vec::new();
    let mut bad_rows = 0u64;
    let mut lookup_error = None;
    for r in &stored {
        let item: evalfleet_core::dataset::Row = r
            .item
            .as_deref()
            .and_then(|t| serde_json::from_str(t).ok())
            .unwrap_or_else(|| {
                bad_rows += 1;
                Map::new()
            });
        let output = r.output.as_deref().unwrap_or("");
        let new = eval.rescore(
            output,
            &item,
            r.assessment.reasks,
            only.as_deref(),
            &r.assessment.scores,
            &mut |request| {
                let identity = judge_identities.get(&request.endpoint)?;
                let messages = request.messages.as_ref().ok()?;
                match store.cache_get(&evalfleet_core::cache::key(identity, 0, messages), 0) {
                    Ok(hit) => hit.map(|h| h.content),
                    Err(err) => {
                        lookup_error.get_or_insert(err);
                        None
                    }
                }
            },
        );
        if rejudge && new.verdict == Some(Verdict::Ok) {
            programs.push((judged.len() as u64, Value::Object(item), output.to_owned()));
        }
        judged.push((r.seq, new));
    }
    if let Some(err) = lookup_error {
        return Err(err.into());
    }
    if rejudge && let (Some(settings), Some(key)) = (loaded.config.task.kind.code(), code_key) {
        let started = std::time::Instant::now();
        let count = programs.len();
        let sandbox = super::sandbox_dir(&location, &format!("{}-score", args.run_id));
        rejudge_code(settings, &key, &sandbox, programs, &mut judged).await?;
        eprintln!(
            "Judged {count} programs again in {:.1} s.",
            started.elapsed().as_secs_f64()
        );
    }
    store.put_assessments(&args.run_id, &judged, &snapshot)?;
    let valid = judged.iter().filter(|(_, j)| j.usable()).count();
    eprintln!(
        "Scored {} answers of run {} ({} usable) with {}; no model was called.",
        judged.len(),
        args.run_id,
        valid,
        if keys.is_empty() {
            "no metrics".to_owned()
        } else {
            keys.join(", ")
        }
    );
    if bad_rows > 0 {
        eprintln!(
            "warning: {bad_rows} stored items are not JSON; their references could not be rendered."
        );
    }
    Ok(EXIT_OK)
}

/// Everything a report says about one run. Each result's stored JSON
/// (its scores, its item's category) is read once, here.
struct Scored {
    run: RunRecord,
    eval: Evaluator,
    /// `task.n`.
    samples: u32,
    results: Vec<StoredResult>,
    /// Per result, in the same order: its scores by metric key.
    scores: Vec<Scores>,
    /// Per result: its category for `--by`.
    groups: Vec<String>,
}

fn load(store: &mut dyn Store, run_id: &str, by: &[String]) -> anyhow::Result<Scored> {
    let run = store.run(run_id)?;
    let loaded = stored_config(&run)?;
    let eval = evaluator(&loaded)?;
    let mut results = Vec::new();
    let mut scores = Vec::new();
    let mut groups = Vec::new();
    store.scan_results(run_id, &mut |r| {
        let item: Value = r
            .item
            .as_deref()
            .and_then(|t| serde_json::from_str(t).ok())
            .unwrap_or(Value::Null);
        groups.push(group_of(&item, by));
        scores.push(r.assessment.scores.clone());
        results.push(r);
    })?;
    Ok(Scored {
        run,
        eval,
        samples: loaded.config.task.samples,
        results,
        scores,
        groups,
    })
}

/// The category of an item for `--by`: its fields' values joined by ` / `.
fn group_of(item: &Value, by: &[String]) -> String {
    if by.is_empty() {
        return "all".to_owned();
    }
    by.iter()
        .map(|f| match item.get(f) {
            None | Some(Value::Null) => "(none)".to_owned(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" / ")
}

fn rows(scored: &Scored) -> Vec<Row> {
    scored
        .results
        .iter()
        .zip(&scored.scores)
        .zip(&scored.groups)
        .map(|((r, scores), group)| Row {
            failed: r.status == ItemStatus::Failed,
            verdict: r.assessment.verdict,
            scores: scores.clone(),
            group: group.clone(),
        })
        .collect()
}

/// Structural fidelity: valid on the first try, after re-asks, or not.
fn fidelity(results: &[StoredResult]) -> Value {
    let (mut first, mut later, mut unparsed, mut invalid, mut unchecked, mut failed) =
        (0, 0, 0, 0, 0, 0);
    for r in results {
        match (r.status, r.assessment.verdict) {
            (ItemStatus::Failed, _) => failed += 1,
            (_, Some(Verdict::Ok)) if r.assessment.reasks == 0 => first += 1,
            (_, Some(Verdict::Ok)) => later += 1,
            (_, Some(Verdict::Unparsed)) => unparsed += 1,
            (_, Some(Verdict::Invalid)) => invalid += 1,
            (_, None) => unchecked += 1,
        }
    }
    json!({
        "valid_first_try": first,
        "valid_after_reasks": later,
        "unparsed": unparsed,
        "invalid": invalid,
        "not_checked": unchecked,
        "failed": failed,
    })
}

fn fmt(v: f64) -> String {
    if v.is_nan() {
        "-".to_owned()
    } else {
        format!("{v:.4}")
    }
}

fn endpoint_json(e: &EndpointSummary) -> Value {
    let busy_s = e
        .latency_ms
        .map_or(0.0, |p| p.mean * p.count as f64 / 1000.0);
    json!({
        "endpoint": e.endpoint,
        "attempts": e.attempts,
        "successes": e.successes,
        "errors": e.errors,
        "completion_tokens": e.completion_tokens,
        "tokens_per_second_per_call": if busy_s > 0.0 { e.completion_tokens as f64 / busy_s } else { 0.0 },
        "latency_ms": e.latency_ms,
        "ttft_ms": e.ttft_ms,
        "tpot_ms": e.tpot_ms,
    })
}

/// Runs the code judge again over `programs` (each with its place in
/// `judged`), and puts each judgement and `code_accepted` score (`key`)
/// into `judged`.
async fn rejudge_code(
    settings: &evalfleet_core::judge::CodeSettings,
    key: &str,
    sandbox: &Path,
    programs: Vec<(u64, Value, String)>,
    judged: &mut [(u64, Assessment)],
) -> anyhow::Result<()> {
    let code = evalfleet_core::task::code::CodeJudge::start(settings, sandbox).await?;
    for (place, json, score) in code.judge_again(programs).await {
        let Some((_, j)) = usize::try_from(place).ok().and_then(|i| judged.get_mut(i)) else {
            continue;
        };
        j.scores.insert(key.to_owned(), score);
        j.code = json;
    }
    Ok(())
}

/// `evalfleet report`: a table in the terminal, and CSV and JSON files.
pub fn report(args: ReportArgs) -> anyhow::Result<u8> {
    let (location, mut store) = open_existing(args.store.store)?;
    let scored = load(&mut *store, &args.run_id, &args.by)?;
    let metrics: Vec<_> = scored.eval.metrics().cloned().collect();
    let rows = rows(&scored);
    let summaries = aggregate::summarize(&metrics, &rows);
    let endpoints = summary::endpoints(&mut *store, &args.run_id)?;
    let fidelity = fidelity(&scored.results);
    let models: BTreeMap<String, u64> = scored.results.iter().fold(BTreeMap::new(), |mut m, r| {
        *m.entry(r.model.clone().unwrap_or_else(|| "-".to_owned()))
            .or_insert(0) += 1;
        m
    });

    let dir = args
        .out
        .clone()
        .unwrap_or_else(|| location.dir().join("reports").join(&args.run_id));
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_summary_csv(&dir.join("metrics_summary.csv"), &summaries)?;
    write_detailed_csv(&dir.join("metrics_detailed.csv"), &scored, &metrics)?;
    let samples = samples_summary(&scored, &metrics);
    let code_verdicts = code_verdicts(&scored);
    let summary_json = json!({
        "code_verdicts": code_verdicts,
        "samples": samples,
        "run_id": scored.run.run_id,
        "name": scored.run.name,
        "items": scored.run.total,
        "models": models,
        "group_by": args.by,
        "fidelity": fidelity,
        "metrics": summaries,
        "endpoints": endpoints.iter().map(endpoint_json).collect::<Vec<_>>(),
    });
    let json_path = dir.join("summary.json");
    fs::write(&json_path, serde_json::to_vec_pretty(&summary_json)?)
        .with_context(|| format!("cannot write {}", json_path.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary_json)?);
        return Ok(EXIT_OK);
    }

    println!(
        "Run {} ({} items; model {})",
        scored.run.run_id,
        scored.run.total,
        models.keys().cloned().collect::<Vec<_>>().join(", ")
    );
    if metrics.is_empty() {
        println!(
            "\nNo metrics: add task.metrics to the config and run `evalfleet score {} --config FILE`.",
            scored.run.run_id
        );
    } else {
        let mut table = vec![
            [
                "METRIC", "GROUP", "N", "MEAN", "±SE", "95% CI", "SCORED", "FAILED", "UNPARSED",
                "INVALID",
            ]
            .map(str::to_owned),
        ];
        for s in &summaries {
            table.push([
                s.metric.clone(),
                s.group.clone(),
                s.n.to_string(),
                fmt(s.estimate.mean),
                fmt(s.estimate.stderr),
                format!("{} – {}", fmt(s.estimate.ci_low), fmt(s.estimate.ci_high)),
                s.scored.to_string(),
                s.failed.to_string(),
                s.unparsed.to_string(),
                s.invalid.to_string(),
            ]);
        }
        println!();
        print_table(&table);
        for s in summaries
            .iter()
            .filter(|s| s.group == "all" && !s.extra.is_null())
        {
            println!("\n{} (all): {}", s.metric, s.extra);
        }
    }
    if let Some(list) = samples.get("metrics").and_then(Value::as_array) {
        println!(
            "\nSamples: {} per row over {} rows",
            samples["n"], samples["rows"]
        );
        for m in list {
            println!(
                "  {}: pass@k {}  majority vote {}",
                m["metric"], m["pass_at"], m["majority"]
            );
        }
    }
    if let Some(groups) = code_verdicts.as_object().filter(|g| !g.is_empty()) {
        println!("\nCode judge verdicts:");
        for (group, counts) in groups {
            println!("  {group}: {counts}");
        }
    }
    println!("\nAnswers: {fidelity}");
    let mut table = vec![
        [
            "ENDPOINT",
            "ATTEMPTS",
            "OK",
            "ERRORS",
            "TOK/S/CALL",
            "LATENCY_MS p50/p90/p99",
            "TTFT_MS p50/p90/p99",
            "TPOT_MS p50/p90/p99",
        ]
        .map(str::to_owned),
    ];
    for e in &endpoints {
        let j = endpoint_json(e);
        table.push([
            e.endpoint.clone(),
            e.attempts.to_string(),
            e.successes.to_string(),
            if e.errors.is_empty() {
                "-".to_owned()
            } else {
                e.errors
                    .iter()
                    .map(|(k, v)| format!("{k}:{v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            },
            format!(
                "{:.1}",
                j["tokens_per_second_per_call"].as_f64().unwrap_or(0.0)
            ),
            percentiles(&e.latency_ms),
            percentiles(&e.ttft_ms),
            percentiles(&e.tpot_ms),
        ]);
    }
    println!();
    print_table(&table);
    println!(
        "\nWrote summary.json, metrics_summary.csv and metrics_detailed.csv in {}",
        dir.display()
    );
    Ok(EXIT_OK)
}

/// A result's score for metric `m`; `None` when it failed, its answer was
/// unparsed or invalid, or it has no such score.
fn stored_value(
    r: &StoredResult,
    scores: &Scores,
    m: &evalfleet_core::eval::Metric,
) -> Option<f64> {
    if r.status == ItemStatus::Failed || !r.assessment.usable() {
        return None;
    }
    scores.get(&m.key).and_then(|s| s.value)
}

/// The code judge's problem verdicts, counted overall and per group.
fn code_verdicts(scored: &Scored) -> Value {
    let mut groups: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for (r, group) in scored.results.iter().zip(&scored.groups) {
        let Some(verdict) = r
            .assessment
            .code
            .as_ref()
            .and_then(|j| j.get("verdict").and_then(Value::as_str).map(str::to_owned))
        else {
            continue;
        };
        *groups
            .entry("all".to_owned())
            .or_default()
            .entry(verdict.clone())
            .or_default() += 1;
        if group != "all" {
            *groups
                .entry(group.clone())
                .or_default()
                .entry(verdict)
                .or_default() += 1;
        }
    }
    json!(groups)
}

/// With `task.n` = K > 1: per metric, the unbiased pass@k over each row's
/// K samples (for 0/1 metrics) and the score of the majority answer (the
/// most frequent parsed answer among the row's valid samples; ties go to the
/// one seen first), each averaged over rows.
fn samples_summary(scored: &Scored, metrics: &[evalfleet_core::eval::Metric]) -> Value {
    let k_samples = scored.samples;
    if k_samples <= 1 {
        return Value::Null;
    }
    // Row id → its samples' positions, in order.
    let mut rows: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (at, r) in scored.results.iter().enumerate() {
        let row = evalfleet_core::dataset::split_sample_id(&r.item_id)
            .map_or(r.item_id.as_str(), |(row, _)| row);
        rows.entry(row).or_default().push(at);
    }
    let value = |at: &usize, m| stored_value(&scored.results[*at], &scored.scores[*at], m);
    let ks: Vec<u64> = [1u64, 5, 10, 20, 50, 100]
        .into_iter()
        .filter(|k| *k < u64::from(k_samples))
        .chain([u64::from(k_samples)])
        .collect();
    let mut out = Vec::new();
    for m in metrics {
        let per_row: Vec<Vec<f64>> = rows
            .values()
            .map(|samples| {
                samples
                    .iter()
                    .map(|sample| value(sample, m).unwrap_or_else(|| m.missing()))
                    .collect()
            })
            .collect();
        let binary = per_row.iter().flatten().all(|v| *v == 0.0 || *v == 1.0);
        let pass_at = if binary && m.higher_is_better {
            let mut map = Map::new();
            for &k in &ks {
                let mean = per_row
                    .iter()
                    .map(|v| {
                        stats::pass_at_k(
                            v.len() as u64,
                            v.iter().filter(|x| **x == 1.0).count() as u64,
                            k.min(v.len() as u64),
                        )
                    })
                    .sum::<f64>()
                    / per_row.len().max(1) as f64;
                map.insert(k.to_string(), json!(mean));
            }
            Value::Object(map)
        } else {
            Value::Null
        };
        let majority: Vec<f64> =
            rows.values()
                .map(|samples| {
                    let mut counts: Vec<(String, usize, f64)> = Vec::new();
                    for sample in samples {
                        let r = &scored.results[*sample];
                        let (Some(parsed), Some(v)) = (
                            r.assessment
                                .parsed
                                .as_ref()
                                .map(ToString::to_string)
                                .or_else(|| r.output.clone()),
                            value(sample, m),
                        ) else {
                            continue;
                        };
                        match counts.iter_mut().find(|(p, _, _)| *p == parsed) {
                            Some(entry) => entry.1 += 1,
                            None => counts.push((parsed, 1, v)),
                        }
                    }
                    let best = counts
                        .iter()
                        .fold(None::<&(String, usize, f64)>, |best, c| match best {
                            Some(b) if b.1 >= c.1 => Some(b),
                            _ => Some(c),
                        });
                    best.map_or_else(|| m.missing(), |b| b.2)
                })
                .collect();
        out.push(json!({
            "metric": m.key,
            "pass_at": pass_at,
            "majority": stats::estimate(&majority, 7).mean,
        }));
    }
    json!({ "n": k_samples, "rows": rows.len(), "metrics": out })
}

fn write_summary_csv(path: &PathBuf, summaries: &[Summary]) -> anyhow::Result<()> {
    let mut csv =
        csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
    csv.write_record([
        "metric",
        "group",
        "n",
        "mean",
        "stderr",
        "ci_low",
        "ci_high",
        "mean_scored",
        "scored",
        "failed",
        "unparsed",
        "invalid",
        "errors",
        "extra",
    ])?;
    for s in summaries {
        csv.write_record([
            s.metric.clone(),
            s.group.clone(),
            s.n.to_string(),
            s.estimate.mean.to_string(),
            s.estimate.stderr.to_string(),
            s.estimate.ci_low.to_string(),
            s.estimate.ci_high.to_string(),
            s.mean_scored.to_string(),
            s.scored.to_string(),
            s.failed.to_string(),
            s.unparsed.to_string(),
            s.invalid.to_string(),
            s.errors.to_string(),
            if s.extra.is_null() {
                String::new()
            } else {
                s.extra.to_string()
            },
        ])?;
    }
    csv.flush()?;
    Ok(())
}

fn write_detailed_csv(
    path: &PathBuf,
    scored: &Scored,
    metrics: &[evalfleet_core::eval::Metric],
) -> anyhow::Result<()> {
    let mut csv =
        csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
    let mut header: Vec<String> = [
        "item_id",
        "group",
        "status",
        "verdict",
        "reasks",
        "parsed",
        "check_error",
    ]
    .map(str::to_owned)
    .to_vec();
    header.extend(metrics.iter().map(|m| m.key.clone()));
    csv.write_record(&header)?;
    for ((r, scores), group) in scored
        .results
        .iter()
        .zip(&scored.scores)
        .zip(&scored.groups)
    {
        let mut record = vec![
            r.item_id.clone(),
            group.clone(),
            r.status.to_string(),
            r.assessment
                .verdict
                .map(|v| v.to_string())
                .unwrap_or_default(),
            r.assessment.reasks.to_string(),
            r.assessment
                .parsed
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            r.assessment.check_error.clone().unwrap_or_default(),
        ];
        for m in metrics {
            record.push(
                scores
                    .get(&m.key)
                    .and_then(|s| s.value)
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            );
        }
        csv.write_record(&record)?;
    }
    csv.flush()?;
    Ok(())
}

/// `evalfleet compare`: runs side by side per metric and category, each
/// against the first on the items they share.
pub fn compare(args: CompareArgs) -> anyhow::Result<u8> {
    if args.runs.len() < 2 {
        return Err(UsageError("compare needs at least two runs".to_owned()).into());
    }
    let (_, mut store) = open_existing(args.store.store)?;
    let runs: Vec<Scored> = args
        .runs
        .iter()
        .map(|id| load(&mut *store, id, &args.by))
        .collect::<anyhow::Result<_>>()?;
    let base = &runs[0];
    let keys: Vec<evalfleet_core::eval::Metric> = base
        .eval
        .metrics()
        .filter(|m| {
            runs[1..]
                .iter()
                .all(|r| r.eval.metrics().any(|o| o.key == m.key))
        })
        .cloned()
        .collect();
    if keys.is_empty() {
        return Err(UsageError(
            "the runs share no metric (compare uses the metrics every run has)".to_owned(),
        )
        .into());
    }
    // A result's value (missing as the worst), by run and position.
    let value_of = |run: &Scored, at: usize, m: &evalfleet_core::eval::Metric| -> f64 {
        stored_value(&run.results[at], &run.scores[at], m).unwrap_or_else(|| m.missing())
    };
    // Per run: item id → position.
    let indexed: Vec<HashMap<&str, usize>> = runs
        .iter()
        .map(|r| {
            r.results
                .iter()
                .enumerate()
                .map(|(i, x)| (x.item_id.as_str(), i))
                .collect()
        })
        .collect();
    let mut out = Vec::new();
    let mut table = vec![
        [
            "METRIC",
            "GROUP",
            "RUN",
            "N",
            "MEAN",
            "DIFF vs FIRST",
            "95% CI",
            "p (bootstrap)",
            "p (McNemar)",
        ]
        .map(str::to_owned),
    ];
    for m in &keys {
        for (i, run) in runs.iter().enumerate().skip(1) {
            // Items both runs answered, grouped.
            let mut groups: BTreeMap<String, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
            for (at, r) in base.results.iter().enumerate() {
                if let Some(&other) = indexed[i].get(r.item_id.as_str()) {
                    let group = base.groups[at].clone();
                    let (va, vb) = (value_of(base, at, m), value_of(run, other, m));
                    let all = groups.entry("all".to_owned()).or_default();
                    all.0.push(va);
                    all.1.push(vb);
                    if group != "all" {
                        let entry = groups.entry(group).or_default();
                        entry.0.push(va);
                        entry.1.push(vb);
                    }
                }
            }
            for (group, (a, b)) in &groups {
                let p = stats::paired(a, b, 17);
                let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
                if i == 1 {
                    table.push([
                        m.key.clone(),
                        group.clone(),
                        base.run.run_id.clone(),
                        a.len().to_string(),
                        fmt(mean(a)),
                        "-".into(),
                        "-".into(),
                        "-".into(),
                        "-".into(),
                    ]);
                }
                table.push([
                    m.key.clone(),
                    group.clone(),
                    run.run.run_id.clone(),
                    b.len().to_string(),
                    fmt(mean(b)),
                    format!("{:+.4}", p.diff),
                    format!("{} – {}", fmt(p.ci_low), fmt(p.ci_high)),
                    fmt(p.p_bootstrap),
                    p.p_mcnemar.map_or_else(|| "-".to_owned(), fmt),
                ]);
                out.push(json!({
                    "metric": m.key, "group": group, "a": base.run.run_id, "b": run.run.run_id,
                    "n": a.len(), "mean_a": mean(a), "mean_b": mean(b), "paired": p,
                }));
            }
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&table);
        let _ = std::io::stdout().flush();
    }
    Ok(EXIT_OK)
}

/// `evalfleet cache stats|clear`.
pub fn cache(args: CacheArgs) -> anyhow::Result<u8> {
    let (location, mut store) = open_existing(args.store)?;
    match args.action {
        CacheAction::Stats { json } => {
            let stats = store.cache_stats()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&stats)?);
            } else {
                println!("store:    {location}");
                println!("entries:  {}", stats.entries);
                println!("answers:  {:.1} MB", stats.content_bytes as f64 / 1e6);
                let when = |ms: Option<i64>| ms.map_or_else(|| "-".to_owned(), super::timestamp);
                println!("oldest:   {}", when(stats.oldest_ms));
                println!("newest:   {}", when(stats.newest_ms));
                println!("hits:     {} attempts answered from the cache", stats.hits);
            }
        }
        CacheAction::Clear => {
            let gone = store.cache_clear()?;
            println!("Deleted {gone} cached answers from {location}.");
        }
    }
    Ok(EXIT_OK)
}
