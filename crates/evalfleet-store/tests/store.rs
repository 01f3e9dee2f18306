//! The store suite: registration, exactly-once commits, counts, the work
//! queue (exclusive claims, leases, fencing, waits, attempt numbering),
//! resume bookkeeping, export order, pages of items, the cache, kept
//! reports, resource series and agent calls. Each test goes through the
//! store's traits only and runs against both backends (`both!`): as
//! `NAME::sqlite`, on a SQLite file, and as `NAME::postgres`, on a scratch
//! database of the PostgreSQL server of `evalfleet_testkit` (skipped, saying
//! so, when none answers). What is about one backend only is in
//! `sqlite_only` and `postgres_only`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use evalfleet_store::prelude::*;
use evalfleet_store::{
    Batch, ClaimId, Claimed, CreateRunError, ItemPage, ItemQuery, ItemState, KEPT_PER_RUN, NewRun,
    NotBefore, ScoreRange, SortKey, StoreError,
};
mod common;

use common::{items, worker};
use evalfleet_store::{Location, OpenOptions};
use evalfleet_testkit::postgres::ScratchDb;
use evalfleet_types::{
    AgentCall, Assessment, AttemptRecord, CacheEntry, ErrorClass, ItemStatus, ResultRecord,
    RunStatus, StateCounts, Telemetry,
};

/// The backend a test of the suite runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Sqlite,
    Postgres,
}

/// The store of one test: a SQLite file in a folder of the test's own, or
/// a scratch database on the PostgreSQL server; a test opens as many
/// connections to it as it needs workers.
struct Fixture {
    backend: Backend,
    location: Location,
    /// The SQLite file's folder (empty for PostgreSQL).
    _dir: tempfile::TempDir,
    /// The scratch database, dropped with the fixture.
    db: Option<ScratchDb>,
}

impl Fixture {
    /// An empty store; `None` when no PostgreSQL server answers (the test
    /// says it is skipped, or fails under `CI=true`).
    fn new(backend: Backend) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let (location, db) = match backend {
            Backend::Sqlite => (Location::Sqlite(dir.path().join("store.db")), None),
            Backend::Postgres => {
                let db = evalfleet_testkit::scratch_db!()?;
                (Location::Postgres(db.url.clone()), Some(db))
            }
        };
        Some(Self {
            backend,
            location,
            _dir: dir,
            db,
        })
    }

    /// A new connection to the store, made on the first.
    fn open(&self) -> Box<dyn Store> {
        let options = OpenOptions {
            create: true,
            ..OpenOptions::default()
        };
        evalfleet_store::open(&self.location, &options).unwrap()
    }

    /// A connection that only reads the store (which exists).
    fn open_read_only(&self) -> Box<dyn Store> {
        evalfleet_store::open(&self.location, &OpenOptions::read_only()).unwrap()
    }

    /// Counts item states the slow way, from the tables behind the traits'
    /// back, to check the counts the store keeps (SQLite: counters in
    /// `runs`; PostgreSQL: the sums of `tallies`). On PostgreSQL an item
    /// `running` (claimed) is pending.
    fn recount(&self, run_id: &str) -> StateCounts {
        let rows: Vec<(String, u64)> = match (&self.location, &self.db) {
            (Location::Sqlite(path), _) => {
                let conn = rusqlite::Connection::open(path).unwrap();
                let mut stmt = conn
                    .prepare(
                        "SELECT i.state, COUNT(*) FROM items i JOIN runs r ON r.rid = i.rid
                         WHERE r.run_id = ?1 GROUP BY i.state",
                    )
                    .unwrap();
                stmt.query_map([run_id], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64))
                })
                .unwrap()
                .map(Result::unwrap)
                .collect()
            }
            (Location::Postgres(_), Some(db)) => {
                let mut sql = self.sql(db);
                sql.query(
                    "SELECT CASE i.state WHEN 'running' THEN 'pending' ELSE i.state END,
                            COUNT(*)
                     FROM items i JOIN runs r ON r.rid = i.rid
                     WHERE r.run_id = $1 GROUP BY 1",
                    &[&run_id],
                )
                .unwrap()
                .iter()
                .map(|row| (row.get(0), row.get::<_, i64>(1) as u64))
                .collect()
            }
            (Location::Postgres(_), None) => unreachable!("a PostgreSQL fixture has its database"),
        };
        let mut counts = StateCounts::default();
        for (state, n) in rows {
            match state.as_str() {
                "pending" => counts.pending += n,
                "done" => counts.done += n,
                "failed" => counts.failed += n,
                other => panic!("an item in state '{other}'"),
            }
        }
        counts
    }

    /// A plain connection to the scratch database, its tables in reach.
    fn sql(&self, db: &ScratchDb) -> postgres::Client {
        let mut client = db.connect();
        client
            .batch_execute("SET search_path TO evalfleet")
            .unwrap();
        client
    }
}

/// Runs each named test (a `fn(&Fixture)`) against both backends: as
/// `NAME::sqlite` and `NAME::postgres`.
macro_rules! both {
    ($($test:ident),+ $(,)?) => {$(
        mod $test {
            #[test]
            fn sqlite() {
                if let Some(store) = super::Fixture::new(super::Backend::Sqlite) {
                    super::$test(&store);
                }
            }

            #[test]
            fn postgres() {
                if let Some(store) = super::Fixture::new(super::Backend::Postgres) {
                    super::$test(&store);
                }
            }
        }
    )+};
}

both!(
    the_cache_answers_by_key_honours_age_and_evicts_the_oldest,
    a_duplicate_id_undoes_the_whole_registration,
    a_run_id_is_taken_once_and_runs_come_newest_first,
    commits_are_exactly_once_and_counters_match_a_recount,
    a_batch_of_many_results_is_stored_row_for_row,
    a_sample_keeps_the_items_with_the_smallest_keys,
    a_claim_is_exclusive_while_its_lease_lasts_and_a_commit_under_a_lost_lease_is_refused,
    a_commit_whose_lease_ran_out_is_refused_once_another_worker_took_its_items,
    the_items_of_a_lapsed_claim_are_taken_next_not_after_the_claimers_own,
    a_claims_id_is_never_given_again_once_the_claim_is_gone,
    what_workers_saw_of_one_endpoint_is_summed,
    an_item_claimed_again_numbers_its_next_attempt_above_every_stored_one,
    items_come_a_page_at_a_time_filtered_and_sorted_in_the_store,
    one_item_comes_whole_with_its_attempts,
    a_runs_generation_changes_with_its_results_and_kept_reports_are_replaced,
    results_and_attempts_are_scanned_rescored_and_exported,
    a_resource_series_stays_bounded_with_its_peak_and_mean_exact,
    agent_calls_are_stored_with_their_attempt_refused_under_a_lost_claim_and_read_back_in_order,
    trajectories_are_each_conversation_of_an_attempt_with_its_steps_and_how_the_attempt_ended,
    the_agents_figures_are_per_item_means_of_the_stored_calls,
    an_items_wait_is_stored_with_it_and_whoever_claims_it_next_waits_it_out,
);

fn new_run(id: &str) -> NewRun {
    NewRun {
        run_id: id.to_owned(),
        name: "test".to_owned(),
        config: serde_json::json!({"name": "test"}),
        config_dir: ".".to_owned(),
        created_at_ms: 1,
    }
}

fn result(seq: u64, id: &str, status: ItemStatus) -> ResultRecord {
    ResultRecord {
        seq,
        item_id: id.to_owned(),
        status,
        output: Some(format!("answer {id}")),
        error: None,
        telemetry: Some(Telemetry {
            endpoint: "e".to_owned(),
            model: "m".to_owned(),
            latency_ms: 1.0,
            ttft_ms: None,
            tpot_ms: None,
            prompt_tokens: Some(1),
            completion_tokens: Some(1),
            tokens_estimated: false,
            finish_reason: Some("stop".to_owned()),
        }),
        attempts: 1,
        cached: 0,
        item: Some(format!("{{\"id\": \"{id}\"}}")),
        finished_at_ms: 1,
        assessment: Assessment::default(),
        prompt: None,
        images: Vec::new(),
    }
}

fn attempt(seq: u64, number: u32) -> AttemptRecord {
    AttemptRecord {
        seq,
        attempt: number,
        session: 1,
        sent_at_ms: 1,
        telemetry: Telemetry {
            endpoint: "e".to_owned(),
            model: "m".to_owned(),
            latency_ms: 1.0,
            ..Telemetry::default()
        },
        http_status: Some(500),
        error_class: Some(ErrorClass::Retryable),
        error: Some("HTTP 500".to_owned()),
    }
}

const LEASE: Duration = Duration::from_secs(60);

/// Until a claim looks for lapsed items again whatever else it finds: the
/// PostgreSQL store reaps at most once an interval per connection, and at
/// every claim that finds nothing else (SQLite at every claim: there, only
/// until the lease has passed).
fn wait_for_reap(f: &Fixture) {
    std::thread::sleep(match f.backend {
        Backend::Postgres => evalfleet_store::POSTGRES_REAP_EVERY + Duration::from_millis(5),
        Backend::Sqlite => Duration::from_millis(5),
    });
}

/// Claims every pending item of `run_id` for `name`.
fn claim_all(store: &mut dyn Store, run_id: &str, name: &str) -> ClaimId {
    match store.claim(run_id, name, None, 1000, LEASE).unwrap() {
        Claimed::Items(claim) => claim.id,
        other => panic!("nothing to claim: {other:?}"),
    }
}

/// A cache key (hex SHA-256) named by `label`.
fn k(label: &str) -> String {
    let none = serde_json::value::RawValue::from_string("[]".to_owned()).unwrap();
    evalfleet_config::cache::key(label, 0, &none)
}

fn cache_entry(label: &str, created_at_ms: i64) -> CacheEntry {
    CacheEntry {
        key: k(label),
        content: format!("answer for {label}"),
        endpoint: "e".to_owned(),
        model: "m".to_owned(),
        prompt_tokens: Some(3),
        completion_tokens: Some(4),
        finish_reason: Some("stop".to_owned()),
        latency_ms: 12.5,
        created_at_ms,
    }
}

fn the_cache_answers_by_key_honours_age_and_evicts_the_oldest(f: &Fixture) {
    let mut store = f.open();
    store
        .create_run(&new_run("r"), &mut items(&["a"], None))
        .unwrap();
    store.begin_session("r", &mut worker("w"), false).unwrap();
    let entries: Vec<CacheEntry> = (0..5)
        .map(|i| cache_entry(&format!("k{i}"), 1000 + i))
        .collect();
    store
        .commit(
            "r",
            "w",
            &Batch {
                attempts: vec![],
                results: vec![],
                cache: entries.clone(),
                calls: vec![],
                waits: vec![],
            },
        )
        .unwrap();
    drop(store);
    let mut store = f.open();
    assert_eq!(
        store.cache_get(&k("k2"), 0).unwrap(),
        Some(entries[2].clone()),
        "it survives a reopen"
    );
    let stats = store.cache_stats().unwrap();
    assert_eq!(
        (
            stats.entries,
            stats.content_bytes,
            stats.oldest_ms,
            stats.newest_ms,
            stats.hits
        ),
        (
            5,
            entries.iter().map(|e| e.content.len() as u64).sum(),
            Some(1000),
            Some(1004),
            0
        )
    );
    assert_eq!(store.cache_get(&k("nope"), 0).unwrap(), None);
    assert_eq!(
        store
            .cache_get_many(&[&k("k3"), &k("nope"), &k("k4")], 0)
            .unwrap(),
        vec![Some(entries[3].clone()), None, Some(entries[4].clone())],
        "a page of keys is looked up at once, answers in the keys' order"
    );
    assert_eq!(
        store
            .cache_get(&k("k2").to_uppercase(), 0)
            .unwrap()
            .map(|e| e.content),
        Some(entries[2].content.clone()),
        "hex in any case"
    );
    assert_eq!(store.cache_get("not hex", 0).unwrap(), None);
    assert_eq!(
        store
            .cache_get_many(&[&k("k3"), "zz", &k("k3")], 0)
            .unwrap(),
        vec![Some(entries[3].clone()), None, Some(entries[3].clone())]
    );
    assert_eq!(store.cache_get_many(&[], 0).unwrap(), vec![]);
    assert_eq!(
        store.cache_get_many(&[&k("k4"), &k("k2")], 1003).unwrap(),
        vec![Some(entries[4].clone()), None]
    );
    assert_eq!(
        store.cache_get(&k("k2"), 1003).unwrap(),
        None,
        "older than the ttl allows"
    );
    assert_eq!(store.cache_evict(None, Some(3)).unwrap(), 2);
    assert_eq!(
        store.cache_get(&k("k0"), 0).unwrap(),
        None,
        "the oldest went first"
    );
    assert_eq!(store.cache_get(&k("k1"), 0).unwrap(), None);
    assert!(store.cache_get(&k("k2"), 0).unwrap().is_some());
    assert_eq!(store.cache_evict(None, Some(3)).unwrap(), 0);
    assert_eq!(store.cache_evict(Some(1004), None).unwrap(), 2);
    let stats = store.cache_stats().unwrap();
    assert_eq!((stats.entries, stats.oldest_ms), (1, Some(1004)));
    assert_eq!(store.cache_evict(Some(0), Some(u64::MAX)).unwrap(), 0);
    store
        .commit("r", "w", &with_cache(entries[..2].to_vec()))
        .unwrap();
    assert_eq!(store.cache_clear().unwrap(), 3);
    let stats = store.cache_stats().unwrap();
    assert_eq!(
        (
            stats.entries,
            stats.content_bytes,
            stats.oldest_ms,
            stats.newest_ms
        ),
        (0, 0, None, None)
    );

    // Hits: the calls results say were answered from the cache.
    let claim = claim_all(&mut *store, "r", "w");
    let mut hit = result(1, "a", ItemStatus::Done);
    hit.cached = 2;
    let batch = Batch {
        results: vec![(claim, hit)],
        ..Batch::default()
    };
    store.commit("r", "w", &batch).unwrap();
    assert_eq!(store.cache_stats().unwrap().hits, 2);
}

/// A batch of cache entries alone.
fn with_cache(cache: Vec<CacheEntry>) -> Batch {
    Batch {
        cache,
        ..Batch::default()
    }
}

fn a_duplicate_id_undoes_the_whole_registration(f: &Fixture) {
    let mut store = f.open();
    let err = store
        .create_run(&new_run("r"), &mut items(&["a", "b", "a"], None))
        .unwrap_err();
    match err {
        CreateRunError::DuplicateId {
            id,
            first_line,
            second_line,
            ..
        } => assert_eq!((id.as_str(), first_line, second_line), ("a", 1, 3)),
        other => panic!("{other:?}"),
    }
    assert!(matches!(store.run("r"), Err(StoreError::NoSuchRun(_))));
    assert!(store.runs().unwrap().is_empty());
}

fn a_run_id_is_taken_once_and_runs_come_newest_first(f: &Fixture) {
    let mut store = f.open();
    let run = store
        .create_run(&new_run("r"), &mut items(&["a", "bad1"], None))
        .unwrap();
    assert_eq!(
        (run.total, run.sessions, run.status),
        (2, 0, RunStatus::Running)
    );
    assert_eq!(run.config, serde_json::json!({"name": "test"}));
    assert!(matches!(
        store.create_run(&new_run("r"), &mut items(&["x"], None)),
        Err(CreateRunError::RunExists(id)) if id == "r"
    ));
    // The same time: the one made last first.
    store
        .create_run(&new_run("s"), &mut items(&["x"], None))
        .unwrap();
    let mut later = new_run("t");
    later.created_at_ms = 5;
    store.create_run(&later, &mut items(&["x"], None)).unwrap();
    let order: Vec<String> = store
        .runs()
        .unwrap()
        .into_iter()
        .map(|r| r.run_id)
        .collect();
    assert_eq!(order, ["t", "s", "r"]);
    assert!(matches!(store.run("nope"), Err(StoreError::NoSuchRun(_))));
    assert!(matches!(
        store.counts("nope"),
        Err(StoreError::NoSuchRun(_))
    ));

    // A status and its message are stored; a new session clears them.
    store
        .set_status("r", RunStatus::Interrupted, Some("stopped"))
        .unwrap();
    let stopped = store.run("r").unwrap();
    assert_eq!(
        (stopped.status, stopped.message.as_deref()),
        (RunStatus::Interrupted, Some("stopped"))
    );
    let mut w = worker("w");
    let start = store.begin_session("r", &mut w, false).unwrap();
    assert_eq!((start.session, w.session), (1, 1));
    let resumed = store.run("r").unwrap();
    assert_eq!(
        (resumed.status, resumed.message, resumed.sessions),
        (RunStatus::Running, None, 1)
    );
    let workers = store.workers("r").unwrap();
    assert_eq!(workers.len(), 1);
    assert_eq!(
        (
            workers[0].worker.as_str(),
            workers[0].session,
            workers[0].pid
        ),
        ("w", 1, w.pid)
    );
}

/// A batch of many attempts and results, as a run's commits make them (the SQLite store
/// writes many rows a statement): every result is stored with its own
/// columns, and on SQLite a second result anywhere in such a batch is
/// refused, naming its item, with nothing of the batch kept.
fn a_batch_of_many_results_is_stored_row_for_row(f: &Fixture) {
    let mut store = f.open();
    let ids: Vec<String> = (0..80).map(|i| format!("i{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    store
        .create_run(&new_run("r"), &mut items(&refs, None))
        .unwrap();
    store.begin_session("r", &mut worker("w"), false).unwrap();
    let claim = claim_all(&mut *store, "r", "w");
    // 45 items end, the failed ones among the done ones: 38 done, 7 failed.
    let ended: Vec<ResultRecord> = (1..=45u64)
        .map(|seq| {
            let id = &ids[seq as usize - 1];
            let status = if seq % 7 == 3 {
                ItemStatus::Failed
            } else {
                ItemStatus::Done
            };
            let mut r = result(seq, id, status);
            r.prompt = Some(format!("prompt of {id}"));
            r.error = (status == ItemStatus::Failed).then(|| format!("error of {id}"));
            r.telemetry.as_mut().unwrap().model = format!("model of {id}");
            r
        })
        .collect();
    // Their attempts: one each, and a second for every fifth.
    let attempts: Vec<AttemptRecord> = (1..=45u64)
        .flat_map(|seq| (1..=if seq % 5 == 0 { 2 } else { 1 }).map(move |n| (seq, n)))
        .map(|(seq, n)| {
            let mut a = attempt(seq, n);
            a.telemetry.endpoint = format!("e{seq}");
            a.telemetry.latency_ms = (seq * 10 + u64::from(n)) as f64;
            a
        })
        .collect();
    let batch = Batch {
        attempts: attempts.iter().map(|a| (claim, a.clone())).collect(),
        results: ended.iter().map(|r| (claim, r.clone())).collect(),
        ..Batch::default()
    };
    assert_eq!(store.commit("r", "w", &batch).unwrap().results, 45);
    let mut stored_attempts = Vec::new();
    store
        .scan_attempts("r", &mut |a| {
            stored_attempts.push((a.endpoint, a.latency_ms as u64, a.error_class))
        })
        .unwrap();
    stored_attempts.sort();
    let mut committed_attempts: Vec<_> = attempts
        .iter()
        .map(|a| {
            (
                a.telemetry.endpoint.clone(),
                a.telemetry.latency_ms as u64,
                a.error_class,
            )
        })
        .collect();
    committed_attempts.sort();
    assert_eq!(stored_attempts.len(), 54);
    assert_eq!(stored_attempts, committed_attempts);
    assert_eq!(
        store.counts("r").unwrap(),
        StateCounts {
            pending: 35,
            done: 38,
            failed: 7
        }
    );
    assert_eq!(store.counts("r").unwrap(), f.recount("r"));
    let mut stored = Vec::new();
    store
        .scan_results("r", &mut |r| {
            stored.push((
                r.seq, r.item_id, r.status, r.output, r.model, r.item, r.prompt, r.error,
            ))
        })
        .unwrap();
    stored.sort_by_key(|r| r.0);
    let committed: Vec<_> = ended
        .iter()
        .map(|r| {
            (
                r.seq,
                r.item_id.clone(),
                r.status,
                r.output.clone(),
                r.telemetry.as_ref().map(|t| t.model.clone()),
                r.item.clone(),
                r.prompt.clone(),
                r.error.clone(),
            )
        })
        .collect();
    assert_eq!(stored, committed);

    if f.backend != Backend::Sqlite {
        return;
    }
    // 33 pending items end, and with them a second result: of an item
    // that ended above, in the first statement of 32 (the 18th), or alone
    // in its status's slice; of one of them twice, in one statement, in
    // two (the 34th: the last ones go one by one), or once done and once
    // failed. Refused, naming the item; nothing of the batch stays, its
    // attempts included.
    let pending: Vec<(ClaimId, ResultRecord)> = (46..=78u64)
        .map(|seq| (claim, result(seq, &ids[seq as usize - 1], ItemStatus::Done)))
        .collect();
    let with = |at: usize, seq: u64, status: ItemStatus| {
        let mut results = pending.clone();
        results.insert(at, (claim, result(seq, &ids[seq as usize - 1], status)));
        results
    };
    for (results, named) in [
        (with(17, 10, ItemStatus::Done), "i9"),
        (with(20, 3, ItemStatus::Failed), "i2"),
        (with(20, 50, ItemStatus::Done), "i49"),
        (with(33, 60, ItemStatus::Done), "i59"),
        (with(5, 47, ItemStatus::Failed), "i46"),
    ] {
        let again = Batch {
            attempts: vec![(claim, attempt(46, 1)), (claim, attempt(47, 1))],
            results,
            ..Batch::default()
        };
        match store.commit("r", "w", &again) {
            Err(StoreError::Invariant(message)) => {
                assert!(message.contains(&format!("item '{named}'")), "{message}")
            }
            other => panic!("a second result was not refused: {other:?}"),
        }
        assert_eq!(
            store.counts("r").unwrap().pending,
            35,
            "nothing of it stays"
        );
        assert_eq!(store.counts("r").unwrap(), f.recount("r"));
        let mut attempts = 0;
        store.scan_attempts("r", &mut |_| attempts += 1).unwrap();
        assert_eq!(attempts, 54, "its attempts are undone too");
    }
}

fn commits_are_exactly_once_and_counters_match_a_recount(f: &Fixture) {
    let mut store = f.open();
    let run = store
        .create_run(
            &new_run("r"),
            &mut items(&["a", "bad1", "b", "c", "d"], None),
        )
        .unwrap();
    assert_eq!(run.total, 5);
    assert_eq!(run.status, RunStatus::Running);
    assert_eq!(store.counts("r").unwrap(), f.recount("r"));
    assert_eq!(
        store.counts("r").unwrap().failed,
        1,
        "the invalid row is a failed item"
    );

    let start = store.begin_session("r", &mut worker("w"), false).unwrap();
    assert_eq!(start.session, 1);
    let claim = claim_all(&mut *store, "r", "w");
    let batch = Batch {
        attempts: vec![(claim, attempt(1, 1))],
        results: vec![
            (claim, result(1, "a", ItemStatus::Done)),
            (claim, result(3, "b", ItemStatus::Failed)),
        ],
        cache: vec![],
        calls: vec![],
        waits: vec![],
    };
    store.commit("r", "w", &batch).unwrap();
    assert_eq!(
        store.counts("r").unwrap(),
        StateCounts {
            pending: 2,
            done: 1,
            failed: 2
        }
    );
    assert_eq!(store.counts("r").unwrap(), f.recount("r"));

    // A second result for an item ended under the same claim is never
    // stored. SQLite refuses it as a broken invariant, and nothing of its
    // batch stays. PostgreSQL cannot tell it from the commit that ended
    // the item run again (its connection was lost after COMMIT reached the
    // server): it counts the result as committed already and keeps the
    // first (see `postgres_only` for a whole commit run twice).
    let again = Batch {
        attempts: vec![(claim, attempt(4, 1))],
        results: vec![
            (claim, result(4, "c", ItemStatus::Done)),
            (claim, result(1, "a", ItemStatus::Failed)),
        ],
        cache: vec![cache_entry("k-again", 1)],
        calls: vec![],
        waits: vec![],
    };
    match f.backend {
        Backend::Sqlite => {
            assert!(matches!(
                store.commit("r", "w", &again),
                Err(StoreError::Invariant(_))
            ));
            assert_eq!(
                store.cache_stats().unwrap().entries,
                0,
                "its cache entry is undone too"
            );
        }
        Backend::Postgres => {
            let replayed = Batch {
                results: vec![(claim, result(1, "a", ItemStatus::Failed))],
                ..Batch::default()
            };
            let committed = store.commit("r", "w", &replayed).unwrap();
            assert_eq!((committed.results, committed.refused), (1, vec![]));
        }
    }
    assert_eq!(store.counts("r").unwrap().pending, 2);
    assert_eq!(store.counts("r").unwrap(), f.recount("r"));
    let a = store.item("r", "a").unwrap().unwrap();
    assert_eq!(a.row.state, ItemState::Done, "the first result stays");

    // Pending items come in order, with their earlier attempts counted by a
    // new connection (a new session).
    store.release("r", "w").unwrap();
    let mut reader = f.open();
    let Claimed::Items(pending) = reader.claim("r", "w2", None, 10, LEASE).unwrap() else {
        panic!("the released items are free");
    };
    let seqs: Vec<u64> = pending.items.iter().map(|p| p.seq).collect();
    assert_eq!(seqs, vec![4, 5]);
    assert_eq!(pending.items[0].prior_attempts, 0);
    reader.release("r", "w2").unwrap();
    let Claimed::Items(after) = reader.claim("r", "w2", Some(4), 10, LEASE).unwrap() else {
        panic!("item 5 is free");
    };
    assert_eq!(after.items.len(), 1);
    reader.release("r", "w2").unwrap();

    // --retry-failed puts failed items back (not invalid rows).
    let start = store.begin_session("r", &mut worker("w3"), true).unwrap();
    assert_eq!(start.reset, 1);
    assert_eq!(start.session, 2);
    assert_eq!(store.counts("r").unwrap(), f.recount("r"));
    assert_eq!(store.counts("r").unwrap().pending, 3);

    let mut rows = Vec::new();
    store
        .export("r", &mut |row| {
            rows.push((row.item_id, row.status.to_string()));
            Ok(())
        })
        .unwrap();
    let expected = [("a", "done"), ("bad1", "failed")].map(|(a, b)| (a.to_owned(), b.to_owned()));
    assert_eq!(rows, expected);
}

fn a_sample_keeps_the_items_with_the_smallest_keys(f: &Fixture) {
    let mut store = f.open();
    let ids: Vec<String> = (0..50).map(|i| format!("id{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let run = store
        .create_run(&new_run("r"), &mut items(&refs, Some(7)))
        .unwrap();
    assert_eq!(run.total, 7);
    let mut expected: Vec<(i64, &str)> = refs
        .iter()
        .map(|id| (evalfleet_io::dataset::sample_key(1, id), *id))
        .collect();
    expected.sort();
    let mut expected: Vec<&str> = expected.into_iter().take(7).map(|(_, id)| id).collect();
    expected.sort();
    let Claimed::Items(claim) = store.claim("r", "w", None, 100, LEASE).unwrap() else {
        panic!("the sample is pending");
    };
    let mut kept: Vec<String> = claim.items.into_iter().map(|p| p.item_id).collect();
    kept.sort();
    assert_eq!(kept, expected);
}

fn a_claim_is_exclusive_while_its_lease_lasts_and_a_commit_under_a_lost_lease_is_refused(
    f: &Fixture,
) {
    let mut first = f.open();
    let mut second = f.open();
    first
        .create_run(&new_run("r"), &mut items(&["a", "b", "c", "d"], None))
        .unwrap();
    first.begin_session("r", &mut worker("one"), false).unwrap();
    second
        .begin_session("r", &mut worker("two"), false)
        .unwrap();

    // Claims are exclusive: one takes two items, the other the next two,
    // then nothing is left for either.
    let Claimed::Items(a) = first.claim("r", "one", None, 2, LEASE).unwrap() else {
        panic!("items are pending");
    };
    let Claimed::Items(b) = second.claim("r", "two", None, 10, LEASE).unwrap() else {
        panic!("items are pending");
    };
    let seqs = |c: &evalfleet_store::Claim| c.items.iter().map(|i| i.seq).collect::<Vec<_>>();
    assert_eq!((seqs(&a), seqs(&b)), (vec![1, 2], vec![3, 4]));
    assert_eq!(
        second.claim("r", "two", None, 10, LEASE).unwrap(),
        Claimed::HeldByOthers
    );
    assert_eq!(
        first.claim("r", "one", Some(2), 10, LEASE).unwrap(),
        Claimed::HeldByOthers
    );

    // A claim whose lease has run out is claimed again by another, and
    // its old holder's commit is refused: only one result per item.
    assert_eq!(second.renew("r", "two", Duration::ZERO).unwrap().claims, 1);
    let Claimed::Items(taken) = first.claim("r", "one", None, 10, LEASE).unwrap() else {
        panic!("the expired claim's items are free");
    };
    assert_eq!(seqs(&taken), vec![3, 4]);
    let late = Batch {
        attempts: vec![(b.id, attempt(3, 1))],
        results: vec![(b.id, result(3, "c", ItemStatus::Done))],
        cache: vec![],
        calls: vec![],
        waits: vec![],
    };
    let refused = second.commit("r", "two", &late).unwrap();
    assert_eq!((refused.results, refused.refused), (0, vec![3]));
    let on_time = Batch {
        attempts: vec![(taken.id, attempt(3, 1))],
        results: vec![
            (a.id, result(1, "a", ItemStatus::Done)),
            (taken.id, result(3, "c", ItemStatus::Done)),
        ],
        cache: vec![],
        calls: vec![],
        waits: vec![],
    };
    assert_eq!(first.commit("r", "one", &on_time).unwrap().results, 2);
    assert_eq!(first.counts("r").unwrap(), f.recount("r"));
    assert_eq!(first.counts("r").unwrap().done, 2);

    // Releasing frees a worker's items at once.
    assert_eq!(
        second.claim("r", "two", None, 10, LEASE).unwrap(),
        Claimed::HeldByOthers
    );
    first.release("r", "one").unwrap();
    let Claimed::Items(rest) = second.claim("r", "two", None, 10, LEASE).unwrap() else {
        panic!("released items are free");
    };
    assert_eq!(seqs(&rest), vec![2, 4]);
    assert_eq!(
        second
            .workers("r")
            .unwrap()
            .iter()
            .map(|w| w.worker.as_str())
            .collect::<Vec<_>>(),
        ["two"],
        "a released worker is no longer registered"
    );
    let last = Batch {
        attempts: vec![],
        results: vec![
            (rest.id, result(2, "b", ItemStatus::Done)),
            (rest.id, result(4, "d", ItemStatus::Failed)),
        ],
        cache: vec![],
        calls: vec![],
        waits: vec![],
    };
    assert_eq!(second.commit("r", "two", &last).unwrap().results, 2);
    assert_eq!(
        second.claim("r", "two", None, 10, LEASE).unwrap(),
        Claimed::Nothing
    );
    assert_eq!(second.counts("r").unwrap(), f.recount("r"));
}

/// A commit under a lease that ran out. Both backends refuse it once
/// another worker took its items. Before that they differ, on purpose:
/// SQLite refuses it whoever holds the items (a claim ends with its
/// lease), while PostgreSQL fences a commit by its claim (`items.claim_id`
/// and state `running`), so a late commit whose items nobody reaped,
/// claimed or released yet is stored: no other worker answers them.
fn what_workers_saw_of_one_endpoint_is_summed(f: &Fixture) {
    let mut store = f.open();
    store
        .create_run(&new_run("r"), &mut items(&["a"], None))
        .unwrap();
    let none = vec![0u64; 17];
    let seen = |endpoint: &str, calls: u64, in_flight: u64, state: &str| {
        let mut answered = none.clone();
        answered[3] = calls - calls / 10;
        serde_json::from_value::<evalfleet_types::EndpointSnapshot>(serde_json::json!({
            "endpoint": endpoint, "kind": "external", "state": state, "limit": 8,
            "adaptive": true, "in_flight": in_flight, "requests_per_minute": 60,
            "errors": {"retryable": calls / 10}, "restarts": 0, "calls": calls,
            "successes": calls - calls / 10,
            "timings": {"latency": {"counts": answered, "sum_ms": 40.0 * (calls - calls / 10) as f64},
                        "ttft": {"counts": none, "sum_ms": 0.0}, "tpot": {"counts": none, "sum_ms": 0.0}},
        }))
        .unwrap()
    };
    // Two workers call one hosted API; a third saw only its own engine.
    store
        .put_endpoint_states("r", "one", &[seen("api", 100, 3, "healthy")])
        .unwrap();
    store
        .put_endpoint_states("r", "two", &[seen("api", 200, 5, "unhealthy")])
        .unwrap();
    store
        .put_endpoint_states("r", "three", &[seen("gpu", 50, 1, "healthy")])
        .unwrap();
    // A later snapshot of a worker replaces its own, not the others'.
    store
        .put_endpoint_states("r", "one", &[seen("api", 108, 2, "healthy")])
        .unwrap();
    let states = store.endpoint_states("r").unwrap().unwrap();
    let api = &states.endpoints[0];
    assert_eq!(api.endpoint, "api");
    assert_eq!(
        (api.calls, api.successes, api.in_flight, api.limit),
        (308, 108 - 10 + 200 - 20, 7, 16)
    );
    assert_eq!(api.errors[&ErrorClass::Retryable], 30);
    let latency = &api.timings.as_ref().unwrap().latency;
    assert_eq!(latency.counts[3], 278);
    assert_eq!(api.state, evalfleet_types::EndpointState::Healthy);
    assert_eq!(
        (
            states.endpoints[1].endpoint.as_str(),
            states.endpoints[1].calls
        ),
        ("gpu", 50)
    );
    assert_eq!(states.endpoints.len(), 2);
}

fn the_items_of_a_lapsed_claim_are_taken_next_not_after_the_claimers_own(f: &Fixture) {
    let ids: Vec<String> = (0..30).map(|i| format!("i{i:02}")).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let mut first = f.open();
    let mut second = f.open();
    first
        .create_run(&new_run("r"), &mut items(&ids, None))
        .unwrap();
    first.begin_session("r", &mut worker("one"), false).unwrap();
    second
        .begin_session("r", &mut worker("two"), false)
        .unwrap();
    let seqs = |claimed: Claimed| match claimed {
        Claimed::Items(claim) => claim.items.iter().map(|i| i.seq).collect::<Vec<_>>(),
        other => panic!("items are pending: {other:?}"),
    };
    let mine = seqs(first.claim("r", "one", None, 10, LEASE).unwrap());
    let theirs = seqs(second.claim("r", "two", None, 10, LEASE).unwrap());
    assert_eq!((mine[0], theirs[0]), (1, 11));
    // The first worker dies: its lease runs out. The second, whose cursor
    // is past its items, takes them next, not after the rest of the run.
    assert_eq!(first.renew("r", "one", Duration::ZERO).unwrap().claims, 1);
    // Once the second looks for lapsed items (PostgreSQL: at most once a
    // reap interval, which its first claim began).
    wait_for_reap(f);
    let next = seqs(second.claim("r", "two", Some(20), 5, LEASE).unwrap());
    assert_eq!(next, vec![1, 2, 3, 4, 5]);
    // Then on from there: the rest of the lapsed claim, then (PostgreSQL
    // claims items, SQLite a range without others' items in it) the run's.
    let then = seqs(second.claim("r", "two", Some(5), 10, LEASE).unwrap());
    assert_eq!(then[..5], [6, 7, 8, 9, 10], "{then:?}");
    assert!(then[5..].iter().all(|seq| *seq > 20), "{then:?}");
}

fn a_claims_id_is_never_given_again_once_the_claim_is_gone(f: &Fixture) {
    // A worker that learned a claim was lost takes every later claim of
    // that id for lost too: ids name one claim for good. The newest claim
    // is the one dropped each time, the case where an id would come back.
    let mut store = f.open();
    store
        .create_run(&new_run("r"), &mut items(&["a", "b", "c", "d"], None))
        .unwrap();
    store.begin_session("r", &mut worker("one"), false).unwrap();
    let claim =
        |store: &mut Box<dyn Store>, after| match store.claim("r", "one", after, 1, LEASE).unwrap()
        {
            Claimed::Items(claim) => claim,
            other => panic!("items are pending: {other:?}"),
        };
    // Dropped once its items have all ended.
    let first = claim(&mut store, None);
    let done = Batch {
        results: vec![(first.id, result(1, "a", ItemStatus::Done))],
        ..Batch::default()
    };
    assert_eq!(store.commit("r", "one", &done).unwrap().results, 1);
    let second = claim(&mut store, Some(1));
    // Dropped once its lease ran out, by the claim that takes its item.
    assert_eq!(store.renew("r", "one", Duration::ZERO).unwrap().claims, 1);
    wait_for_reap(f);
    let third = claim(&mut store, Some(2));
    assert_eq!(
        (second.items[0].seq, third.items[0].seq),
        (2, 2),
        "the lapsed claim's item is taken again"
    );
    let ids = std::collections::BTreeSet::from([first.id, second.id, third.id]);
    assert_eq!(ids.len(), 3, "{:?}", [first.id, second.id, third.id]);
}

fn a_commit_whose_lease_ran_out_is_refused_once_another_worker_took_its_items(f: &Fixture) {
    let mut first = f.open();
    let mut second = f.open();
    first
        .create_run(&new_run("r"), &mut items(&["a", "b"], None))
        .unwrap();
    first.begin_session("r", &mut worker("one"), false).unwrap();
    second
        .begin_session("r", &mut worker("two"), false)
        .unwrap();
    let mine = claim_all(&mut *first, "r", "one");
    assert_eq!(first.renew("r", "one", Duration::ZERO).unwrap().claims, 1);
    std::thread::sleep(Duration::from_millis(5));

    // Nobody took item a yet.
    let late_a = Batch {
        attempts: vec![(mine, attempt(1, 1))],
        results: vec![(mine, result(1, "a", ItemStatus::Done))],
        ..Batch::default()
    };
    let committed = first.commit("r", "one", &late_a).unwrap();
    match f.backend {
        Backend::Sqlite => assert_eq!((committed.results, committed.refused), (0, vec![1])),
        Backend::Postgres => assert_eq!((committed.results, committed.refused), (1, vec![])),
    }

    // Another worker took item b: its late commit is refused on both, and
    // nothing of it is stored.
    let Claimed::Items(theirs) = second.claim("r", "two", None, 10, LEASE).unwrap() else {
        panic!("the lapsed claim's items are free");
    };
    assert!(theirs.items.iter().any(|i| i.seq == 2), "{theirs:?}");
    let late_b = Batch {
        attempts: vec![(mine, attempt(2, 1))],
        results: vec![(mine, result(2, "b", ItemStatus::Done))],
        calls: vec![(mine, agent_call(2, 1, 1))],
        ..Batch::default()
    };
    let refused = first.commit("r", "one", &late_b).unwrap();
    assert_eq!((refused.results, refused.refused), (0, vec![2]));
    let b = second.item("r", "b").unwrap().unwrap();
    assert_eq!(b.row.state, ItemState::Pending);
    assert!(b.attempt_records.is_empty() && b.calls.is_empty());
    assert_eq!(second.counts("r").unwrap(), f.recount("r"));

    // Whoever holds the items now commits them.
    let results: Vec<(ClaimId, ResultRecord)> = theirs
        .items
        .iter()
        .map(|i| (theirs.id, result(i.seq, &i.item_id, ItemStatus::Done)))
        .collect();
    let on_time = Batch {
        results,
        ..Batch::default()
    };
    let committed = second.commit("r", "two", &on_time).unwrap();
    assert_eq!(committed.results, theirs.items.len() as u64);
    assert_eq!(second.counts("r").unwrap().done, 2);
    assert_eq!(second.counts("r").unwrap(), f.recount("r"));
}

fn an_item_claimed_again_numbers_its_next_attempt_above_every_stored_one(f: &Fixture) {
    let mut store = f.open();
    store
        .create_run(&new_run("r"), &mut items(&["a", "b", "c"], None))
        .unwrap();
    store.begin_session("r", &mut worker("one"), false).unwrap();
    let claim = claim_all(&mut *store, "r", "one");
    // Item a's first call was answered from the cache (number 1, no row);
    // its second is stored as attempt 2. Item b has one stored attempt.
    let batch = Batch {
        attempts: vec![(claim, attempt(1, 2)), (claim, attempt(2, 1))],
        results: vec![],
        cache: vec![],
        calls: vec![],
        waits: vec![],
    };
    store.commit("r", "one", &batch).unwrap();
    store.release("r", "one").unwrap();
    let Claimed::Items(again) = store.claim("r", "one", None, 10, LEASE).unwrap() else {
        panic!("the items are still pending");
    };
    let prior: Vec<(u64, u32)> = again
        .items
        .iter()
        .map(|i| (i.seq, i.prior_attempts))
        .collect();
    assert_eq!(prior, vec![(1, 2), (2, 1), (3, 0)]);
}

/// A run of 30 items: 20 done (latency 100 - seq, score 1 for even seq,
/// category a or b by seq), 5 failed with a 500 each, 5 pending.
fn explored_run(store: &mut dyn Store) {
    let ids: Vec<String> = (1..=30).map(|i| format!("item-{i:02}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    store
        .create_run(&new_run("r"), &mut items(&refs, None))
        .unwrap();
    store.begin_session("r", &mut worker("w"), false).unwrap();
    let claim = claim_all(store, "r", "w");
    let mut batch = Batch::default();
    for seq in 1..=25u64 {
        let id = &ids[seq as usize - 1];
        let status = if seq <= 20 {
            ItemStatus::Done
        } else {
            ItemStatus::Failed
        };
        let mut r = result(seq, id, status);
        if let Some(t) = r.telemetry.as_mut() {
            t.latency_ms = 100.0 - seq as f64;
            t.completion_tokens = Some(seq);
        }
        r.item = Some(format!(
            "{{\"id\": \"{id}\", \"category\": \"{}\", \"level\": {}}}",
            if seq % 2 == 0 { "a" } else { "b" },
            seq % 3
        ));
        if status == ItemStatus::Failed {
            r.output = None;
            r.error = Some(format!("gave up after 1 attempts: HTTP 500 on {id}"));
            batch.attempts.push((claim, attempt(seq, 1)));
        } else {
            r.assessment.scores.insert(
                "em".to_owned(),
                evalfleet_types::Score::value(if seq % 2 == 0 { 1.0 } else { 0.0 }),
            );
        }
        batch.results.push((claim, r));
    }
    store.commit("r", "w", &batch).unwrap();
}

fn seqs(page: &ItemPage) -> Vec<u64> {
    page.rows.iter().map(|r| r.seq).collect()
}

fn items_come_a_page_at_a_time_filtered_and_sorted_in_the_store(f: &Fixture) {
    let mut store = f.open();
    explored_run(&mut *store);

    // Dataset order, every state, in pages of 12 that join up exactly.
    let mut query = ItemQuery {
        limit: 12,
        ..ItemQuery::default()
    };
    let mut all = Vec::new();
    loop {
        let page = store.items("r", &query).unwrap();
        all.extend(seqs(&page));
        match page.next {
            Some(next) => query.after = Some(next),
            None => break,
        }
    }
    assert_eq!(all, (1..=30).collect::<Vec<u64>>());

    let page = |store: &mut dyn Store, query: ItemQuery| {
        store
            .items(
                "r",
                &ItemQuery {
                    limit: 100,
                    ..query
                },
            )
            .unwrap()
    };
    // States.
    let pending = page(
        &mut *store,
        ItemQuery {
            states: vec![ItemState::Pending],
            ..ItemQuery::default()
        },
    );
    assert_eq!(seqs(&pending), vec![26, 27, 28, 29, 30]);
    assert!(pending.rows.iter().all(|r| r.output.is_none()));
    // A dataset field, a score range and a failed call's class.
    let a_right = page(
        &mut *store,
        ItemQuery {
            fields: vec![("category".to_owned(), "a".to_owned())],
            scores: vec![ScoreRange {
                metric: "em".to_owned(),
                min: Some(0.5),
                max: None,
            }],
            ..ItemQuery::default()
        },
    );
    assert_eq!(seqs(&a_right), vec![2, 4, 6, 8, 10, 12, 14, 16, 18, 20]);
    let level = page(
        &mut *store,
        ItemQuery {
            fields: vec![("level".to_owned(), "0".to_owned())],
            states: vec![ItemState::Done],
            ..ItemQuery::default()
        },
    );
    assert_eq!(seqs(&level), vec![3, 6, 9, 12, 15, 18]);
    let retried = page(
        &mut *store,
        ItemQuery {
            error_class: Some(ErrorClass::Retryable),
            ..ItemQuery::default()
        },
    );
    assert_eq!(seqs(&retried), vec![21, 22, 23, 24, 25]);
    // Text in the answer or the error, any case.
    let found = page(
        &mut *store,
        ItemQuery {
            text: Some("HTTP 500 ON ITEM-22".to_owned()),
            ..ItemQuery::default()
        },
    );
    assert_eq!(seqs(&found), vec![22]);
    let found = page(
        &mut *store,
        ItemQuery {
            text: Some("answer item-07".to_owned()),
            ..ItemQuery::default()
        },
    );
    assert_eq!(seqs(&found), vec![7]);
    // Latency and tokens ranges.
    let slow = page(
        &mut *store,
        ItemQuery {
            latency_ms: (Some(95.0), None),
            completion_tokens: (None, Some(3)),
            ..ItemQuery::default()
        },
    );
    assert_eq!(seqs(&slow), vec![1, 2, 3]);

    // Sorted by latency, slowest first, in pages of 7 that join up: the
    // keyset carries the latency and the seq.
    let mut query = ItemQuery {
        states: vec![ItemState::Done, ItemState::Failed],
        sort: SortKey::Latency,
        descending: true,
        limit: 7,
        ..ItemQuery::default()
    };
    let mut by_latency = Vec::new();
    loop {
        let page = store.items("r", &query).unwrap();
        by_latency.extend(seqs(&page));
        match page.next {
            Some(next) => query.after = Some(next),
            None => break,
        }
    }
    assert_eq!(by_latency, (1..=25).collect::<Vec<u64>>());
    // By score, best first; items with no score (failed, pending) last.
    let by_score = page(
        &mut *store,
        ItemQuery {
            sort: SortKey::Score("em".to_owned()),
            descending: true,
            ..ItemQuery::default()
        },
    );
    let order = seqs(&by_score);
    assert_eq!(order.len(), 30);
    assert_eq!(&order[..10], &[20, 18, 16, 14, 12, 10, 8, 6, 4, 2]);
    assert_eq!(&order[10..20], &[19, 17, 15, 13, 11, 9, 7, 5, 3, 1]);
}

fn one_item_comes_whole_with_its_attempts(f: &Fixture) {
    let mut store = f.open();
    explored_run(&mut *store);
    let failed = store.item("r", "item-23").unwrap().unwrap();
    assert_eq!(failed.row.state, ItemState::Failed);
    assert_eq!(failed.attempt_records.len(), 1);
    assert_eq!(failed.attempt_records[0].http_status, Some(500));
    assert_eq!(
        failed.attempt_records[0].error_class,
        Some(ErrorClass::Retryable)
    );
    let done = store.item("r", "item-04").unwrap().unwrap();
    assert_eq!(done.row.output.as_deref(), Some("answer item-04"));
    assert_eq!(done.row.scores.unwrap()["em"].value, Some(1.0));
    assert_eq!(done.row.item.unwrap()["category"], "a");
    let pending = store.item("r", "item-29").unwrap().unwrap();
    assert_eq!(pending.row.state, ItemState::Pending);
    assert!(store.item("r", "nope").unwrap().is_none());
    assert!(matches!(
        store.item("other", "item-01"),
        Err(StoreError::NoSuchRun(_))
    ));
}

fn a_runs_generation_changes_with_its_results_and_kept_reports_are_replaced(f: &Fixture) {
    use evalfleet_store::{KeptReport, ResultOrder};
    let mut store = f.open();
    store
        .create_run(&new_run("r"), &mut items(&["z", "a", "m", "b"], None))
        .unwrap();
    let generation = |store: &mut dyn Store| store.run("r").unwrap().generation;
    let g0 = generation(&mut *store);
    store.begin_session("r", &mut worker("w"), false).unwrap();
    let g1 = generation(&mut *store);
    assert!(g1 > g0, "a session changes it");
    let claim = claim_all(&mut *store, "r", "w");
    let batch = Batch {
        attempts: vec![],
        results: vec![
            (claim, result(1, "z", ItemStatus::Done)),
            (claim, result(2, "a", ItemStatus::Done)),
            (claim, result(4, "b", ItemStatus::Failed)),
        ],
        cache: vec![],
        calls: vec![],
        waits: vec![],
    };
    store.commit("r", "w", &batch).unwrap();
    let g2 = generation(&mut *store);
    assert!(g2 > g1, "a commit of results changes it");
    store.set_status("r", RunStatus::Finished, None).unwrap();
    assert_eq!(generation(&mut *store), g2, "a status alone does not");
    store
        .put_assessments("r", &[(1, Assessment::default())], &serde_json::json!({}))
        .unwrap();
    assert!(generation(&mut *store) > g2, "a rescore changes it");

    // Results by item id, a page at a time, and in dataset order.
    let page = |store: &mut dyn Store, order, after: Option<(&str, u64)>| {
        let mut seen = Vec::new();
        store
            .results_page("r", order, after, 2, false, &mut |view| {
                assert_eq!(view.item, None, "the item only when asked for");
                seen.push((view.item_id.to_owned(), view.seq));
                Ok(())
            })
            .unwrap();
        seen
    };
    let ids = |seen: Vec<(String, u64)>| seen.into_iter().map(|(id, _)| id).collect::<Vec<_>>();
    assert_eq!(ids(page(&mut *store, ResultOrder::Key, None)), ["a", "b"]);
    assert_eq!(
        ids(page(&mut *store, ResultOrder::Key, Some(("b", 4)))),
        ["z"]
    );
    assert_eq!(ids(page(&mut *store, ResultOrder::Seq, None)), ["z", "a"]);
    assert_eq!(
        ids(page(&mut *store, ResultOrder::Seq, Some(("a", 2)))),
        ["b"]
    );
    let mut with_items = Vec::new();
    store
        .results_page(
            "r",
            ResultOrder::Key,
            Some(("a", 2)),
            2,
            true,
            &mut |view| {
                with_items.push((view.item_id.to_owned(), view.item.map(str::to_owned)));
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(
        with_items,
        [
            ("b".to_owned(), Some(r#"{"id": "b"}"#.to_owned())),
            ("z".to_owned(), Some(r#"{"id": "z"}"#.to_owned()))
        ],
        "the item when asked for"
    );

    // A kept report is replaced under its key, and read back whole.
    assert_eq!(store.kept_report("r", "report?by=").unwrap(), None);
    for (fingerprint, body) in [("r:1", "{\"first\": 1}"), ("r:2", "{\"second\": 2}")] {
        let report = KeptReport {
            fingerprint: fingerprint.to_owned(),
            body: body.to_owned(),
        };
        store.keep_report("r", "report?by=", &report).unwrap();
        assert_eq!(store.kept_report("r", "report?by=").unwrap(), Some(report));
    }
    assert!(matches!(
        store.kept_report("nope", "report?by="),
        Err(StoreError::NoSuchRun(_))
    ));
    // However many questions are asked of a run, the latest are kept.
    let extra = 8;
    for i in 0..KEPT_PER_RUN + extra {
        let report = KeptReport {
            fingerprint: "r:2".to_owned(),
            body: format!("{{\"by\": {i}}}"),
        };
        store
            .keep_report("r", &format!("report?by=f{i}"), &report)
            .unwrap();
        // Asked again, an early one is kept anew: it stays, and one
        // more of the oldest goes.
        if i == extra + 2 {
            store.keep_report("r", "report?by=f1", &report).unwrap();
        }
    }
    let first = store.kept_report("r", "report?by=f0").unwrap();
    assert_eq!(first, None, "the oldest went first");
    assert!(
        store.kept_report("r", "report?by=f1").unwrap().is_some(),
        "kept again, it is among the latest"
    );
    let kept: Vec<bool> = (0..KEPT_PER_RUN + extra)
        .map(|i| {
            store
                .kept_report("r", &format!("report?by=f{i}"))
                .unwrap()
                .is_some()
        })
        .collect();
    assert_eq!(kept.iter().filter(|k| **k).count(), KEPT_PER_RUN);
    assert!(kept[extra + 1..].iter().all(|k| *k), "{kept:?}");
    assert_eq!(
        kept[..extra + 1].iter().filter(|k| **k).count(),
        1,
        "of the oldest, only the one kept again: {kept:?}"
    );
}

fn results_and_attempts_are_scanned_rescored_and_exported(f: &Fixture) {
    use evalfleet_store::{ExportError, ResultOrder};
    use evalfleet_types::{Score, Scores, Verdict};
    let mut store = f.open();
    store
        .create_run(&new_run("r"), &mut items(&["z", "a", "m", "b"], None))
        .unwrap();
    store.begin_session("r", &mut worker("w"), false).unwrap();
    let claim = claim_all(&mut *store, "r", "w");
    let mut failed = result(4, "b", ItemStatus::Failed);
    failed.output = None;
    failed.error = Some("gave up after 1 attempts: HTTP 500".to_owned());
    let batch = Batch {
        attempts: vec![(claim, attempt(4, 1))],
        results: vec![
            (claim, result(1, "z", ItemStatus::Done)),
            (claim, result(2, "a", ItemStatus::Done)),
            (claim, failed),
        ],
        ..Batch::default()
    };
    store.commit("r", "w", &batch).unwrap();

    let mut seen = Vec::new();
    store
        .scan_results("r", &mut |r| {
            seen.push((r.seq, r.item_id, r.status.to_string(), r.failure))
        })
        .unwrap();
    assert_eq!(
        seen,
        [
            (1, "z".to_owned(), "done".to_owned(), None),
            (2, "a".to_owned(), "done".to_owned(), None),
            (
                4,
                "b".to_owned(),
                "failed".to_owned(),
                Some(ErrorClass::Retryable)
            ),
        ]
    );
    let mut attempts = Vec::new();
    store.scan_attempts("r", &mut |a| attempts.push(a)).unwrap();
    assert_eq!(attempts.len(), 1);
    assert!(attempts[0].failed);
    assert_eq!(attempts[0].error_class, Some(ErrorClass::Retryable));

    // A rescore replaces assessments (the last given for an item wins)
    // and the stored config.
    let mut scores = Scores::new();
    scores.insert("exact".to_owned(), Score::value(1.0));
    let assessed = Assessment {
        parsed: Some(serde_json::json!({"answer": 1})),
        verdict: Some(Verdict::Ok),
        scores,
        ..Assessment::default()
    };
    store
        .put_assessments(
            "r",
            &[
                (1, Assessment::default()),
                (2, Assessment::default()),
                (1, assessed.clone()),
            ],
            &serde_json::json!({"rescored": true}),
        )
        .unwrap();
    assert_eq!(
        store.run("r").unwrap().config,
        serde_json::json!({"rescored": true})
    );
    let mut rows = Vec::new();
    store
        .export("r", &mut |row| {
            rows.push(row);
            Ok(())
        })
        .unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0].item_id, "z");
    assert_eq!(rows[0].valid, Some(true));
    assert_eq!(rows[0].parsed, assessed.parsed);
    assert_eq!(rows[0].scores.as_ref(), Some(&assessed.scores));
    assert_eq!(rows[0].item, serde_json::json!({"id": "z"}));
    assert_eq!(rows[1].valid, None);
    assert_eq!(
        rows[2].error.as_deref(),
        Some("gave up after 1 attempts: HTTP 500")
    );
    let mut stored = Vec::new();
    store
        .scan_results("r", &mut |r| stored.push(r.assessment))
        .unwrap();
    assert_eq!(stored[0].verdict, Some(Verdict::Ok));

    // Errors: of the run's name, of the reader of a page, of the export's
    // writer, each told as it is.
    assert!(matches!(
        store.results_page("nope", ResultOrder::Seq, None, 2, false, &mut |_| Ok(())),
        Err(StoreError::NoSuchRun(_))
    ));
    let err = store
        .results_page("r", ResultOrder::Seq, None, 2, false, &mut |_| {
            Err(StoreError::Invariant("stop".to_owned()))
        })
        .unwrap_err();
    assert!(matches!(err, StoreError::Invariant(text) if text == "stop"));
    let err = store
        .export("r", &mut |_| Err(std::io::Error::other("disk full")))
        .unwrap_err();
    assert!(matches!(err, ExportError::Write(_)));
}

fn a_resource_series_stays_bounded_with_its_peak_and_mean_exact(f: &Fixture) {
    use evalfleet_types::{POINTS_PER_SERIES, ResourceMetric, ResourcePoint, ResourceSource};
    let mut store = f.open();
    store
        .create_run(&new_run("r"), &mut items(&["a"], None))
        .unwrap();
    // Ten times the bound (see `resource_writes`).
    let (writes, gpu, rss) = common::resource_writes();
    let total = 10 * POINTS_PER_SERIES as i64;
    for points in &writes {
        store.add_resource_points("r", points).unwrap();
    }
    // A second sample at a time already stored is merged into its point.
    store
        .add_resource_points(
            "r",
            &[ResourcePoint::sample(rss.clone(), (total - 1) * 100, 44.0)],
        )
        .unwrap();
    let points = store.resource_points("r", i64::MIN).unwrap();
    for series in [&gpu, &rss] {
        let of: Vec<&ResourcePoint> = points.iter().filter(|p| &p.series == series).collect();
        assert!(of.len() <= POINTS_PER_SERIES, "{} points", of.len());
        assert!(of.windows(2).all(|w| w[0].until_ms < w[1].at_ms));
        assert_eq!(of[0].at_ms, 0);
        assert_eq!(of.last().unwrap().until_ms, (total - 1) * 100);
        // Even resolution: no point holds more than a few times its share.
        let most = of.iter().map(|p| p.samples).max().unwrap();
        let samples: u64 = of.iter().map(|p| p.samples).sum();
        assert!(
            most * of.len() as u64 <= 4 * samples,
            "{most} of {samples} in {} points",
            of.len()
        );
    }
    let summary = evalfleet_reports::ResourcesReport::of(&points);
    let g = summary
        .get(ResourceSource::Gpu, "0", ResourceMetric::GpuMemoryMb)
        .unwrap();
    assert_eq!(g.samples, total as u64);
    assert_eq!(g.peak, 143_771.0);
    let mean = (0..total).map(common::gpu_value).sum::<f64>() / total as f64;
    assert!((g.mean - mean).abs() < 1e-6, "{} against {mean}", g.mean);
    let r = summary
        .get(ResourceSource::Evalfleet, "", ResourceMetric::RssMb)
        .unwrap();
    assert_eq!(r.samples, total as u64 + 1);
    assert_eq!(r.peak, 44.0);
    assert_eq!(summary.gpu_memory_peak_mb, Some(143_771.0));
    // Only the newest: what a page asks for after its last point.
    let after = store.resource_points("r", (total - 2) * 100).unwrap();
    assert_eq!(after.len(), 2);
    store.add_resource_points("r", &[]).unwrap();
    assert_eq!(store.resource_points("r", i64::MIN).unwrap(), points);
    assert!(matches!(
        store.resource_points("nope", 0),
        Err(StoreError::NoSuchRun(_))
    ));
}

/// Call `index` of attempt `attempt` of item `seq`, as the gateway records
/// it: a chat completion with its request and the assistant's message.
fn agent_call(seq: u64, attempt: u32, index: u32) -> AgentCall {
    AgentCall {
        seq,
        attempt,
        index,
        call_id: format!("{seq}.{attempt}.{index}"),
        api: "chat.completions".to_owned(),
        asked_model: "gpt-4o".to_owned(),
        sent_at_ms: 1_000 + i64::from(index),
        telemetry: Telemetry {
            endpoint: "e".to_owned(),
            model: "m".to_owned(),
            latency_ms: 12.5,
            ttft_ms: Some(3.0),
            tpot_ms: None,
            prompt_tokens: Some(20),
            completion_tokens: Some(5),
            tokens_estimated: false,
            finish_reason: Some("stop".to_owned()),
        },
        stream: index.is_multiple_of(2),
        cached: false,
        http_status: 200,
        error_class: (attempt == 1).then_some(ErrorClass::Retryable),
        error: (attempt == 1).then(|| "HTTP 503".to_owned()),
        // Call 2 carries a long history (past what was once cut at 256
        // KiB) and a long answer: both come back whole.
        request: if index == 2 {
            long_history(6_000)
        } else {
            format!(r#"{{"messages":[{{"role":"user","content":"call {index}"}}]}}"#)
        },
        request_cut: false,
        response: Some(if index == 2 {
            format!(
                r#"{{"role":"assistant","content":{}}}"#,
                serde_json::Value::String("«ok» \"quoted\" ".repeat(20_000))
            )
        } else {
            r#"{"role":"assistant","content":"ok"}"#.to_owned()
        }),
        tags: Some(r#"{"user":"u"}"#.to_owned()),
        // A call the gateway made again elsewhere after a refusal: its
        // tries are read back as they were.
        failovers: if index == 2 {
            vec![evalfleet_types::Failover {
                endpoint: "f".to_owned(),
                latency_ms: 4.0,
                http_status: Some(503),
                error_class: Some(ErrorClass::Retryable),
                error: Some("HTTP 503: busy".to_owned()),
            }]
        } else {
            Vec::new()
        },
    }
}

/// A chat request of `turns` tool-calling turns (unicode and quotes in
/// it), as an agent with a long history sends it.
fn long_history(turns: usize) -> String {
    let mut messages =
        vec![serde_json::json!({"role": "user", "content": "Which «domain» first?"})];
    for turn in 0..turns {
        messages.push(serde_json::json!({
            "role": "assistant", "content": null,
            "tool_calls": [{"id": format!("call_{turn}"), "type": "function",
                            "function": {"name": "lookup", "arguments": format!("{{\"q\":\"d{turn}\"}}")}}]
        }));
        messages.push(serde_json::json!({
            "role": "tool", "tool_call_id": format!("call_{turn}"),
            "content": format!("domain {turn}: «{}» \"ok\"", turn * 7919 % 104_729)
        }));
    }
    serde_json::json!({"model": "gpt-4o", "messages": messages}).to_string()
}

/// Bytes the store holds of call `idx` of item `seq` (its text and its
/// compressed bodies).
fn stored_body_bytes(f: &Fixture, seq: u64, idx: u32) -> i64 {
    let sql = "SELECT COALESCE(LENGTH(request), 0) + COALESCE(LENGTH(response), 0)
                      + COALESCE(LENGTH(request_z), 0) + COALESCE(LENGTH(response_z), 0)
               FROM agent_calls WHERE seq = $1 AND attempt = 1 AND idx = $2";
    match (&f.location, &f.db) {
        (Location::Sqlite(path), _) => rusqlite::Connection::open(path)
            .unwrap()
            .query_row(
                &sql.replace('$', "?"),
                rusqlite::params![seq as i64, idx],
                |r| r.get(0),
            )
            .unwrap(),
        (Location::Postgres(_), Some(db)) => f
            .sql(db)
            .query_one(sql, &[&(seq as i64), &(idx as i32)])
            .unwrap()
            .get::<_, i32>(0)
            .into(),
        (Location::Postgres(_), None) => unreachable!("a PostgreSQL fixture has its database"),
    }
}

fn keys(calls: &[AgentCall]) -> Vec<(u64, u32, u32)> {
    calls.iter().map(|c| (c.seq, c.attempt, c.index)).collect()
}

fn agent_calls_are_stored_with_their_attempt_refused_under_a_lost_claim_and_read_back_in_order(
    f: &Fixture,
) {
    let mut first = f.open();
    let mut second = f.open();
    first
        .create_run(&new_run("r"), &mut items(&["a", "b", "c"], None))
        .unwrap();
    first.begin_session("r", &mut worker("one"), false).unwrap();
    second
        .begin_session("r", &mut worker("two"), false)
        .unwrap();
    let Claimed::Items(mine) = first.claim("r", "one", None, 2, LEASE).unwrap() else {
        panic!("items are pending");
    };
    let Claimed::Items(theirs) = second.claim("r", "two", None, 10, LEASE).unwrap() else {
        panic!("items are pending");
    };

    // Item a's first run of the agent fails after two calls: its calls come
    // alone. Its second run's call comes with its result, and so does a
    // call of the first run sent again: it is stored once.
    let failed_run = Batch {
        calls: vec![
            (mine.id, agent_call(1, 1, 2)),
            (mine.id, agent_call(1, 1, 1)),
        ],
        ..Batch::default()
    };
    assert_eq!(
        first.commit("r", "one", &failed_run).unwrap().refused,
        Vec::<u64>::new()
    );
    let finished = Batch {
        results: vec![
            (mine.id, result(1, "a", ItemStatus::Done)),
            (mine.id, result(2, "b", ItemStatus::Done)),
        ],
        calls: vec![
            (mine.id, agent_call(2, 1, 1)),
            (mine.id, agent_call(1, 2, 1)),
            (mine.id, agent_call(1, 1, 1)),
        ],
        ..Batch::default()
    };
    assert_eq!(first.commit("r", "one", &finished).unwrap().results, 2);

    // The other worker's lease runs out and this one takes its item over:
    // the other's calls are refused with its result, and nothing of them
    // is stored. (Taken over first: on PostgreSQL a late commit is refused
    // only once its items are another's; see
    // `a_commit_whose_lease_ran_out_is_refused_once_another_worker_took_its_items`.)
    assert_eq!(second.renew("r", "two", Duration::ZERO).unwrap().claims, 1);
    std::thread::sleep(Duration::from_millis(5));
    let Claimed::Items(taken) = first.claim("r", "one", None, 10, LEASE).unwrap() else {
        panic!("the expired claim's item is free");
    };
    let late = Batch {
        results: vec![(theirs.id, result(3, "c", ItemStatus::Done))],
        calls: vec![(theirs.id, agent_call(3, 1, 1))],
        ..Batch::default()
    };
    let refused = second.commit("r", "two", &late).unwrap();
    assert_eq!((refused.results, refused.refused), (0, vec![3]));

    let a = first.item("r", "a").unwrap().unwrap();
    assert_eq!(keys(&a.calls), vec![(1, 1, 1), (1, 1, 2), (1, 2, 1)]);
    assert_eq!(a.calls[1], agent_call(1, 1, 2), "every field comes back");
    let whole = agent_call(1, 1, 2);
    let whole_len = whole.request.len() + whole.response.as_ref().map_or(0, String::len);
    assert!(whole.request.len() > 455_000, "{}", whole.request.len());
    let stored = stored_body_bytes(f, 1, 2);
    assert!(
        stored > 0 && (stored as usize) < whole_len / 4,
        "{whole_len} bytes of bodies are stored compressed, in {stored}"
    );
    let c = first.item("r", "c").unwrap().unwrap();
    assert!(c.calls.is_empty(), "refused calls are not stored");
    let json = serde_json::to_value(&c).unwrap();
    assert!(json.get("calls").is_none(), "no calls, no field: {json}");

    let mut all = Vec::new();
    first.scan_calls("r", &mut |call| all.push(call)).unwrap();
    assert_eq!(keys(&all), vec![(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1)]);
    let mut of_b = Vec::new();
    first
        .scan_calls_of("r", 2..=2, &mut |call| of_b.push(call))
        .unwrap();
    assert_eq!(keys(&of_b), vec![(2, 1, 1)]);

    // The item taken over runs its agent once (calls stored, no attempt
    // row, no result) and is claimed again: its next run is attempt 2.
    let calls_only = Batch {
        calls: vec![(taken.id, agent_call(3, 1, 1))],
        ..Batch::default()
    };
    first.commit("r", "one", &calls_only).unwrap();
    first.release("r", "one").unwrap();
    let Claimed::Items(again) = first.claim("r", "one", None, 10, LEASE).unwrap() else {
        panic!("item c is still pending");
    };
    assert_eq!(
        again
            .items
            .iter()
            .map(|i| (i.seq, i.prior_attempts))
            .collect::<Vec<_>>(),
        vec![(3, 1)]
    );
}

/// A chat completion of item `seq`'s attempt `attempt`: its request holds
/// `messages` and, with `tools`, a tool; its answer is `answer`.
fn chat_call(
    seq: u64,
    attempt: u32,
    index: u32,
    messages: serde_json::Value,
    answer: serde_json::Value,
) -> AgentCall {
    AgentCall {
        error_class: None,
        error: None,
        request: serde_json::json!({
            "model": "gpt-4o",
            "messages": messages,
            "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
        })
        .to_string(),
        response: Some(answer.to_string()),
        ..agent_call(seq, attempt, index)
    }
}

fn trajectories_are_each_conversation_of_an_attempt_with_its_steps_and_how_the_attempt_ended(
    f: &Fixture,
) {
    use evalfleet_reports::trajectories::{Attempts, export_trajectories};
    use serde_json::json;

    let mut store = f.open();
    store
        .create_run(&new_run("r"), &mut items(&["a", "b", "c", "d", "e"], None))
        .unwrap();
    store.begin_session("r", &mut worker("one"), false).unwrap();
    let claim = claim_all(&mut *store, "r", "one");

    let user = json!({"role": "user", "content": "Who owns example.com?"});
    let tool_call = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "lookup", "arguments": "{\"domain\":\"example.com\"}"}}
    ]});
    // The tool call as the agent's framework sends it back: content "",
    // its arguments re-serialised.
    let tool_call_back = json!({"role": "assistant", "content": "", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "lookup", "arguments": "{\"domain\": \"example.com\"}"}}
    ]});
    let tool_result = json!({"role": "tool", "tool_call_id": "t1", "content": "IANA"});
    let last_answer = json!({"role": "assistant", "content": "IANA owns it.", "tool_calls": null});
    let solver = json!({"role": "system", "content": "Solve: «IANA»"});
    let mut scored = result(1, "a", ItemStatus::Done);
    scored.assessment.scores.insert(
        "exact_match".to_owned(),
        serde_json::from_value(json!({"value": 1.0})).unwrap(),
    );
    let answered = |seq, number| AttemptRecord {
        error_class: None,
        error: None,
        http_status: None,
        ..attempt(seq, number)
    };
    let batch = Batch {
        results: vec![
            (claim, scored),
            (claim, result(2, "b", ItemStatus::Done)),
            (claim, result(3, "c", ItemStatus::Failed)),
            (claim, result(5, "e", ItemStatus::Done)),
        ],
        attempts: vec![
            (claim, attempt(1, 1)),
            (claim, answered(1, 3)),
            (claim, answered(5, 2)),
        ],
        calls: vec![
            // a: a first run that failed; a second cut short by a stop (no
            // record); then a run holding two conversations side by side (a
            // planner's tool call and answer, a solver's question), and an
            // embedding.
            (
                claim,
                chat_call(1, 1, 1, json!([user]), json!({"content": "wrong run"})),
            ),
            (claim, chat_call(1, 2, 1, json!([user]), tool_call.clone())),
            (claim, chat_call(1, 3, 1, json!([user]), tool_call.clone())),
            (
                claim,
                chat_call(1, 3, 2, json!([solver]), json!({"content": "solved"})),
            ),
            (
                claim,
                chat_call(
                    1,
                    3,
                    3,
                    json!([user, tool_call_back, tool_result]),
                    last_answer,
                ),
            ),
            (
                claim,
                AgentCall {
                    api: "embeddings".to_owned(),
                    ..agent_call(1, 3, 4)
                },
            ),
            // b: its one chat call was cut when stored (an older store).
            (
                claim,
                AgentCall {
                    request_cut: true,
                    error: None,
                    ..agent_call(2, 1, 1)
                },
            ),
            // d: still pending (no result): left out.
            (
                claim,
                chat_call(4, 1, 1, json!([user]), json!({"content": "x"})),
            ),
            // e: a call that failed, made again in the same conversation.
            (
                claim,
                AgentCall {
                    http_status: 500,
                    error: Some("HTTP 500".to_owned()),
                    response: None,
                    ..chat_call(5, 2, 1, json!([user]), json!(null))
                },
            ),
            (
                claim,
                chat_call(5, 2, 2, json!([user]), json!({"content": "IANA"})),
            ),
        ],
        ..Batch::default()
    };
    store.commit("r", "one", &batch).unwrap();
    drop(store);

    let mut store = f.open_read_only();
    let mut export = |attempts| {
        let mut lines = Vec::new();
        let written = export_trajectories(&mut *store, "r", attempts, &mut |t| {
            lines.push(serde_json::to_value(t).unwrap());
            Ok(())
        })
        .unwrap();
        (written, lines)
    };
    let (written, lines) = export(Attempts::Final);
    assert_eq!(
        (
            written.lines,
            written.items,
            written.unreadable,
            written.no_chat
        ),
        (3, 2, 1, 2),
        "a's two conversations and e's are written, b's request was cut, b and c have none"
    );
    let planner = &lines[0];
    assert_eq!(
        (
            &planner["item_id"],
            &planner["attempt"],
            &planner["conversation"],
            &planner["conversations"],
            &planner["calls"],
            &planner["final"],
        ),
        (
            &json!("a"),
            &json!(3),
            &json!(0),
            &json!(2),
            &json!(4),
            &json!(true)
        )
    );
    assert_eq!(planner["scores"], json!({"exact_match": 1.0}));
    assert_eq!(
        planner["messages"],
        json!([
            {"role": "user", "content": "Who owns example.com?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "lookup", "arguments": "{\"domain\": \"example.com\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "t1", "content": "IANA"},
            {"role": "assistant", "content": "IANA owns it."},
        ])
    );
    assert_eq!(
        planner["tools"],
        json!([{"type": "function", "function": {"name": "lookup", "parameters": {}}}])
    );
    let steps = planner["steps"].as_array().unwrap();
    assert_eq!(
        steps
            .iter()
            .map(|s| (s["call_id"].clone(), s["message"].clone()))
            .collect::<Vec<_>>(),
        vec![(json!("1.3.1"), json!(1)), (json!("1.3.3"), json!(3))],
        "each step says where its answer is"
    );
    assert_eq!(
        (
            &steps[1]["prompt_tokens"],
            &steps[1]["completion_tokens"],
            &steps[1]["endpoint"],
            &steps[1]["finish_reason"],
            &steps[1]["latency_ms"],
        ),
        (
            &json!(20),
            &json!(5),
            &json!("e"),
            &json!("stop"),
            &json!(12.5)
        )
    );
    let solver_line = &lines[1];
    assert_eq!(
        (&solver_line["conversation"], &solver_line["messages"]),
        (
            &json!(1),
            &json!([
                {"role": "system", "content": "Solve: «IANA»"},
                {"role": "assistant", "content": "solved"},
            ])
        )
    );
    let retried = &lines[2];
    assert_eq!(retried["item_id"], "e");
    assert_eq!(
        retried["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["http_status"].clone(), s["message"].clone()))
            .collect::<Vec<_>>(),
        vec![(json!(500), json!(null)), (json!(200), json!(1))],
        "a failed call and its retry are steps of one conversation"
    );

    let (written, lines) = export(Attempts::All);
    let ends: Vec<_> = lines
        .iter()
        .map(|l| {
            (
                l["item_id"].as_str().unwrap(),
                l["attempt"].as_u64().unwrap(),
                l["attempt_status"].as_str().unwrap(),
                l["attempt_error"].clone(),
                l["final"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ends,
        vec![
            ("a", 1, "failed", json!("HTTP 500"), false),
            ("a", 2, "unfinished", json!(null), false),
            ("a", 3, "answered", json!(null), true),
            ("a", 3, "answered", json!(null), true),
            ("e", 2, "answered", json!(null), true),
        ],
        "every attempt's conversations, each saying how its attempt ended"
    );
    assert_eq!((written.lines, written.items), (5, 2));
}

fn the_agents_figures_are_per_item_means_of_the_stored_calls(f: &Fixture) {
    let mut store = f.open();
    store
        .create_run(&new_run("r"), &mut items(&["a", "b"], None))
        .unwrap();
    assert_eq!(
        evalfleet_reports::agents(&mut *store, "r").unwrap(),
        None,
        "no calls, no figures"
    );
    store.begin_session("r", &mut worker("one"), false).unwrap();
    let claim = claim_all(&mut *store, "r", "one");
    // a: three calls over two attempts (the first failed, 503); b: one.
    // Each call: 12.5 ms, 20 + 5 tokens.
    let calls = [(1, 1, 1), (1, 2, 1), (1, 2, 2), (2, 2, 1)]
        .map(|(seq, attempt, index)| (claim, agent_call(seq, attempt, index)));
    let batch = Batch {
        calls: calls.to_vec(),
        ..Batch::default()
    };
    store.commit("r", "one", &batch).unwrap();
    let figures = evalfleet_reports::agents(&mut *store, "r")
        .unwrap()
        .unwrap();
    assert_eq!(
        (figures.items, figures.calls, figures.failed_calls),
        (2, 4, 1)
    );
    assert_eq!(figures.calls_per_item.mean, 2.0);
    assert_eq!(figures.tokens_per_item.mean, 50.0);
    assert_eq!(figures.call_ms_per_item.mean, 25.0);
    assert_eq!(figures.attempts_per_item.mean, 1.5);
    assert!(figures.calls_per_item.ci_low < 2.0 && figures.calls_per_item.ci_high > 2.0);
}

fn an_items_wait_is_stored_with_it_and_whoever_claims_it_next_waits_it_out(f: &Fixture) {
    let mut first = f.open();
    let mut second = f.open();
    first
        .create_run(&new_run("r"), &mut items(&["a", "b", "c"], None))
        .unwrap();
    first.begin_session("r", &mut worker("one"), false).unwrap();
    second
        .begin_session("r", &mut worker("two"), false)
        .unwrap();
    let claim = claim_all(&mut *first, "r", "one");
    // Item 2 failed and must wait a long while (a Retry-After), item 3 a
    // moment; then the worker dies (its claims are released).
    let waits = Batch {
        attempts: vec![(claim, attempt(2, 1)), (claim, attempt(3, 1))],
        waits: vec![
            (
                claim,
                NotBefore {
                    seq: 2,
                    wait: Duration::from_secs(600),
                },
            ),
            (
                claim,
                NotBefore {
                    seq: 3,
                    wait: Duration::from_millis(300),
                },
            ),
        ],
        ..Batch::default()
    };
    assert!(first.commit("r", "one", &waits).unwrap().refused.is_empty());
    first.release("r", "one").unwrap();

    // The other worker takes item 1 only; the rest wait, held by nobody.
    let Claimed::Items(now) = second.claim("r", "two", None, 10, LEASE).unwrap() else {
        panic!("item 1 is free");
    };
    assert_eq!(now.items.iter().map(|i| i.seq).collect::<Vec<_>>(), [1]);
    assert_eq!(
        second.claim("r", "two", None, 10, LEASE).unwrap(),
        Claimed::HeldByOthers,
        "items still waiting are not claimed, nor given up on"
    );
    // Once its wait has passed, item 3 is claimed, with its next attempt
    // numbered after the stored one; item 2 still waits.
    std::thread::sleep(Duration::from_millis(350));
    let Claimed::Items(later) = second.claim("r", "two", None, 10, LEASE).unwrap() else {
        panic!("item 3's wait has passed");
    };
    assert_eq!(
        later
            .items
            .iter()
            .map(|i| (i.seq, i.prior_attempts))
            .collect::<Vec<_>>(),
        [(3, 1)]
    );
    // A wait sent under a claim that is not the worker's is refused.
    let stale = Batch {
        waits: vec![(
            claim,
            NotBefore {
                seq: 3,
                wait: Duration::from_secs(600),
            },
        )],
        ..Batch::default()
    };
    assert_eq!(first.commit("r", "one", &stale).unwrap().refused, vec![3]);
}

/// Tests of what only the SQLite store has: its file's schema versions.
mod sqlite_only {
    use super::*;
    use evalfleet_store::SqliteStore;

    #[test]
    fn a_schema_1_store_is_upgraded_in_place_and_keeps_its_results() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.db");
        let mut store = SqliteStore::open(&path).unwrap();
        store
            .create_run(&new_run("r"), &mut items(&["a", "b"], None))
            .unwrap();
        store.begin_session("r", &mut worker("w"), false).unwrap();
        let claim = claim_all(&mut store, "r", "w");
        store
            .commit(
                "r",
                "w",
                &Batch {
                    attempts: vec![(claim, attempt(1, 1))],
                    results: vec![(claim, result(1, "a", ItemStatus::Done))],
                    cache: vec![],
                    calls: vec![],
                    waits: vec![],
                },
            )
            .unwrap();
        drop(store);
        // Back to schema 1: what earlier versions of evalfleet wrote.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "DROP TABLE claims;
             DROP TABLE workers;
             DROP TABLE cache;
             ALTER TABLE results DROP COLUMN parsed;
             ALTER TABLE results DROP COLUMN verdict;
             ALTER TABLE results DROP COLUMN check_error;
             ALTER TABLE results DROP COLUMN scores;
             ALTER TABLE results DROP COLUMN reasks;
             ALTER TABLE results DROP COLUMN judge;
             ALTER TABLE attempts DROP COLUMN cached;
             ALTER TABLE results DROP COLUMN cached;
             ALTER TABLE attempts DROP COLUMN tokens_estimated;
             ALTER TABLE results DROP COLUMN tokens_estimated;
             DROP TABLE samples;
             DROP TABLE kept_reports;
             ALTER TABLE runs DROP COLUMN generation;
             DROP TABLE resource_points;
             ALTER TABLE results DROP COLUMN prompt;
             ALTER TABLE results DROP COLUMN images;
             DROP TABLE agent_calls;
             ALTER TABLE items DROP COLUMN not_before;
             DROP TABLE worker_tallies;
             PRAGMA user_version = 1;",
        )
        .unwrap();
        drop(conn);

        let mut store = SqliteStore::open(&path).unwrap();
        let mut rows = Vec::new();
        store
            .export("r", &mut |row| {
                rows.push(row);
                Ok(())
            })
            .unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].output.as_deref(), Some("answer a"));
        assert_eq!(
            (
                rows[0].parsed.clone(),
                rows[0].valid,
                rows[0].scores.clone()
            ),
            (None, None, None)
        );
        assert_eq!(
            store.cache_stats().unwrap().entries,
            0,
            "the cache table exists"
        );
        let claim = claim_all(&mut store, "r", "w");
        store
            .commit(
                "r",
                "w",
                &Batch {
                    attempts: vec![],
                    results: vec![(claim, result(2, "b", ItemStatus::Done))],
                    cache: vec![cache_entry("k", 1)],
                    calls: vec![],
                    waits: vec![],
                },
            )
            .unwrap();
        assert_eq!(
            store.counts("r").unwrap(),
            StateCounts {
                pending: 0,
                done: 2,
                failed: 0
            }
        );
        let conn = rusqlite::Connection::open(&path).unwrap();
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version as usize, evalfleet_store::SQLITE_SCHEMA_VERSION);
    }
}

/// The PostgreSQL work queue under what only it meets: workers in many
/// processes claiming and committing at once, a commit run twice after a
/// lost connection, and a worker whose items were reaped and claimed by
/// another while it was away. Each worker is a connection of its own.
mod postgres_only {
    use std::collections::{BTreeSet, HashMap};
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// Counts of the rows a test looks at, from the tables themselves:
    /// (attempts, results, agent calls, tallies' done, tallies' failed).
    fn rows(f: &Fixture) -> (i64, i64, i64, i64, i64) {
        let mut sql = f.sql(f.db.as_ref().unwrap());
        let row = sql
            .query_one(
                "SELECT (SELECT COUNT(*) FROM attempts), (SELECT COUNT(*) FROM results),
                        (SELECT COUNT(*) FROM agent_calls),
                        (SELECT COALESCE(SUM(done), 0)::bigint FROM tallies),
                        (SELECT COALESCE(SUM(failed), 0)::bigint FROM tallies)",
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4))
    }

    /// What a worker commits for the items of `claim`: an attempt and a
    /// result each (every fifth failed).
    fn answers(claim: &evalfleet_store::Claim) -> Batch {
        let mut batch = Batch::default();
        for item in &claim.items {
            let status = if item.seq % 5 == 0 {
                ItemStatus::Failed
            } else {
                ItemStatus::Done
            };
            batch
                .attempts
                .push((claim.id, attempt(item.seq, item.prior_attempts + 1)));
            batch
                .results
                .push((claim.id, result(item.seq, &item.item_id, status)));
        }
        batch
    }

    #[test]
    fn workers_claiming_and_committing_at_once_end_every_item_exactly_once() {
        let Some(f) = Fixture::new(Backend::Postgres) else {
            return;
        };
        const ITEMS: usize = 2_000;
        let ids: Vec<String> = (0..ITEMS).map(|i| format!("id{i:04}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let mut store = f.open();
        store
            .create_run(&new_run("r"), &mut items(&refs, None))
            .unwrap();
        // Every item a claim returned, and which worker's claim: no lease
        // runs out here, so an item claimed twice was held by two claims.
        let claimed: Mutex<HashMap<u64, String>> = Mutex::new(HashMap::new());
        let committed = AtomicU64::new(0);
        std::thread::scope(|scope| {
            for w in 0..6usize {
                let (f, claimed, committed) = (&f, &claimed, &committed);
                scope.spawn(move || {
                    let name = format!("w{w}");
                    let mut store = f.open();
                    store.begin_session("r", &mut worker(&name), false).unwrap();
                    let mut after = None;
                    loop {
                        match store.claim("r", &name, after, 5 + w, LEASE).unwrap() {
                            Claimed::Items(claim) => {
                                let mut held = claimed.lock().unwrap();
                                for item in &claim.items {
                                    if let Some(other) = held.insert(item.seq, name.clone()) {
                                        panic!("item {} claimed by {name} and {other}", item.seq);
                                    }
                                }
                                drop(held);
                                after = claim.items.last().map(|i| i.seq);
                                let done = store.commit("r", &name, &answers(&claim)).unwrap();
                                assert_eq!(done.refused, Vec::<u64>::new());
                                assert_eq!(done.results, claim.items.len() as u64);
                                committed.fetch_add(done.results, Ordering::Relaxed);
                            }
                            Claimed::HeldByOthers => {
                                std::thread::sleep(Duration::from_millis(2));
                            }
                            Claimed::Nothing => break,
                        }
                    }
                    store.release("r", &name).unwrap();
                });
            }
        });
        let claimed = claimed.into_inner().unwrap();
        assert_eq!(claimed.len(), ITEMS);
        assert_eq!(committed.load(Ordering::Relaxed), ITEMS as u64);
        let by: BTreeSet<&String> = claimed.values().collect();
        assert!(by.len() > 1, "the workers shared the run: {by:?}");
        let expected = StateCounts {
            pending: 0,
            done: ITEMS as u64 * 4 / 5,
            failed: ITEMS as u64 / 5,
        };
        assert_eq!(store.counts("r").unwrap(), expected);
        assert_eq!(f.recount("r"), expected);
        let n = ITEMS as i64;
        assert_eq!(rows(&f), (n, n, 0, n * 4 / 5, n / 5));
        let mut exported = Vec::new();
        store
            .export("r", &mut |row| {
                exported.push(row.item_id);
                Ok(())
            })
            .unwrap();
        assert_eq!(exported, ids, "one result an item, in dataset order");
    }

    #[test]
    fn a_commit_run_twice_after_a_lost_connection_is_stored_once() {
        let Some(f) = Fixture::new(Backend::Postgres) else {
            return;
        };
        let mut store = f.open();
        store
            .create_run(
                &new_run("r"),
                &mut items(&["a", "b", "c", "d", "e", "f"], None),
            )
            .unwrap();
        store.begin_session("r", &mut worker("w"), false).unwrap();
        let claim = claim_all(&mut *store, "r", "w");
        let batch = Batch {
            attempts: (1..=4).map(|seq| (claim, attempt(seq, 1))).collect(),
            results: vec![
                (claim, result(1, "a", ItemStatus::Done)),
                (claim, result(2, "b", ItemStatus::Done)),
                (claim, result(3, "c", ItemStatus::Failed)),
                (claim, result(4, "d", ItemStatus::Done)),
            ],
            cache: vec![cache_entry("k", 1)],
            calls: vec![(claim, agent_call(1, 1, 1))],
            waits: vec![],
        };
        let first = store.commit("r", "w", &batch).unwrap();
        assert_eq!((first.results, first.refused.clone()), (4, vec![]));
        let generation = store.run("r").unwrap().generation;
        // The same commit again: what a worker does when its connection was
        // lost after COMMIT reached the server (it cannot know it did).
        let again = store.commit("r", "w", &batch).unwrap();
        assert_eq!(again, first, "the same answer: nothing refused");
        let expected = StateCounts {
            pending: 2,
            done: 3,
            failed: 1,
        };
        assert_eq!(store.counts("r").unwrap(), expected, "not doubled");
        assert_eq!(f.recount("r"), expected);
        assert_eq!(rows(&f), (4, 4, 1, 3, 1));
        assert_eq!(store.cache_stats().unwrap().entries, 1);
        assert_eq!(
            store.run("r").unwrap().generation,
            generation,
            "nothing changed"
        );
        // The claim goes on for the items it still holds.
        let rest = Batch {
            results: vec![
                (claim, result(5, "e", ItemStatus::Done)),
                (claim, result(6, "f", ItemStatus::Done)),
            ],
            ..Batch::default()
        };
        assert_eq!(store.commit("r", "w", &rest).unwrap().results, 2);
        assert_eq!(
            store.claim("r", "w", None, 10, LEASE).unwrap(),
            Claimed::Nothing
        );
        assert_eq!(store.counts("r").unwrap().done, 5);
    }

    #[test]
    fn a_commit_of_a_worker_whose_items_were_reaped_and_claimed_again_stores_nothing() {
        let Some(f) = Fixture::new(Backend::Postgres) else {
            return;
        };
        let mut one = f.open();
        let mut two = f.open();
        one.create_run(&new_run("r"), &mut items(&["a", "b", "c"], None))
            .unwrap();
        one.begin_session("r", &mut worker("one"), false).unwrap();
        two.begin_session("r", &mut worker("two"), false).unwrap();
        let mine = claim_all(&mut *one, "r", "one");
        // Worker one is away past its lease; worker two reaps its items
        // and claims them.
        assert_eq!(one.renew("r", "one", Duration::ZERO).unwrap().claims, 1);
        std::thread::sleep(Duration::from_millis(5));
        let Claimed::Items(theirs) = two.claim("r", "two", None, 10, LEASE).unwrap() else {
            panic!("the lapsed claim's items are free");
        };
        assert_eq!(
            theirs
                .items
                .iter()
                .map(|i| (i.seq, i.prior_attempts))
                .collect::<Vec<_>>(),
            [(1, 0), (2, 0), (3, 0)]
        );
        // Worker one's next heartbeat tells it which items it lost, once.
        let renewal = one.renew("r", "one", LEASE).unwrap();
        assert_eq!((renewal.claims, renewal.lost), (0, vec![1, 2, 3]));
        assert!(one.renew("r", "one", LEASE).unwrap().lost.is_empty());
        assert!(two.renew("r", "two", LEASE).unwrap().lost.is_empty());
        // Worker one comes back with everything it made meanwhile.
        let late = Batch {
            attempts: vec![(mine, attempt(1, 1)), (mine, attempt(2, 1))],
            results: vec![
                (mine, result(1, "a", ItemStatus::Done)),
                (mine, result(2, "b", ItemStatus::Failed)),
            ],
            cache: vec![],
            calls: vec![(mine, agent_call(1, 1, 1)), (mine, agent_call(3, 1, 1))],
            waits: vec![(
                mine,
                NotBefore {
                    seq: 3,
                    wait: Duration::from_secs(600),
                },
            )],
        };
        let refused = one.commit("r", "one", &late).unwrap();
        assert_eq!((refused.results, refused.refused), (0, vec![1, 2, 3]));
        assert_eq!(rows(&f), (0, 0, 0, 0, 0), "no attempt, result or call");
        assert_eq!(one.counts("r").unwrap().pending, 3);
        assert_eq!(one.counts("r").unwrap(), f.recount("r"));
        for id in ["a", "b", "c"] {
            let item = two.item("r", id).unwrap().unwrap();
            assert_eq!(item.row.state, ItemState::Pending);
            assert!(item.attempt_records.is_empty() && item.calls.is_empty());
        }
        // Item 3's call and wait were refused with the rest; worker two,
        // whose claim holds the items, commits them.
        assert_eq!(
            two.commit("r", "two", &answers(&theirs)).unwrap().results,
            3
        );
        assert_eq!(rows(&f), (3, 3, 0, 3, 0));
        assert_eq!(two.counts("r").unwrap(), f.recount("r"));
    }
}
