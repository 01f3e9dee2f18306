//! `evalfleet score`, `report` and `compare`: what the stored answers are
//! worth. None of them calls a model. The figures are the core's
//! (`evalfleet_reports`, `evalfleet_core::rescore`); this module only
//! renders them as tables, CSV and JSON.

use std::fs;
use std::io::Write;
use std::path::Path;

use anyhow::Context;
use evalfleet_config::{self as config, Overrides};
use evalfleet_core::rescore::Plan;
use evalfleet_eval::Metric;
use evalfleet_reports::metrics::Summary;
use evalfleet_reports::{self as report, Report};
use evalfleet_store::OpenOptions;
use evalfleet_store::StoredResult;

use super::inspect::{percentiles, print_table};
use super::{open_existing, open_to_read};
use crate::cli::{CacheAction, CacheArgs, CompareArgs, ReportArgs, ScoreArgs};
use crate::{EXIT_INTERRUPTED, EXIT_OK};

/// `evalfleet score`: parses, checks and scores the stored outputs again;
/// with `--rejudge` (or a changed `task.code`), runs the code judge again.
pub async fn score(mut args: ScoreArgs) -> anyhow::Result<u8> {
    let (location, mut store) = open_existing(args.store.store)?;
    args.run_id = evalfleet_store::resolve_run_id(&mut *store, &args.run_id)?;
    let new = match &args.config {
        Some(file) => Some(config::load_file(file, Overrides::default())?),
        None => None,
    };
    let plan = Plan::new(
        &mut *store,
        &args.run_id,
        new.as_ref(),
        &args.metrics,
        args.rejudge,
    )?;
    let plan = if args.unjudged {
        plan.unjudged_only(std::sync::Arc::new(crate::fleet::InProcessMocks))
    } else {
        plan
    };
    if let Some(file) = plan.cache_file() {
        store = evalfleet_store::open(
            &location,
            &OpenOptions {
                create: false,
                cache_file: Some(file.clone()),
                ..OpenOptions::default()
            },
        )?;
    }
    let sandbox = super::sandbox_dir(&location, &format!("{}-score", args.run_id));
    // Ctrl-C drops the scoring, and with it a metric backend's setup (its
    // process group is killed): nothing is stored.
    let done = tokio::select! {
        done = plan.apply(&mut *store, &sandbox) => done?,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("Stopped; run {} was not changed.", args.run_id);
            return Ok(EXIT_INTERRUPTED);
        }
    };
    if let Some((count, took)) = done.rejudged {
        eprintln!(
            "Judged {count} programs again in {:.1} s.",
            took.as_secs_f64()
        );
    }
    if done.judged_again > 0 {
        eprintln!(
            "Asked the LLM judges again for {} answers they could not judge in the run{}.",
            done.judged_again,
            if done.judged_again_failed > 0 {
                format!(
                    "; {} failed again and stay not scored",
                    done.judged_again_failed
                )
            } else {
                String::new()
            }
        );
    }
    eprintln!(
        "Scored {} answers of run {} ({} usable) with {}; {}.",
        done.answers,
        args.run_id,
        done.usable,
        if done.metrics.is_empty() {
            "no metrics".to_owned()
        } else {
            done.metrics.join(", ")
        },
        if done.judged_again > 0 {
            "no model but the judges was called"
        } else {
            "no model was called"
        }
    );
    if done.backend_scored > 0 {
        eprintln!(
            "Sent {} usable answers to the metric backends.",
            done.backend_scored
        );
    }
    if let Some(first) = &done.backend_error {
        eprintln!(
            "warning: {} backend scores are errors (not scored, in no mean); the first: {first}",
            done.backend_errors
        );
    }
    if done.unreadable > 0 {
        eprintln!(
            "warning: {} stored items are not JSON; their references could not be rendered.",
            done.unreadable
        );
    }
    let scored = report::report_with(&mut *store, &args.run_id, &[], None, &mut |_, _, _| {})?;
    crate::ui::note(&format!("Run {}: {}", args.run_id, scored.outcome.line()));
    crate::attend::print_causes(&scored.outcome);
    Ok(crate::attend::outcome_code(&scored))
}

fn fmt(v: f64) -> String {
    if v.is_nan() {
        "-".to_owned()
    } else {
        format!("{v:.4}")
    }
}

/// `evalfleet report`: a table in the terminal, and CSV and JSON files.
pub fn report(mut args: ReportArgs) -> anyhow::Result<u8> {
    let (location, mut store) = open_to_read(args.store.store)?;
    // The run must exist before anything is made for it.
    args.run_id = evalfleet_store::resolve_run_id(&mut *store, &args.run_id)?;
    // The files go to `--out`, else beside the store; a store the user may
    // not write still has its report, in the terminal.
    let dir = match &args.out {
        Some(out) => {
            fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
            Some(out.clone())
        }
        None => {
            let dir = location.dir().join("reports").join(&args.run_id);
            match fs::create_dir_all(&dir) {
                Ok(()) => Some(dir),
                Err(err) => {
                    eprintln!(
                        "note: the report's files are not written: cannot create {} ({err}); pass --out DIR to write them elsewhere",
                        dir.display()
                    );
                    None
                }
            }
        }
    };
    let mut detailed = dir
        .as_ref()
        .map(|dir| DetailedCsv::create(&dir.join("metrics_detailed.csv")))
        .transpose()?;
    let mut report = report::report_with(
        &mut *store,
        &args.run_id,
        &args.by,
        args.max_unscored,
        &mut |metrics, result, group| {
            if let Some(detailed) = detailed.as_mut() {
                detailed.add(metrics, result, group);
            }
        },
    )?;
    report.endpoints = report::endpoints(&mut *store, &args.run_id)?;
    report.resources = report::resources(&mut *store, &args.run_id)?;
    report.agents = report::agents(&mut *store, &args.run_id)?;
    let json = serde_json::to_string_pretty(&report)?;
    if let (Some(dir), Some(detailed)) = (&dir, detailed) {
        detailed.finish(&report.metrics)?;
        write_summary_csv(&dir.join("metrics_summary.csv"), &report.metrics)?;
        let json_path = dir.join("summary.json");
        fs::write(&json_path, &json)
            .with_context(|| format!("cannot write {}", json_path.display()))?;
    }
    if let Some(html) = &args.html {
        fs::write(html, evalfleet_server::pages::report_html(&report))
            .with_context(|| format!("cannot write {}", html.display()))?;
        eprintln!("Wrote the report as a page: {}", html.display());
    }
    if args.json {
        println!("{json}");
    } else {
        print_report(&report);
        print_resources(&report.resources);
        print_agents(report.agents.as_ref());
        if let Some(dir) = &dir {
            println!(
                "\nWrote summary.json, metrics_summary.csv and metrics_detailed.csv in {}",
                dir.display()
            );
        }
    }
    Ok(crate::attend::unusable_scores(&report))
}

/// The report by group, one row a group (overall first): each metric's
/// mean and interval, and how the answers turned out.
fn print_groups(report: &Report) {
    if report.group_by.is_empty() {
        return;
    }
    let Some(all) = report.groups.first() else {
        return;
    };
    let mut header = vec![
        report.group_by.join(" / ").to_uppercase(),
        "ITEMS".to_owned(),
    ];
    header.extend(all.metrics.iter().map(|m| m.metric.clone()));
    header.extend(["VALID FIRST", "AFTER RE-ASKS", "INVALID", "FAILED"].map(str::to_owned));
    let mut table = vec![header];
    for g in &report.groups {
        let mut row = vec![g.group.clone(), g.items.to_string()];
        row.extend(g.metrics.iter().map(|m| match m.status {
            report::metrics::NO_ANSWERS => "no score: 0 answered".to_owned(),
            "not scored" => "not scored".to_owned(),
            _ => format!(
                "{} [{}, {}]",
                fmt(m.estimate.mean),
                fmt(m.estimate.ci_low),
                fmt(m.estimate.ci_high)
            ),
        }));
        let f = &g.fidelity;
        row.push(f.valid_first_try.to_string());
        row.push(f.valid_after_reasks.to_string());
        row.push((f.unparsed + f.invalid).to_string());
        row.push(f.failed.to_string());
        table.push(row);
    }
    println!("\nBy {}:", report.group_by.join(" / "));
    print_table(&table);
}

fn print_report(report: &Report) {
    println!(
        "Run {} ({} items; model {})",
        report.run_id,
        report.items,
        report.models.keys().cloned().collect::<Vec<_>>().join(", ")
    );
    println!("Outcome: {}", report.outcome.line());
    for line in report.outcome.cause_lines() {
        println!("  {line}");
    }
    if report.metrics.is_empty() {
        println!(
            "\nNo metrics: add task.metrics to the config and run `evalfleet score {} --config FILE`.",
            report.run_id
        );
    } else {
        let mut table = vec![
            [
                "METRIC",
                "GROUP",
                "N",
                "MEAN",
                "±SE",
                "95% CI",
                "SCORED",
                "NOT SCORED",
                "FAILED",
                "UNPARSED",
                "INVALID",
            ]
            .map(str::to_owned),
        ];
        for s in &report.metrics {
            let dash = || "-".to_owned();
            table.push([
                s.metric.clone(),
                s.group.clone(),
                s.n.to_string(),
                s.value_text(4),
                if s.has_value() {
                    fmt(s.estimate.stderr)
                } else {
                    dash()
                },
                if s.has_value() {
                    format!("{} – {}", fmt(s.estimate.ci_low), fmt(s.estimate.ci_high))
                } else {
                    dash()
                },
                s.scored.to_string(),
                s.errors.to_string(),
                s.failed.to_string(),
                s.unparsed.to_string(),
                s.invalid.to_string(),
            ]);
        }
        println!();
        print_table(&table);
        for s in report
            .metrics
            .iter()
            .filter(|s| s.group == report::metrics::ALL && s.errors > 0)
        {
            println!(
                "\n{} {}: {} of {} items could not be scored, and are in no mean: {}",
                s.metric,
                s.status,
                s.errors,
                s.n,
                s.reasons_line()
            );
        }
        for s in report
            .metrics
            .iter()
            .filter(|s| s.group == report::metrics::ALL && s.lost > 0)
        {
            println!(
                "\n{}: {} of {} items failed for the server's sake (refused, cut off, timed out, or its own error), and are in no mean; `resume --retry-failed` answers them again",
                s.metric, s.lost, s.n
            );
        }
        for s in report
            .metrics
            .iter()
            .filter(|s| s.group == report::metrics::ALL && !s.extra.is_none())
        {
            println!(
                "\n{} (all): {}",
                s.metric,
                serde_json::to_string(&s.extra).unwrap_or_default()
            );
        }
    }
    if let Some(samples) = &report.samples {
        println!(
            "\nSamples: {} per row over {} rows",
            samples.n, samples.rows
        );
        for m in &samples.metrics {
            println!(
                "  {}: pass@k {}  majority vote {}",
                m.metric,
                serde_json::to_string(&m.pass_at).unwrap_or_default(),
                fmt(m.majority)
            );
        }
    }
    if !report.code_verdicts.is_empty() {
        println!("\nCode judge verdicts:");
        for (group, counts) in &report.code_verdicts {
            println!(
                "  {group}: {}",
                serde_json::to_string(counts).unwrap_or_default()
            );
        }
    }
    println!(
        "\nAnswers: {}",
        serde_json::to_string(&report.fidelity).unwrap_or_default()
    );
    if !report.prompts.is_empty() {
        println!(
            "Prompts: {}",
            serde_json::to_string(&report.prompts).unwrap_or_default()
        );
    }
    print_groups(report);
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
    for e in &report.endpoints {
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
            format!("{:.1}", e.tokens_per_second_per_call),
            percentiles(&e.latency_ms),
            percentiles(&e.ttft_ms),
            percentiles(&e.tpot_ms),
        ]);
    }
    println!();
    print_table(&table);
}

/// Each resource series' peak and mean (`telemetry:`).
fn print_resources(resources: &report::ResourcesReport) {
    if resources.is_empty() {
        return;
    }
    let mut table = vec![["RESOURCE", "PEAK", "MEAN", "SAMPLES"].map(str::to_owned)];
    for s in &resources.series {
        table.push([
            s.series.label(),
            format!("{:.1}", s.peak),
            format!("{:.1}", s.mean),
            s.samples.to_string(),
        ]);
    }
    println!();
    print_table(&table);
}

/// The agents' calls per item (`kind: exec`): mean and 95% interval of
/// calls, tokens and call time.
fn print_agents(agents: Option<&report::AgentFigures>) {
    let Some(a) = agents else {
        return;
    };
    println!(
        "\nAgents: {} calls for {} items ({} failed, {} from the cache; {})",
        a.calls,
        a.items,
        a.failed_calls,
        a.cached_calls,
        a.apis
            .iter()
            .map(|(api, n)| format!("{api} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut table = vec![["PER ITEM", "MEAN", "95% INTERVAL"].map(str::to_owned)];
    for (what, e) in [
        ("calls", &a.calls_per_item),
        ("tokens", &a.tokens_per_item),
        ("call time (ms)", &a.call_ms_per_item),
        ("attempts", &a.attempts_per_item),
    ] {
        table.push([
            what.to_owned(),
            format!("{:.1}", e.mean),
            format!("[{:.1}, {:.1}]", e.ci_low, e.ci_high),
        ]);
    }
    print_table(&table);
}

fn write_summary_csv(path: &Path, summaries: &[Summary]) -> anyhow::Result<()> {
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
        "status",
        "reasons",
        "extra",
        "lost",
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
            s.status.to_owned(),
            s.reasons_line(),
            if s.extra.is_none() {
                String::new()
            } else {
                serde_json::to_string(&s.extra)?
            },
            s.lost.to_string(),
        ])?;
    }
    csv.flush()?;
    Ok(())
}

/// `metrics_detailed.csv`: one line per result, written as the report
/// reads them (the run is not held in memory).
struct DetailedCsv {
    csv: csv::Writer<fs::File>,
    /// The metrics' keys, once the header is written.
    keys: Option<Vec<String>>,
    failed: Option<csv::Error>,
}

impl DetailedCsv {
    fn create(path: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            csv: csv::Writer::from_path(path)
                .with_context(|| format!("cannot write {}", path.display()))?,
            keys: None,
            failed: None,
        })
    }

    fn header(&mut self, keys: Vec<String>) -> Result<(), csv::Error> {
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
        header.extend(keys.iter().cloned());
        self.keys = Some(keys);
        self.csv.write_record(&header)
    }

    fn add(&mut self, metrics: &[Metric], r: &StoredResult, group: &str) {
        if self.failed.is_some() {
            return;
        }
        if self.keys.is_none()
            && let Err(err) = self.header(metrics.iter().map(|m| m.key.clone()).collect())
        {
            self.failed = Some(err);
            return;
        }
        let a = &r.assessment;
        let mut record = vec![
            r.item_id.clone(),
            group.to_owned(),
            r.status.to_string(),
            a.verdict.map(|v| v.to_string()).unwrap_or_default(),
            a.reasks.to_string(),
            a.parsed
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            a.check_error.clone().unwrap_or_default(),
        ];
        for key in self.keys.iter().flatten() {
            record.push(
                a.scores
                    .get(key)
                    .and_then(|s| s.value)
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            );
        }
        if let Err(err) = self.csv.write_record(&record) {
            self.failed = Some(err);
        }
    }

    /// Ends the file; `metrics` gives the header when no result came.
    fn finish(mut self, metrics: &[report::metrics::Summary]) -> anyhow::Result<()> {
        if let Some(err) = self.failed {
            return Err(err.into());
        }
        if self.keys.is_none() {
            let keys = metrics
                .iter()
                .filter(|s| s.group == report::metrics::ALL)
                .map(|s| s.metric.clone())
                .collect();
            self.header(keys)?;
        }
        self.csv.flush()?;
        Ok(())
    }
}

/// `evalfleet compare`: runs side by side per metric and category, each
/// against the first on the items they share.
pub fn compare(mut args: CompareArgs) -> anyhow::Result<u8> {
    let (_, mut store) = open_to_read(args.store.store)?;
    for run in &mut args.runs {
        *run = evalfleet_store::resolve_run_id(&mut *store, run)?;
    }
    let compared = report::compare(&mut *store, &args.runs, &args.by, None, 0)?;
    // Runs of different items are compared on the items they share: said
    // first, on stderr, so that `--json` stays the comparisons alone.
    for coverage in &compared.coverage {
        if let Some(warning) = coverage.warning() {
            eprintln!("warning: {warning}");
        }
    }
    let comparisons = compared.comparisons;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&comparisons)?);
        return Ok(EXIT_OK);
    }
    // Each run's outcome first; a run not complete is marked in the table.
    let incomplete: std::collections::HashSet<&str> = compared
        .outcomes
        .iter()
        .filter(|o| !o.outcome.is_complete())
        .map(|o| o.run_id.as_str())
        .collect();
    for o in &compared.outcomes {
        println!("{}: {}", o.run_id, o.outcome.line());
    }
    if !incomplete.is_empty() {
        println!("* not complete: its figures are over fewer items than it has");
    }
    println!();
    let marked = |run: &str| {
        if incomplete.contains(run) {
            format!("{run} *")
        } else {
            run.to_owned()
        }
    };
    let mut table = vec![
        [
            "METRIC",
            "GROUP",
            "RUN",
            "N",
            "MEAN",
            "DIFF vs FIRST",
            "95% CI",
            "p (paired)",
            "p (McNemar)",
        ]
        .map(str::to_owned),
    ];
    let mut shown_first = std::collections::HashSet::new();
    for c in &comparisons {
        // The first run's own line, once per metric and category.
        if shown_first.insert((c.metric.clone(), c.group.clone())) {
            table.push([
                c.metric.clone(),
                c.group.clone(),
                marked(&c.a),
                c.n.to_string(),
                fmt(c.mean_a),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
        }
        let p = &c.paired;
        table.push([
            c.metric.clone(),
            c.group.clone(),
            marked(&c.b),
            c.n.to_string(),
            fmt(c.mean_b),
            format!("{:+.4}", p.diff),
            format!("{} – {}", fmt(p.ci_low), fmt(p.ci_high)),
            fmt(p.p_value),
            p.p_mcnemar.map_or_else(|| "-".to_owned(), fmt),
        ]);
    }
    print_table(&table);
    let _ = std::io::stdout().flush();
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
                println!("hits:     {} calls answered from the cache", stats.hits);
            }
        }
        CacheAction::Clear => {
            let gone = store.cache_clear()?;
            println!("Deleted {gone} cached answers from {location}.");
        }
    }
    Ok(EXIT_OK)
}
