//! Stores with runs in them, registered by the core from a real dataset
//! and answered through the store's own commit path.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use evalfleet_config::{self as config, Overrides};
use evalfleet_io::template::Templates;
use evalfleet_server::{AppState, ServerOptions};
use evalfleet_store::prelude::*;
use evalfleet_store::{Batch, Claimed};
use evalfleet_store::{Location, OpenOptions};
use evalfleet_types::{
    Assessment, AttemptRecord, EndpointSample, EndpointState, ErrorClass, ItemStatus, Quantiles,
    ResultRecord, RunSample, RunStatus, Score, StateCounts, Telemetry,
};

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub location: Location,
}

/// A config of the dataset `dataset`, scored by exact match.
fn config_text(dataset: &Path) -> String {
    format!(
        "name: capitals\n\
         dataset: {{ path: {}, id_field: id }}\n\
         endpoints:\n  - {{ name: e, kind: external, base_url: \"http://127.0.0.1:9/v1\", model: m, api_key: sk-very-secret }}\n\
         task:\n  messages:\n    - {{ role: user, content: \"Capital of {{{{ country }}}}?\" }}\n  \
         metrics:\n    - {{ name: exact_match, reference: \"{{{{ capital }}}}\" }}\n",
        dataset.display()
    )
}

const COUNTRIES: [(&str, &str, &str); 8] = [
    ("fr", "France", "Paris"),
    ("de", "Germany", "Berlin"),
    ("it", "Italy", "Rome"),
    ("es", "Spain", "Madrid"),
    ("jp", "Japan", "Tokyo"),
    ("ke", "Kenya", "Nairobi"),
    ("pe", "Peru", "Lima"),
    ("no", "Norway", "Oslo"),
];

impl Fixture {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut text = String::new();
        for (i, (id, country, capital)) in COUNTRIES.iter().enumerate() {
            let region = if i < 4 { "europe" } else { "elsewhere" };
            text.push_str(&format!(
                "{{\"id\": \"{id}\", \"country\": \"{country}\", \"capital\": \"{capital}\", \"region\": \"{region}\"}}\n"
            ));
        }
        std::fs::write(dir.path().join("items.jsonl"), text).unwrap();
        let location = Location::parse(&dir.path().join("store.db").to_string_lossy()).unwrap();
        Self { dir, location }
    }

    pub fn store(&self) -> Box<dyn Store> {
        evalfleet_store::open(
            &self.location,
            &OpenOptions {
                create: true,
                ..OpenOptions::default()
            },
        )
        .unwrap()
    }

    /// Registers run `run_id` and answers it: `right(i)` says whether item
    /// `i` was answered right; the last item stays pending, the one before
    /// it fails after a 500.
    pub fn run(&self, run_id: &str, right: impl Fn(usize) -> bool) {
        self.run_on(run_id, "items.jsonl", COUNTRIES.len(), right);
    }

    /// [`run`](Self::run) of the dataset `dataset` in the fixture's
    /// directory, made of the first `count` countries when absent.
    pub fn run_on(&self, run_id: &str, dataset: &str, count: usize, right: impl Fn(usize) -> bool) {
        let dataset = self.dir.path().join(dataset);
        if !dataset.exists() {
            let mut text = String::new();
            for (i, (id, country, capital)) in COUNTRIES.iter().take(count).enumerate() {
                let region = if i < 4 { "europe" } else { "elsewhere" };
                text.push_str(&format!(
                    "{{\"id\": \"{id}\", \"country\": \"{country}\", \"capital\": \"{capital}\", \"region\": \"{region}\"}}\n"
                ));
            }
            std::fs::write(&dataset, text).unwrap();
        }
        let config_path = self.dir.path().join("run.yaml");
        std::fs::write(&config_path, config_text(&dataset)).unwrap();
        let loaded = config::load_file(&config_path, Overrides::default()).unwrap();
        let templates = Templates::compile(&loaded.config.task).unwrap();
        let mut store = self.store();
        evalfleet_core::run::create(&mut *store, &loaded, &templates, run_id).unwrap();
        let mut worker = evalfleet_store::worker::this_process(Duration::from_secs(60));
        store.begin_session(run_id, &mut worker, false).unwrap();
        let Claimed::Items(claim) = store
            .claim(run_id, &worker.worker, None, 100, Duration::from_secs(60))
            .unwrap()
        else {
            panic!("nothing to claim");
        };
        let mut batch = Batch::default();
        let n = claim.items.len();
        for (i, item) in claim.items.iter().enumerate().take(n - 1) {
            let (_, country, capital) = COUNTRIES[i];
            let telemetry = Telemetry {
                endpoint: "e".to_owned(),
                model: "m".to_owned(),
                latency_ms: 100.0 + i as f64,
                completion_tokens: Some(3),
                ..Telemetry::default()
            };
            let failed = i == n - 2;
            let answer = if right(i) { capital } else { "London" };
            let mut assessment = Assessment::default();
            if !failed {
                assessment.scores.insert(
                    "exact_match@1".to_owned(),
                    Score::value(if right(i) { 1.0 } else { 0.0 }),
                );
            }
            batch.attempts.push((
                claim.id,
                AttemptRecord {
                    seq: item.seq,
                    attempt: 1,
                    session: 1,
                    sent_at_ms: 1,
                    telemetry: telemetry.clone(),
                    http_status: Some(if failed { 500 } else { 200 }),
                    error_class: failed.then_some(ErrorClass::Retryable),
                    error: failed.then(|| "HTTP 500".to_owned()),
                },
            ));
            batch.results.push((
                claim.id,
                ResultRecord {
                    seq: item.seq,
                    item_id: item.item_id.clone(),
                    status: if failed {
                        ItemStatus::Failed
                    } else {
                        ItemStatus::Done
                    },
                    output: (!failed).then(|| answer.to_owned()),
                    error: failed.then(|| "gave up after 1 attempts: HTTP 500".to_owned()),
                    telemetry: Some(telemetry),
                    attempts: 1,
                    cached: 0,
                    item: Some(format!(
                        "{{\"id\": \"{}\", \"country\": \"{country}\", \"capital\": \"{capital}\", \"region\": \"{}\"}}",
                        item.item_id,
                        if i < 4 { "europe" } else { "elsewhere" }
                    )),
                    finished_at_ms: 1,
                    assessment,
                    prompt: None,
                    images: Vec::new(),
                },
            ));
        }
        store.commit(run_id, &worker.worker, &batch).unwrap();
        // Three seconds of its timeline.
        for second in 1..=3u64 {
            store
                .add_sample(
                    run_id,
                    &RunSample {
                        at_ms: 1_000_000 + second as i64 * 1000,
                        worker: worker.worker.clone(),
                        counts: StateCounts {
                            pending: 8 - 2 * second,
                            done: 2 * second,
                            failed: 0,
                        },
                        endpoints: vec![EndpointSample {
                            endpoint: "e".to_owned(),
                            state: EndpointState::Healthy,
                            limit: 4,
                            in_flight: 2,
                            calls: 2,
                            successes: 2,
                            failures: 0,
                            completion_tokens: 6,
                            latency_ms: Some(Quantiles {
                                p50: 100.0,
                                p90: 105.0,
                                p99: 107.0,
                            }),
                            ttft_ms: None,
                            tpot_ms: None,
                            quota_pauses: 0,
                        }],
                    },
                )
                .unwrap();
        }
        store.release(run_id, &worker.worker).unwrap();
    }

    /// Marks run `run_id` finished, as its last worker does.
    pub fn finish(&self, run_id: &str) {
        self.store()
            .set_status(run_id, RunStatus::Finished, None)
            .unwrap();
    }

    pub fn state(&self, api_key: Option<&str>) -> Arc<AppState> {
        self.state_with(api_key, false)
    }

    /// The same, for a server that writes nothing (`--read-only`) or not.
    pub fn state_with(&self, api_key: Option<&str>, read_only: bool) -> Arc<AppState> {
        let location = self.location.clone();
        AppState::new(ServerOptions {
            open: Arc::new(move || evalfleet_store::open(&location, &OpenOptions::default())),
            api_key: api_key.map(str::to_owned),
            hosts: evalfleet_server::HostPolicy::loopback(),
            admission: evalfleet_config::Admission {
                roots: vec![std::fs::canonicalize(self.dir.path()).unwrap()],
                ..Default::default()
            },
            control: None,
            read_only,
            body_limit: 1 << 16,
            benches: Some(self.location.clone()),
        })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}
