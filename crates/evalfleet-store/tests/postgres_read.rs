//! The PostgreSQL store's runs and results, each test in a
//! scratch database of its own on the server named by
//! `EVALFLEET_TEST_POSTGRES` (by default the local one), compared with what
//! the SQLite store gives for the same input. Without a server, each test
//! is skipped, saying so (and fails under CI). What both backends must do alike (kept
//! reports, the work queue, ...) is in the store suite, `tests/store.rs`.
//!
//! Results are put in with SQL here, to give the reads rows of every kind.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use evalfleet_store::{
    Claimed, CreateRunError, ExportRow, ItemSource, NewItem, NewRun, ResultOrder, Results,
    RunIdentity, Runs, StoreError, WorkQueue,
};
mod common;

use common::{items, worker};
use evalfleet_store::{ListedItems, PgStore, SqliteStore};
use evalfleet_testkit::postgres::ScratchDb as Scratch;
use evalfleet_types::{StateCounts, now_ms};

/// What the tests do with their database (`evalfleet_testkit`'s, made for
/// each test and dropped with it).
trait Open {
    fn store(&self) -> PgStore;
    /// A plain connection, the store's tables in reach.
    fn sql(&self) -> postgres::Client;
}

impl Open for Scratch {
    fn store(&self) -> PgStore {
        PgStore::open(&self.url, false).unwrap()
    }

    fn sql(&self) -> postgres::Client {
        let mut client = self.connect();
        client
            .batch_execute("SET search_path TO evalfleet")
            .unwrap();
        client
    }
}

fn many(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("id{i}")).collect()
}

fn new_run(id: &str, created_at_ms: i64) -> NewRun {
    NewRun {
        run_id: id.to_owned(),
        name: "test".to_owned(),
        config: serde_json::json!({"name": "test"}),
        config_dir: ".".to_owned(),
        created_at_ms,
    }
}

fn sqlite() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("s.db")).unwrap();
    (dir, store)
}

fn exported(store: &mut dyn Results, run_id: &str) -> Vec<ExportRow> {
    let mut rows = Vec::new();
    store
        .export(run_id, &mut |row| {
            rows.push(row);
            Ok(())
        })
        .unwrap();
    rows
}

/// The item ids of run `rid` (1 in a fresh database) by state, from the
/// tables themselves.
fn states(sql: &mut postgres::Client) -> Vec<(String, String)> {
    sql.query(
        "SELECT r.item_id, i.state FROM item_rows r JOIN items i USING (rid, seq)
         WHERE rid = 1 ORDER BY r.seq",
        &[],
    )
    .unwrap()
    .iter()
    .map(|row| (row.get(0), row.get(1)))
    .collect()
}

/// Ends item `seq` of run 1 as `worker` did, with a result: what a commit
/// writes, by hand.
fn end_item(sql: &mut postgres::Client, seq: i64, status: &str, worker: &str) {
    let mut tx = sql.transaction().unwrap();
    tx.execute(
        "UPDATE items SET state = $2, attempt = attempt + 1 WHERE rid = 1 AND seq = $1",
        &[&seq, &status],
    )
    .unwrap();
    tx.execute(
        "INSERT INTO results (rid, seq, item_id, status, output, endpoint, model, attempts,
                              latency_ms, prompt_tokens, completion_tokens, item, finished_at,
                              claim_attempt, worker)
         SELECT 1, seq, item_id, $2, 'answer ' || item_id, 'e', 'm', 1, 1.5, 3, 4,
                '{\"id\": \"' || item_id || '\"}', 1, 1, $3
         FROM item_rows WHERE rid = 1 AND seq = $1",
        &[&seq, &status, &worker],
    )
    .unwrap();
    let (done, failed) = if status == "done" {
        (1_i64, 0_i64)
    } else {
        (0, 1)
    };
    tx.execute(
        "INSERT INTO tallies (rid, worker, done, failed, generation) VALUES (1, $1, $2, $3, 1)
         ON CONFLICT (rid, worker) DO UPDATE SET done = tallies.done + $2,
             failed = tallies.failed + $3, generation = tallies.generation + 1",
        &[&worker, &done, &failed],
    )
    .unwrap();
    if status == "failed" {
        tx.execute(
            "INSERT INTO attempts (rid, seq, attempt, session, endpoint, model, sent_at,
                                   latency_ms, http_status, error_class, error, worker)
             VALUES (1, $1, 1, 1, 'e', 'm', 1, 2.5, 500, 'retryable', 'HTTP 500', $2)",
            &[&seq, &worker],
        )
        .unwrap();
    }
    tx.commit().unwrap();
}

#[test]
fn a_run_is_registered_as_in_sqlite_with_its_invalid_rows_failed() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    let (_dir, mut lite) = sqlite();
    let ids = ["a", "bad1", "b", "c", "d"];
    let run = pg
        .create_run(&new_run("r", 5), &mut items(&ids, None))
        .unwrap();
    let other = lite
        .create_run(&new_run("r", 5), &mut items(&ids, None))
        .unwrap();
    assert_eq!(run.total, 5);
    assert_eq!(run.total, other.total);
    assert_eq!(run.status, other.status);
    assert_eq!(run.sessions, other.sessions);
    assert_eq!(run.fingerprint.digest(), other.fingerprint.digest());
    assert_eq!(run.config, other.config);
    assert_eq!(
        pg.counts("r").unwrap(),
        StateCounts {
            pending: 4,
            done: 0,
            failed: 1
        }
    );
    assert_eq!(pg.counts("r").unwrap(), lite.counts("r").unwrap());
    // The invalid row's result says why, as SQLite's does.
    let rows = exported(&mut pg, "r");
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].error.as_deref(),
        Some("invalid dataset row (line 2): broken row")
    );
    assert_eq!(rows, exported(&mut lite, "r"));
    let mut sql = db.sql();
    assert_eq!(
        states(&mut sql),
        [
            ("a", "pending"),
            ("bad1", "failed"),
            ("b", "pending"),
            ("c", "pending"),
            ("d", "pending")
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );

    // A second run with the same id is refused; runs come newest first.
    assert!(matches!(
        pg.create_run(&new_run("r", 9), &mut items(&["x"], None)),
        Err(CreateRunError::RunExists(id)) if id == "r"
    ));
    pg.create_run(&new_run("s", 9), &mut items(&["x"], None))
        .unwrap();
    pg.create_run(&new_run("t", 9), &mut items(&["x"], None))
        .unwrap();
    let order: Vec<String> = pg.runs().unwrap().into_iter().map(|r| r.run_id).collect();
    assert_eq!(order, ["t", "s", "r"]);
    assert!(matches!(pg.run("nope"), Err(StoreError::NoSuchRun(_))));
    assert!(matches!(pg.counts("nope"), Err(StoreError::NoSuchRun(_))));
}

#[test]
fn a_duplicate_id_is_named_by_its_first_line_and_undoes_everything() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    let (_dir, mut lite) = sqlite();
    let ids = many(9_000);
    let duplicate_lines = |store: &mut dyn Runs, ids: &[&str]| match store
        .create_run(&new_run("r", 1), &mut items(ids, None))
        .unwrap_err()
    {
        CreateRunError::DuplicateId {
            id,
            first_line,
            second_line,
            ..
        } => (id, first_line, second_line),
        other => panic!("{other:?}"),
    };
    let cases: Vec<Vec<&str>> = vec![
        // Within the first batch.
        vec!["a", "b", "a"],
        // Of an earlier batch.
        {
            let mut v: Vec<&str> = ids.iter().map(String::as_str).collect();
            v[6_000] = "id10";
            v
        },
        // Both in one batch: the first in the file's order is named.
        {
            let mut v: Vec<&str> = ids.iter().map(String::as_str).collect();
            v[4_500] = "id4400";
            v[4_600] = "id3";
            v
        },
        {
            let mut v: Vec<&str> = ids.iter().map(String::as_str).collect();
            v[4_500] = "id3";
            v[4_600] = "id4400";
            v
        },
    ];
    for ids in &cases {
        let got = duplicate_lines(&mut pg, ids);
        assert_eq!(got, duplicate_lines(&mut lite, ids));
        assert!(matches!(pg.run("r"), Err(StoreError::NoSuchRun(_))));
        assert!(pg.runs().unwrap().is_empty());
    }
    assert_eq!(duplicate_lines(&mut pg, &cases[0]), ("a".into(), 1, 3));
    let mut sql = db.sql();
    let left: i64 = sql
        .query_one(
            "SELECT (SELECT COUNT(*) FROM item_rows) + (SELECT COUNT(*) FROM items)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "nothing of a refused run stays");
}

#[test]
fn a_sample_keeps_the_same_items_as_sqlite() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    let (_dir, mut lite) = sqlite();
    let ids = many(50);
    let mut refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    refs.push("bad1");
    let run = pg
        .create_run(&new_run("r", 1), &mut items(&refs, Some(7)))
        .unwrap();
    assert_eq!(run.total, 7);
    lite.create_run(&new_run("r", 1), &mut items(&refs, Some(7)))
        .unwrap();
    let mut expected: Vec<(i64, &str)> = refs
        .iter()
        .map(|id| (evalfleet_io::dataset::sample_key(1, id), *id))
        .collect();
    expected.sort();
    let mut expected: Vec<&str> = expected.into_iter().take(7).map(|(_, id)| id).collect();
    expected.sort();
    let mut kept: Vec<String> = states(&mut db.sql())
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    kept.sort();
    assert_eq!(kept, expected);
    assert_eq!(pg.counts("r").unwrap(), lite.counts("r").unwrap());
    assert_eq!(exported(&mut pg, "r"), exported(&mut lite, "r"));
}

#[test]
fn a_session_with_retry_failed_puts_failed_items_back_and_counts_them() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    pg.create_run(
        &new_run("r", 1),
        &mut items(&["a", "bad1", "b", "c", "d"], None),
    )
    .unwrap();
    let g0 = pg.run("r").unwrap().generation;
    let mut w = worker("w");
    let start = pg.begin_session("r", &mut w, false).unwrap();
    assert_eq!((start.session, start.reset, w.session), (1, 0, 1));
    assert_eq!(start.counts.pending, 4);
    let g1 = pg.run("r").unwrap().generation;
    assert!(g1 > g0, "a session changes the generation");

    let mut sql = db.sql();
    end_item(&mut sql, 1, "done", "w");
    end_item(&mut sql, 3, "failed", "w");
    let g2 = pg.run("r").unwrap().generation;
    assert!(g2 > g1, "a commit (its tally) changes the generation");
    assert_eq!(
        pg.counts("r").unwrap(),
        StateCounts {
            pending: 2,
            done: 1,
            failed: 2
        }
    );
    // A running item is pending to the counts.
    sql.execute(
        "UPDATE items SET state = 'running', owner = 'w', lease_until = now() + interval '1 minute'
         WHERE rid = 1 AND seq = 4",
        &[],
    )
    .unwrap();
    assert_eq!(pg.counts("r").unwrap().pending, 2);
    sql.execute(
        "UPDATE items SET state = 'pending', owner = NULL, lease_until = NULL WHERE rid = 1 AND seq = 4",
        &[],
    )
    .unwrap();

    let mut w3 = worker("w3");
    let start = pg.begin_session("r", &mut w3, true).unwrap();
    assert_eq!((start.session, start.reset), (2, 1));
    assert_eq!(
        start.counts,
        StateCounts {
            pending: 3,
            done: 1,
            failed: 1
        }
    );
    assert_eq!(pg.counts("r").unwrap(), start.counts);
    assert!(pg.run("r").unwrap().generation > g2);
    assert_eq!(pg.run("r").unwrap().sessions, 2);
    let rows: Vec<(String, String)> = exported(&mut pg, "r")
        .into_iter()
        .map(|row| (row.item_id, row.status.to_string()))
        .collect();
    let expected = [("a", "done"), ("bad1", "failed")].map(|(a, b)| (a.to_owned(), b.to_owned()));
    assert_eq!(rows, expected);
    assert_eq!(states(&mut sql)[2], ("b".to_owned(), "pending".to_owned()));
    // The failed count is taken off the run's own tally (worker ''), so
    // that the sum is right and each worker's row keeps what it committed.
    let run_failed: i64 = sql
        .query_one(
            "SELECT failed FROM tallies WHERE rid = 1 AND worker = ''",
            &[],
        )
        .unwrap()
        .get(0);
    let w3 = sql
        .query_opt(
            "SELECT failed FROM tallies WHERE rid = 1 AND worker = 'w3'",
            &[],
        )
        .unwrap();
    assert!(w3.is_none(), "the session's worker committed nothing");
    assert_eq!(run_failed, 0, "the invalid row (+1) and the reset (-1)");
    // Again: nothing left to put back but the invalid row, which stays.
    let start = pg.begin_session("r", &mut worker("w4"), true).unwrap();
    assert_eq!((start.session, start.reset), (3, 0));
    assert_eq!(start.counts.failed, 1);
}

#[test]
fn workers_heartbeats_are_read_on_this_machines_clock() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    pg.create_run(&new_run("r", 1), &mut items(&["a"], None))
        .unwrap();
    let mut first = worker("w1");
    pg.begin_session("r", &mut first, false).unwrap();
    let mut second = worker("w2");
    pg.begin_session("r", &mut second, false).unwrap();
    // w1 last beat 40 s ago by the database's clock, whatever the time
    // it was told.
    let mut sql = db.sql();
    sql.execute(
        "UPDATE workers SET heartbeat_at = now() - interval '40 seconds' WHERE worker = 'w1'",
        &[],
    )
    .unwrap();
    let workers = pg.workers("r").unwrap();
    let names: Vec<(&str, u32)> = workers
        .iter()
        .map(|w| (w.worker.as_str(), w.session))
        .collect();
    assert_eq!(names, [("w1", 1), ("w2", 2)]);
    let now = now_ms();
    let age = now - workers[0].heartbeat_at_ms;
    assert!((39_000..=42_000).contains(&age), "{age}");
    assert!(now - workers[1].heartbeat_at_ms < 2_000);
    assert_eq!(workers[0].pid, first.pid);
    assert_eq!(workers[0].process_start, first.process_start);
    assert_eq!(workers[0].started_at_ms, first.started_at_ms);
    assert_eq!(workers[0].lease_ms, 60_000);
    assert_eq!(workers[0].host, first.host);
    // Beginning again replaces its row.
    pg.begin_session("r", &mut first, false).unwrap();
    let workers = pg.workers("r").unwrap();
    assert_eq!(workers.len(), 2);
    assert_eq!(workers[1].worker, "w1");
    assert_eq!(workers[1].session, 3);
}

#[test]
fn scans_go_on_page_after_page_in_order() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    let ids = many(2_500);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    pg.create_run(&new_run("r", 1), &mut items(&refs, None))
        .unwrap();
    let mut sql = db.sql();
    sql.batch_execute(
        "UPDATE items SET state = 'done' WHERE rid = 1;
         INSERT INTO results (rid, seq, item_id, status, attempts, finished_at, claim_attempt, worker)
         SELECT rid, seq, item_id, 'done', 1, 1, 1, 'w' FROM item_rows WHERE rid = 1;
         INSERT INTO tallies (rid, worker, done) VALUES (1, 'w', 2500);
         INSERT INTO agent_calls (rid, seq, attempt, idx, call_id, api, asked_model, sent_at,
                                  endpoint, model, latency_ms, stream, cached, http_status,
                                  request, request_cut)
         SELECT 1, s / 3 + 1, 1, s % 3, s::text, 'chat.completions', 'm', 1, 'e', 'm', 1.0,
                false, false, CASE WHEN s % 2 = 0 THEN 200 ELSE 500 END, '{}', false
         FROM generate_series(0, 2999) AS s;",
    )
    .unwrap();
    let mut seqs = Vec::new();
    pg.scan_results("r", &mut |r| seqs.push(r.seq)).unwrap();
    assert_eq!(seqs, (1..=2_500).collect::<Vec<u64>>());
    assert_eq!(exported(&mut pg, "r").len(), 2_500);
    let mut keys = Vec::new();
    pg.scan_calls("r", &mut |c| keys.push((c.seq, c.attempt, c.index)))
        .unwrap();
    let expected: Vec<(u64, u32, u32)> = (0..3_000).map(|s| (s / 3 + 1, 1, s as u32 % 3)).collect();
    assert_eq!(keys, expected);
    let mut some = Vec::new();
    pg.scan_calls_of("r", 10..=11, &mut |c| some.push((c.seq, c.index)))
        .unwrap();
    assert_eq!(some, [(10, 0), (10, 1), (10, 2), (11, 0), (11, 1), (11, 2)]);
    let mut samples = Vec::new();
    pg.scan_call_samples("r", &mut |s| samples.push(s)).unwrap();
    assert_eq!(samples.len(), 3_000);
    assert_eq!(samples.iter().filter(|s| s.failed).count(), 1_500);
    assert_eq!(pg.counts("r").unwrap().done, 2_500);
}

/// A page of results in item-id order is read from the index
/// `results_by_id` (in the ids' byte order, `COLLATE "C"`), not sorted from
/// the whole run. The statement is `results_page`'s, as `results.rs`
/// writes it for `ResultOrder::Key`.
#[test]
fn a_page_by_item_id_is_read_from_its_index() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    let ids = many(5_000);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    for run in ["r", "s"] {
        pg.create_run(&new_run(run, 1), &mut items(&refs, None))
            .unwrap();
    }
    let mut sql = db.sql();
    sql.batch_execute(
        "UPDATE items SET state = 'done';
         INSERT INTO results (rid, seq, item_id, status, attempts, finished_at, claim_attempt, worker)
         SELECT rid, seq, item_id, 'done', 1, 1, 1, 'w' FROM item_rows;
         ANALYZE results;",
    )
    .unwrap();
    let plan: Vec<String> = sql
        .query(
            r#"EXPLAIN SELECT r.seq, r.item_id, r.status, r.verdict, r.scores, NULL
               FROM results r
               WHERE r.rid = $1 AND r.item_id COLLATE "C" > $2
               ORDER BY r.item_id COLLATE "C" LIMIT $3"#,
            &[&1i64, &"id2", &100i64],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    let plan = plan.join("\n");
    assert!(plan.contains("results_by_id"), "{plan}");
    assert!(!plan.contains("Sort"), "{plan}");
    // And the page is the ids' byte order.
    let mut seen = Vec::new();
    pg.results_page(
        "r",
        ResultOrder::Key,
        Some(("id2", 0)),
        3,
        false,
        &mut |view| {
            seen.push(view.item_id.to_owned());
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(seen, ["id20", "id200", "id2000"]);
}

/// Cuts the store's connections to the scratch database (as a server
/// restart would), from another connection.
fn cut_connections(db: &Scratch) {
    let cut = db
        .connect()
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = 'evalfleet'",
            &[],
        )
        .unwrap();
    assert!(!cut.is_empty() && cut.iter().all(|row| row.get::<_, bool>(0)));
}

#[test]
fn a_scan_cut_off_goes_on_after_the_last_row_handed_out() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    let ids = many(2_500);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    pg.create_run(&new_run("r", 1), &mut items(&refs, None))
        .unwrap();
    db.sql()
        .batch_execute(
            "INSERT INTO results (rid, seq, item_id, status, attempts, finished_at, claim_attempt, worker)
             SELECT rid, seq, item_id, 'done', 1, 1, 1, 'w' FROM item_rows WHERE rid = 1",
        )
        .unwrap();
    let mut seqs = Vec::new();
    pg.scan_results("r", &mut |r| {
        seqs.push(r.seq);
        if r.seq == 1_500 {
            cut_connections(&db);
        }
    })
    .unwrap();
    assert_eq!(seqs, (1..=2_500).collect::<Vec<u64>>());
}

/// Items that cut the store's connections once `cut_at` were pulled.
struct CutOff<'a> {
    items: ListedItems,
    pulled: usize,
    cut_at: usize,
    db: &'a Scratch,
}

impl ItemSource for CutOff<'_> {
    fn next_item(&mut self) -> Result<Option<NewItem>, CreateRunError> {
        self.pulled += 1;
        if self.pulled == self.cut_at {
            cut_connections(self.db);
        }
        self.items.next_item()
    }

    fn finish(&mut self) -> Result<RunIdentity, CreateRunError> {
        self.items.finish()
    }

    fn path(&self) -> String {
        self.items.path()
    }
}

#[test]
fn a_registration_cut_off_stores_nothing_and_says_so() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    let ids = many(9_000);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let mut source = CutOff {
        items: items(&refs, None),
        pulled: 0,
        cut_at: 6_000,
        db: &db,
    };
    let err = pg.create_run(&new_run("r", 1), &mut source).unwrap_err();
    assert!(err.to_string().contains("if not, create it again"), "{err}");
    assert!(matches!(pg.run("r"), Err(StoreError::NoSuchRun(_))));
    // The store works on.
    pg.create_run(&new_run("r", 1), &mut items(&refs, None))
        .unwrap();
    assert_eq!(pg.counts("r").unwrap().pending, 9_000);
}

/// Items that take their time: the first one comes after `pause`.
struct Slow {
    items: ListedItems,
    pause: std::time::Duration,
}

impl ItemSource for Slow {
    fn next_item(&mut self) -> Result<Option<NewItem>, CreateRunError> {
        std::thread::sleep(std::mem::take(&mut self.pause));
        self.items.next_item()
    }

    fn finish(&mut self) -> Result<RunIdentity, CreateRunError> {
        self.items.finish()
    }

    fn path(&self) -> String {
        self.items.path()
    }
}

#[test]
fn of_two_processes_making_one_run_the_second_is_told_it_exists() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut first = db.store();
    let mut second = db.store();
    std::thread::scope(|scope| {
        let slow = scope.spawn(move || {
            let mut source = Slow {
                items: items(&["a", "b"], None),
                pause: std::time::Duration::from_millis(800),
            };
            first
                .create_run(&new_run("r", 1), &mut source)
                .map(|r| r.total)
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        // It waits for the first's transaction, which is still pulling.
        let err = second
            .create_run(&new_run("r", 1), &mut items(&["x"], None))
            .unwrap_err();
        assert!(matches!(err, CreateRunError::RunExists(id) if id == "r"));
        assert_eq!(slow.join().unwrap().unwrap(), 2);
    });
}

#[test]
fn retry_failed_beside_a_commit_that_fails_an_item_leaves_that_item_whole() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    pg.create_run(&new_run("r", 1), &mut items(&["a", "b"], None))
        .unwrap();
    pg.begin_session("r", &mut worker("w1"), false).unwrap();
    let mut sql = db.sql();
    end_item(&mut sql, 1, "failed", "w1");
    // A worker's commit fails item 2 and has not committed yet when a
    // session puts the failed items back: the session does not see it, so
    // item 2 stays as that commit leaves it, failed with its result,
    // never pending with a result left over.
    let mut other = db.sql();
    let mut commit = other.transaction().unwrap();
    commit
        .execute(
            "UPDATE items SET state = 'failed' WHERE rid = 1 AND seq = 2",
            &[],
        )
        .unwrap();
    commit
        .execute(
            "INSERT INTO results (rid, seq, item_id, status, attempts, finished_at, claim_attempt, worker)
             VALUES (1, 2, 'b', 'failed', 1, 1, 1, 'w1')",
            &[],
        )
        .unwrap();
    let reset = pg
        .begin_session("r", &mut worker("w2"), true)
        .unwrap()
        .reset;
    commit.commit().unwrap();
    assert_eq!(reset, 1);
    assert_eq!(
        states(&mut sql),
        [("a", "pending"), ("b", "failed")].map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
    let results: Vec<i64> = sql
        .query("SELECT seq FROM results ORDER BY seq", &[])
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(
        results,
        [2],
        "only the item that stays failed keeps a result"
    );
}

/// A run of one item, claimed by worker `w` (its claim's id), whose lease
/// then ran out (the database down past it).
fn one_item_claimed_then_lapsed(db: &Scratch, pg: &mut PgStore) -> evalfleet_store::ClaimId {
    pg.create_run(&new_run("r", 1), &mut items(&["a"], None))
        .unwrap();
    let mut w = worker("w");
    pg.begin_session("r", &mut w, false).unwrap();
    let Claimed::Items(first) = pg.claim("r", "w", None, 10, LEASE).unwrap() else {
        panic!("the item was not claimed");
    };
    db.sql()
        .execute(
            "UPDATE items SET lease_until = now() - interval '1 second' WHERE rid = 1",
            &[],
        )
        .unwrap();
    first.id
}

const LEASE: std::time::Duration = std::time::Duration::from_secs(60);

#[test]
fn a_worker_whose_lapsed_items_another_is_reaping_is_told_others_hold_them() {
    // w's lease on the run's last item ran out while the database was
    // down; another worker's claim is reaping it (its rows locked, not yet
    // committed). w, having let the item go, claims: it must hear that
    // others hold what is left, not that nothing is (it would end its
    // session with the run unfinished).
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    one_item_claimed_then_lapsed(&db, &mut pg);
    let mut reaper = db.sql();
    let mut tx = reaper.transaction().unwrap();
    tx.query("SELECT seq FROM items WHERE rid = 1 FOR UPDATE", &[])
        .unwrap();
    let claimed = pg.claim("r", "w", Some(1), 10, LEASE).unwrap();
    assert!(matches!(claimed, Claimed::HeldByOthers), "{claimed:?}");
    tx.rollback().unwrap();
}

#[test]
fn a_worker_that_takes_back_an_item_it_lost_is_not_told_it_lost_it() {
    // w's lease ran out while the database was down; its own next claim
    // put the item back and took it again. Its renewal must not say the
    // item was lost (w would let go of the item of its new claim, which
    // would then be held, renewed and answered by no one).
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let mut pg = db.store();
    let first = one_item_claimed_then_lapsed(&db, &mut pg);
    let Claimed::Items(again) = pg.claim("r", "w", Some(1), 10, LEASE).unwrap() else {
        panic!("the lapsed item was not taken back");
    };
    assert_ne!(first, again.id);
    // Nothing is left to tell: a renewal's statement that both renews an
    // item and clears its `lost_by` makes only one of the two changes,
    // and which is not said.
    let lost_by: Option<String> = db
        .sql()
        .query_one("SELECT lost_by FROM items WHERE rid = 1", &[])
        .unwrap()
        .get(0);
    assert_eq!(lost_by, None);
    let renewal = pg.renew("r", "w", LEASE).unwrap();
    assert_eq!(renewal.lost, Vec::<u64>::new());
    assert_eq!(renewal.held, vec![again.id]);
}
