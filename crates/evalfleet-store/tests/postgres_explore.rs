//! The PostgreSQL store's pages of items, events, mailbox and resource
//! telemetry, against a live server: each test makes a database of its own
//! and drops it at the end. Where both backends can hold the same rows, the
//! same rows are written to a SQLite store too, and both must answer the
//! same. What both backends must do alike (the cache, kept reports, a
//! bounded resource series, ...) is in the store suite, `tests/store.rs`. Without a server
//! (`EVALFLEET_TEST_POSTGRES`, else `postgres://root@127.0.0.1:5432/test`),
//! the tests are skipped, saying so (and fail under CI).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use evalfleet_store::{
    Events, Explore, FleetMailbox, ItemPage, ItemQuery, ItemRow, ItemState, Resources, ScoreRange,
    SortKey, StoreError,
};
mod common;

use evalfleet_store::{PgStore, SqliteStore};
use evalfleet_testkit::postgres::ScratchDb as Scratch;
use evalfleet_types::{
    AgentCall, ErrorClass, Event, EventKind, FleetAction, FleetChange, RunSample, Telemetry,
};
use postgres::{Client, NoTls};

/// A PostgreSQL store in `db`, and a connection of the test's own to it.
fn open(db: &Scratch) -> (PgStore, Client) {
    let store = PgStore::open(&db.url, false).unwrap();
    let mut client = Client::connect(&db.url, NoTls).unwrap();
    client
        .batch_execute("SET search_path TO evalfleet")
        .unwrap();
    (store, client)
}

/// Registers run `run_id` with `total` items; its row id.
fn pg_run(client: &mut Client, run_id: &str, total: i64) -> i64 {
    client
        .query_one(
            "INSERT INTO runs (run_id, name, status, created_at, updated_at, config, config_dir,
                               fingerprint, digest, dataset, total)
             VALUES ($1, 'test', 'running', 1, 1, '{}', '.', 'f', 'd', 'data.jsonl', $2)
             RETURNING rid",
            &[&run_id, &total],
        )
        .unwrap()
        .get(0)
}

/// An item's result, as both stores hold it.
#[derive(Clone, Default)]
struct Res {
    failed: bool,
    output: Option<String>,
    error: Option<String>,
    endpoint: Option<String>,
    attempts: i32,
    latency_ms: Option<f64>,
    ttft_ms: Option<f64>,
    tpot_ms: Option<f64>,
    prompt_tokens: Option<i64>,
    completion_tokens: Option<i64>,
    item: Option<String>,
    finished_at: i64,
    parsed: Option<String>,
    verdict: Option<String>,
    check_error: Option<String>,
    scores: Option<String>,
    reasks: i32,
    judge: Option<String>,
    cached: i32,
    prompt: Option<String>,
}

/// An attempt, as both stores hold it.
#[derive(Clone)]
struct Att {
    attempt: i32,
    latency_ms: f64,
    http_status: Option<i32>,
    error_class: Option<&'static str>,
    error: Option<String>,
    cached: bool,
}

/// An item: its place in the queue (PostgreSQL's state; SQLite has no
/// `running`), its result and attempts, and its agent's calls.
#[derive(Clone)]
struct It {
    seq: i64,
    id: String,
    state: &'static str,
    invalid: Option<String>,
    result: Option<Res>,
    attempts: Vec<Att>,
    calls: Vec<AgentCall>,
}

fn call(seq: u64, attempt: u32, index: u32) -> AgentCall {
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
            completion_tokens: (index != 2).then_some(5),
            tokens_estimated: index == 1,
            finish_reason: Some("stop".to_owned()),
        },
        stream: index.is_multiple_of(2),
        cached: attempt == 2,
        http_status: 200,
        error_class: (attempt == 1).then_some(ErrorClass::Retryable),
        error: (attempt == 1).then(|| "HTTP 503".to_owned()),
        request: format!(r#"{{"messages":[{{"role":"user","content":"call {index}"}}]}}"#),
        request_cut: index == 2,
        response: Some(r#"{"role":"assistant","content":"ok"}"#.to_owned()),
        tags: (index == 1).then(|| r#"{"user":"u"}"#.to_owned()),
        failovers: Vec::new(),
    }
}

/// A run of 32 items with values and holes of every kind: 20 done (some
/// without TTFT, tokens, a score or with a score that has no value), 5
/// failed, 7 pending (two of them claimed, one invalid row).
fn explored() -> Vec<It> {
    let mut items = Vec::new();
    for seq in 1..=32i64 {
        let id = format!("item-{seq:02}");
        let mut it = It {
            seq,
            id: id.clone(),
            state: "pending",
            invalid: None,
            result: None,
            attempts: Vec::new(),
            calls: Vec::new(),
        };
        if seq <= 25 {
            let failed = seq > 20;
            let em = if seq % 2 == 0 { 1.0 } else { 0.0 };
            let scores = match seq {
                9 => r#"{"other":{"value":0.5}}"#.to_owned(),
                11 => r#"{"em":{"error":"no answer"}}"#.to_owned(),
                13 => r#"{"em":{"value":0.25},"f1":{"value":3}}"#.to_owned(),
                _ => format!(r#"{{"em":{{"value":{em}}},"f1":{{"value":{}}}}}"#, seq % 4),
            };
            let flag = if seq % 4 == 0 { "true" } else { "false" };
            let mut res = Res {
                failed,
                output: (!failed).then(|| match seq {
                    5 => "Réponse ÉCOLE école 100% sure_thing".to_owned(),
                    6 => "ÜBER alles".to_owned(),
                    _ => format!("answer {id}"),
                }),
                error: failed.then(|| format!("gave up after 1 attempts: HTTP 500 on {id}")),
                endpoint: Some(if seq % 3 == 0 { "e2" } else { "e1" }.to_owned()),
                attempts: if seq == 3 { 2 } else { 1 },
                latency_ms: Some(100.0 - seq as f64),
                ttft_ms: (seq % 2 == 0).then_some((seq % 5) as f64),
                tpot_ms: (seq % 3 != 0).then_some(seq as f64 / 10.0),
                prompt_tokens: Some(7),
                completion_tokens: (seq != 6).then_some(seq % 7),
                item: Some(format!(
                    r#"{{"id": "{id}", "category": "{}", "level": {}, "flag": {flag}, "ratio": {}, "none": null, "nested": {{"a":1}}}}"#,
                    if seq % 2 == 0 { "a" } else { "b" },
                    seq % 3,
                    if seq == 8 { "2.5" } else { "1.0" },
                )),
                finished_at: 10_000 + (seq * 37) % 11,
                parsed: (seq == 4).then(|| r#"{"answer":4}"#.to_owned()),
                verdict: (seq <= 10).then(|| if seq == 2 { "invalid" } else { "ok" }.to_owned()),
                check_error: (seq == 2).then(|| "missing field".to_owned()),
                scores: (!failed).then_some(scores),
                reasks: i32::from(seq == 4),
                judge: (seq == 4 || seq == 10).then(|| {
                    format!(
                        r#"{{"verdict":"wrong_answer","passed":{},"total":4}}"#,
                        seq / 4
                    )
                }),
                cached: i32::from(seq == 4),
                prompt: (seq == 4).then(|| "default".to_owned()),
            };
            if seq == 12 {
                res.latency_ms = None;
                res.endpoint = None;
            }
            it.state = if failed { "failed" } else { "done" };
            it.result = Some(res);
        }
        if seq > 20 && seq <= 25 {
            it.attempts.push(Att {
                attempt: 1,
                latency_ms: 5.0,
                http_status: Some(500),
                error_class: Some("retryable"),
                error: Some("HTTP 500".to_owned()),
                cached: false,
            });
        }
        if seq == 3 {
            it.attempts = vec![
                Att {
                    attempt: 2,
                    latency_ms: 9.0,
                    http_status: Some(200),
                    error_class: None,
                    error: None,
                    cached: false,
                },
                Att {
                    attempt: 1,
                    latency_ms: 4.0,
                    http_status: Some(429),
                    error_class: Some("back_pressure"),
                    error: Some("HTTP 429".to_owned()),
                    cached: true,
                },
            ];
        }
        if seq == 4 {
            // Stored out of order: they are read back by attempt and index.
            it.calls = vec![call(4, 2, 1), call(4, 1, 2), call(4, 1, 1)];
        }
        if seq == 26 || seq == 27 {
            it.state = "running";
        }
        if seq == 30 {
            it.invalid = Some("Line 30 is NOT JSON".to_owned());
        }
        items.push(it);
    }
    items
}

fn pg_fill(client: &mut Client, rid: i64, items: &[It]) {
    let mut tx = client.transaction().unwrap();
    for it in items {
        tx.execute(
            "INSERT INTO item_rows (rid, seq, item_id, line, \"offset\", sample_key, invalid)
             VALUES ($1, $2, $3, $2, $2::bigint * 10, $2, $4)",
            &[&rid, &it.seq, &it.id, &it.invalid],
        )
        .unwrap();
        let claimed = it.state != "pending";
        tx.execute(
            "INSERT INTO items (rid, seq, state, attempt, claim_id, owner, lease_until)
             VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $3 = 'running' THEN now() END)",
            &[
                &rid,
                &it.seq,
                &it.state,
                &i32::from(claimed),
                &claimed.then_some(it.seq),
                &claimed.then_some("w"),
            ],
        )
        .unwrap();
        if let Some(r) = &it.result {
            tx.execute(
                "INSERT INTO results (rid, seq, item_id, status, output, error, endpoint, model,
                     attempts, latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens,
                     finish_reason, item, finished_at, parsed, verdict, check_error, scores,
                     reasks, judge, cached, tokens_estimated, prompt, images, claim_attempt, worker)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, 'm', $8, $9, $10, $11, $12, $13, 'stop', $14,
                     $15, $16, $17, $18, $19, $20, $21, $22, false, $23, NULL, 1, 'w')",
                &[
                    &rid,
                    &it.seq,
                    &it.id,
                    &if r.failed { "failed" } else { "done" },
                    &r.output,
                    &r.error,
                    &r.endpoint,
                    &r.attempts,
                    &r.latency_ms,
                    &r.ttft_ms,
                    &r.tpot_ms,
                    &r.prompt_tokens,
                    &r.completion_tokens,
                    &r.item,
                    &r.finished_at,
                    &r.parsed,
                    &r.verdict,
                    &r.check_error,
                    &r.scores,
                    &r.reasks,
                    &r.judge,
                    &r.cached,
                    &r.prompt,
                ],
            )
            .unwrap();
        }
        for a in &it.attempts {
            tx.execute(
                "INSERT INTO attempts (rid, seq, attempt, session, endpoint, model, sent_at,
                     latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens, finish_reason,
                     http_status, error_class, error, cached, tokens_estimated, worker)
                 VALUES ($1, $2, $3, 1, 'e1', 'm', 500, $4, NULL, NULL, 3, NULL, NULL, $5, $6, $7,
                     $8, $9, 'w')",
                &[
                    &rid,
                    &it.seq,
                    &a.attempt,
                    &a.latency_ms,
                    &a.http_status,
                    &a.error_class,
                    &a.error,
                    &a.cached,
                    &(a.attempt == 2),
                ],
            )
            .unwrap();
        }
        for c in &it.calls {
            tx.execute(
                "INSERT INTO agent_calls (rid, seq, attempt, idx, call_id, api, asked_model,
                     sent_at, endpoint, model, latency_ms, ttft_ms, tpot_ms, prompt_tokens,
                     completion_tokens, tokens_estimated, finish_reason, stream, cached,
                     http_status, error_class, error, request, request_cut, response, tags)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
                     $17, $18, $19, $20, $21, $22, $23, $24, $25, $26)",
                &[
                    &rid,
                    &(c.seq as i64),
                    &(c.attempt as i32),
                    &(c.index as i32),
                    &c.call_id,
                    &c.api,
                    &c.asked_model,
                    &c.sent_at_ms,
                    &c.telemetry.endpoint,
                    &c.telemetry.model,
                    &c.telemetry.latency_ms,
                    &c.telemetry.ttft_ms,
                    &c.telemetry.tpot_ms,
                    &c.telemetry.prompt_tokens.map(|t| t as i64),
                    &c.telemetry.completion_tokens.map(|t| t as i64),
                    &c.telemetry.tokens_estimated,
                    &c.telemetry.finish_reason,
                    &c.stream,
                    &c.cached,
                    &i32::from(c.http_status),
                    &c.error_class.map(|e| e.as_str()),
                    &c.error,
                    &c.request,
                    &c.request_cut,
                    &c.response,
                    &c.tags,
                ],
            )
            .unwrap();
        }
    }
    tx.commit().unwrap();
}

/// The same rows in a SQLite store (made by `SqliteStore::open`).
fn sqlite_fill(path: &std::path::Path, run_id: &str, items: &[It]) {
    use rusqlite::params;
    let mut conn = rusqlite::Connection::open(path).unwrap();
    let tx = conn.transaction().unwrap();
    tx.execute(
        "INSERT INTO runs (run_id, name, status, created_at, updated_at, config, config_dir,
                           fingerprint, digest, dataset, total)
         VALUES (?1, 'test', 'running', 1, 1, '{}', '.', 'f', 'd', 'data.jsonl', ?2)",
        params![run_id, items.len() as i64],
    )
    .unwrap();
    let rid = tx.last_insert_rowid();
    for it in items {
        let state = if it.state == "running" {
            "pending"
        } else {
            it.state
        };
        tx.execute(
            "INSERT INTO items (rid, seq, item_id, line, offset, sample_key, state, invalid)
             VALUES (?1, ?2, ?3, ?2, ?2 * 10, ?2, ?4, ?5)",
            params![rid, it.seq, it.id, state, it.invalid],
        )
        .unwrap();
        if let Some(r) = &it.result {
            tx.execute(
                "INSERT INTO results (rid, seq, item_id, status, output, error, endpoint, model,
                     attempts, latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens,
                     finish_reason, item, finished_at, parsed, verdict, check_error, scores,
                     reasks, judge, cached, tokens_estimated, prompt, images)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'm', ?8, ?9, ?10, ?11, ?12, ?13, 'stop', ?14,
                     ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, 0, ?23, NULL)",
                params![
                    rid,
                    it.seq,
                    it.id,
                    if r.failed { "failed" } else { "done" },
                    r.output,
                    r.error,
                    r.endpoint,
                    r.attempts,
                    r.latency_ms,
                    r.ttft_ms,
                    r.tpot_ms,
                    r.prompt_tokens,
                    r.completion_tokens,
                    r.item,
                    r.finished_at,
                    r.parsed,
                    r.verdict,
                    r.check_error,
                    r.scores,
                    r.reasks,
                    r.judge,
                    r.cached,
                    r.prompt,
                ],
            )
            .unwrap();
        }
        for a in &it.attempts {
            tx.execute(
                "INSERT INTO attempts (rid, seq, attempt, session, endpoint, model, sent_at,
                     latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens, finish_reason,
                     http_status, error_class, error, cached, tokens_estimated)
                 VALUES (?1, ?2, ?3, 1, 'e1', 'm', 500, ?4, NULL, NULL, 3, NULL, NULL, ?5, ?6, ?7,
                     ?8, ?9)",
                params![
                    rid,
                    it.seq,
                    a.attempt,
                    a.latency_ms,
                    a.http_status,
                    a.error_class,
                    a.error,
                    a.cached,
                    a.attempt == 2,
                ],
            )
            .unwrap();
        }
        for c in &it.calls {
            tx.execute(
                "INSERT INTO agent_calls (rid, seq, attempt, idx, call_id, api, asked_model,
                     sent_at, endpoint, model, latency_ms, ttft_ms, tpot_ms, prompt_tokens,
                     completion_tokens, tokens_estimated, finish_reason, stream, cached,
                     http_status, error_class, error, request, request_cut, response, tags)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16,
                     ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26)",
                params![
                    rid,
                    c.seq as i64,
                    c.attempt,
                    c.index,
                    c.call_id,
                    c.api,
                    c.asked_model,
                    c.sent_at_ms,
                    c.telemetry.endpoint,
                    c.telemetry.model,
                    c.telemetry.latency_ms,
                    c.telemetry.ttft_ms,
                    c.telemetry.tpot_ms,
                    c.telemetry.prompt_tokens.map(|t| t as i64),
                    c.telemetry.completion_tokens.map(|t| t as i64),
                    c.telemetry.tokens_estimated,
                    c.telemetry.finish_reason,
                    c.stream,
                    c.cached,
                    c.http_status,
                    c.error_class.map(|e| e.as_str()),
                    c.error,
                    c.request,
                    c.request_cut,
                    c.response,
                    c.tags,
                ],
            )
            .unwrap();
        }
    }
    tx.commit().unwrap();
}

/// Every page of `query` (its `after` left out), `limit` rows a page: the
/// rows, and the cursors between the pages.
fn walk(
    store: &mut dyn Explore,
    query: &ItemQuery,
    limit: u32,
) -> (Vec<ItemRow>, Vec<evalfleet_store::ItemCursor>) {
    let mut query = ItemQuery {
        limit,
        after: None,
        ..query.clone()
    };
    let (mut rows, mut cursors) = (Vec::new(), Vec::new());
    loop {
        let page: ItemPage = store.items("r", &query).unwrap();
        assert!(page.rows.len() <= limit as usize);
        rows.extend(page.rows);
        match page.next {
            Some(next) => {
                cursors.push(next);
                query.after = Some(next);
            }
            None => break,
        }
        assert!(cursors.len() < 100, "the pages never end");
    }
    (rows, cursors)
}

fn seqs(rows: &[ItemRow]) -> Vec<u64> {
    rows.iter().map(|r| r.seq).collect()
}

/// Both stores, holding the rows of [`explored`]; `None` without a server.
struct Both {
    pg: PgStore,
    sqlite: SqliteStore,
    // Dropped after the stores.
    _dir: tempfile::TempDir,
    _db: Scratch,
}

fn both() -> Option<Both> {
    let db = evalfleet_testkit::scratch_db!()?;
    let (pg, mut client) = open(&db);
    let items = explored();
    let rid = pg_run(&mut client, "r", items.len() as i64);
    pg_fill(&mut client, rid, &items);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    let sqlite = SqliteStore::open(&path).unwrap();
    sqlite_fill(&path, "r", &items);
    Some(Both {
        pg,
        sqlite,
        _dir: dir,
        _db: db,
    })
}

/// The same pages from both stores; PostgreSQL's rows.
fn same(both: &mut Both, query: &ItemQuery, limit: u32) -> Vec<ItemRow> {
    let (pg, pg_cursors) = walk(&mut both.pg, query, limit);
    let (sqlite, sqlite_cursors) = walk(&mut both.sqlite, query, limit);
    assert_eq!(pg, sqlite, "{query:?}");
    assert_eq!(pg_cursors, sqlite_cursors, "{query:?}");
    pg
}

#[test]
fn pages_of_items_are_those_of_the_sqlite_store_for_every_sort_and_filter() {
    let Some(mut both) = both() else {
        return;
    };
    let sorts = [
        SortKey::Seq,
        SortKey::Latency,
        SortKey::Ttft,
        SortKey::Tpot,
        SortKey::CompletionTokens,
        SortKey::Attempts,
        SortKey::Finished,
        SortKey::Score("em".to_owned()),
        SortKey::Score("f1".to_owned()),
        SortKey::Score("missing".to_owned()),
    ];
    for sort in &sorts {
        for descending in [false, true] {
            for limit in [1, 4, 7, 1000] {
                let query = ItemQuery {
                    sort: sort.clone(),
                    descending,
                    ..ItemQuery::default()
                };
                let rows = same(&mut both, &query, limit);
                assert_eq!(rows.len(), 32, "{query:?}");
            }
        }
    }

    // Dataset order: every item once; claimed ones are pending to users.
    let rows = same(&mut both, &ItemQuery::default(), 5);
    assert_eq!(seqs(&rows), (1..=32).collect::<Vec<u64>>());
    assert_eq!(rows[25].state, ItemState::Pending);
    // Pages carry a preview of the answer, and what the judge said.
    assert_eq!(
        rows[4].output.as_deref(),
        Some("Réponse ÉCOLE école 100% sure_thing")
    );
    let judged = rows[3].judged.as_ref().unwrap();
    assert_eq!(
        (judged.verdict.as_str(), judged.passed, judged.total),
        ("wrong_answer", 1, 4)
    );
    assert_eq!(rows[29].error.as_deref(), Some("Line 30 is NOT JSON"));

    // Latency, slowest first: the item without one comes last, after
    // which nothing can follow its cursor but by seq.
    let by_latency = same(
        &mut both,
        &ItemQuery {
            states: vec![ItemState::Done, ItemState::Failed],
            sort: SortKey::Latency,
            descending: true,
            ..ItemQuery::default()
        },
        3,
    );
    let mut expected: Vec<u64> = (1..=25).filter(|s| *s != 12).collect();
    expected.push(12);
    assert_eq!(seqs(&by_latency), expected);
    // By score, best first; items with no value of it last, by seq down.
    let by_score = same(
        &mut both,
        &ItemQuery {
            sort: SortKey::Score("em".to_owned()),
            descending: true,
            ..ItemQuery::default()
        },
        6,
    );
    assert_eq!(
        &seqs(&by_score)[..11],
        &[20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 13]
    );

    let filters: Vec<ItemQuery> = vec![
        ItemQuery {
            states: vec![ItemState::Pending],
            ..ItemQuery::default()
        },
        ItemQuery {
            states: vec![ItemState::Done],
            ..ItemQuery::default()
        },
        ItemQuery {
            states: vec![ItemState::Failed, ItemState::Pending],
            sort: SortKey::Latency,
            ..ItemQuery::default()
        },
        ItemQuery {
            fields: vec![("category".to_owned(), "a".to_owned())],
            ..ItemQuery::default()
        },
        ItemQuery {
            fields: vec![
                ("level".to_owned(), "0".to_owned()),
                ("category".to_owned(), "b".to_owned()),
            ],
            ..ItemQuery::default()
        },
        ItemQuery {
            fields: vec![("flag".to_owned(), "1".to_owned())],
            ..ItemQuery::default()
        },
        ItemQuery {
            fields: vec![("flag".to_owned(), "0".to_owned())],
            sort: SortKey::Finished,
            descending: true,
            ..ItemQuery::default()
        },
        ItemQuery {
            fields: vec![("flag".to_owned(), "true".to_owned())],
            ..ItemQuery::default()
        },
        ItemQuery {
            fields: vec![("ratio".to_owned(), "2.5".to_owned())],
            ..ItemQuery::default()
        },
        ItemQuery {
            fields: vec![("ratio".to_owned(), "1.0".to_owned())],
            ..ItemQuery::default()
        },
        ItemQuery {
            fields: vec![("none".to_owned(), "null".to_owned())],
            ..ItemQuery::default()
        },
        ItemQuery {
            fields: vec![("nested".to_owned(), r#"{"a":1}"#.to_owned())],
            ..ItemQuery::default()
        },
        ItemQuery {
            fields: vec![("id".to_owned(), "item-07".to_owned())],
            ..ItemQuery::default()
        },
        ItemQuery {
            scores: vec![ScoreRange {
                metric: "em".to_owned(),
                min: Some(0.5),
                max: None,
            }],
            ..ItemQuery::default()
        },
        ItemQuery {
            scores: vec![ScoreRange {
                metric: "em".to_owned(),
                min: None,
                max: Some(0.5),
            }],
            sort: SortKey::Score("em".to_owned()),
            ..ItemQuery::default()
        },
        ItemQuery {
            scores: vec![ScoreRange {
                metric: "em".to_owned(),
                min: None,
                max: None,
            }],
            ..ItemQuery::default()
        },
        ItemQuery {
            scores: vec![ScoreRange {
                metric: "f1".to_owned(),
                min: Some(1.0),
                max: Some(2.0),
            }],
            sort: SortKey::Score("f1".to_owned()),
            descending: true,
            ..ItemQuery::default()
        },
        ItemQuery {
            error_class: Some(ErrorClass::Retryable),
            ..ItemQuery::default()
        },
        ItemQuery {
            error_class: Some(ErrorClass::BackPressure),
            ..ItemQuery::default()
        },
        ItemQuery {
            endpoint: Some("e2".to_owned()),
            sort: SortKey::Tpot,
            ..ItemQuery::default()
        },
        ItemQuery {
            latency_ms: (Some(80.0), Some(95.5)),
            ..ItemQuery::default()
        },
        ItemQuery {
            completion_tokens: (Some(2), Some(4)),
            sort: SortKey::CompletionTokens,
            ..ItemQuery::default()
        },
        ItemQuery {
            completion_tokens: (None, Some(0)),
            ..ItemQuery::default()
        },
        ItemQuery {
            text: Some("HTTP 500 ON ITEM-22".to_owned()),
            ..ItemQuery::default()
        },
        ItemQuery {
            text: Some("école".to_owned()),
            ..ItemQuery::default()
        },
        ItemQuery {
            text: Some("ÉCOLE".to_owned()),
            ..ItemQuery::default()
        },
        ItemQuery {
            text: Some("100%".to_owned()),
            ..ItemQuery::default()
        },
        ItemQuery {
            text: Some("sur_".to_owned()),
            ..ItemQuery::default()
        },
        ItemQuery {
            text: Some("not json".to_owned()),
            ..ItemQuery::default()
        },
        ItemQuery {
            text: Some("über".to_owned()),
            ..ItemQuery::default()
        },
        ItemQuery {
            text: Some(String::new()),
            ..ItemQuery::default()
        },
    ];
    let mut found = Vec::new();
    for query in &filters {
        for descending in [false, true] {
            let query = ItemQuery {
                descending: descending != query.descending,
                ..query.clone()
            };
            let rows = same(&mut both, &query, 2);
            if !descending {
                found.push(seqs(&rows));
            }
        }
    }
    // What a few of them find, to know the stores agree on the right rows.
    assert_eq!(found[0], vec![26, 27, 28, 29, 30, 31, 32]);
    assert_eq!(found[5], vec![4, 8, 12, 16, 20, 24]);
    assert!(found[7].is_empty(), "a boolean compares as 1 or 0");
    assert_eq!(found[8], vec![8]);
    assert_eq!(found[12], vec![7]);
    assert_eq!(found[13], vec![2, 4, 6, 8, 10, 12, 14, 16, 18, 20]);
    assert_eq!(found[18], vec![3]);
    assert_eq!(found[23], vec![22]);
    assert_eq!(found[24], vec![5], "é is found as é only");
    assert_eq!(found[26], vec![5], "% is no wildcard");
    assert!(found[27].is_empty(), "_ is no wildcard");
    assert_eq!(found[28], vec![30]);
    assert!(
        found[29].is_empty(),
        "as SQLite's, lowering is ASCII's: Ü is not found as ü"
    );
    assert_eq!(found[30].len(), 32);
}

#[test]
fn one_item_comes_whole_with_its_attempts_calls_and_answers() {
    let Some(mut both) = both() else {
        return;
    };
    for id in [
        "item-02", "item-03", "item-04", "item-23", "item-26", "item-30", "nope",
    ] {
        assert_eq!(
            both.pg.item("r", id).unwrap(),
            both.sqlite.item("r", id).unwrap(),
            "{id}"
        );
    }
    let item = both.pg.item("r", "item-04").unwrap().unwrap();
    assert_eq!(item.row.output.as_deref(), Some("answer item-04"));
    assert_eq!(item.parsed, Some(serde_json::json!({"answer": 4})));
    assert_eq!((item.reasks, item.cached), (1, 1));
    assert_eq!(item.prompt.as_deref(), Some("default"));
    assert_eq!(item.judge.unwrap()["passed"], 1);
    assert_eq!(
        item.calls,
        vec![call(4, 1, 1), call(4, 1, 2), call(4, 2, 1)]
    );
    let retried = both.pg.item("r", "item-03").unwrap().unwrap();
    let attempts: Vec<(u32, Option<u16>, Option<ErrorClass>, bool)> = retried
        .attempt_records
        .iter()
        .map(|a| {
            (
                a.attempt,
                a.http_status,
                a.error_class,
                a.telemetry.tokens_estimated,
            )
        })
        .collect();
    assert_eq!(
        attempts,
        vec![
            (1, Some(429), Some(ErrorClass::BackPressure), false),
            (2, Some(200), None, true)
        ]
    );
    let claimed = both.pg.item("r", "item-26").unwrap().unwrap();
    assert_eq!(claimed.row.state, ItemState::Pending);
    assert!(claimed.row.output.is_none() && claimed.attempt_records.is_empty());
    assert!(both.pg.item("r", "nope").unwrap().is_none());
    assert!(matches!(
        both.pg.item("other", "item-01"),
        Err(StoreError::NoSuchRun(_))
    ));
    assert!(matches!(
        both.pg.items("other", &ItemQuery::default()),
        Err(StoreError::NoSuchRun(_))
    ));

    let ids = [
        "item-05", "nope", "item-22", "item-30", "item-01", "item-05",
    ];
    for chars in [0, 3, 1000] {
        assert_eq!(
            both.pg.answers("r", &ids, chars).unwrap(),
            both.sqlite.answers("r", &ids, chars).unwrap()
        );
    }
    assert_eq!(
        both.pg.answers("r", &ids, 9).unwrap(),
        vec![
            Some("Réponse É".to_owned()),
            None,
            None,
            None,
            Some("answer it".to_owned()),
            Some("Réponse É".to_owned())
        ]
    );
}

fn sample(at_ms: i64, worker: &str, done: u64) -> RunSample {
    serde_json::from_value(serde_json::json!({
        "at_ms": at_ms,
        "worker": worker,
        "counts": {"pending": 1, "done": done, "failed": 0},
        "endpoints": [],
    }))
    .unwrap()
}

fn snapshot(endpoint: &str, in_flight: u64) -> evalfleet_types::EndpointSnapshot {
    serde_json::from_value(serde_json::json!({
        "endpoint": endpoint,
        "kind": "mock",
        "state": "healthy",
        "limit": 8,
        "adaptive": false,
        "in_flight": in_flight,
        "requests_per_minute": 60,
        "errors": {},
        "restarts": 0,
    }))
    .unwrap()
}

#[test]
fn events_endpoint_states_samples_and_fleet_changes_round_trip() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let (mut store, mut client) = open(&db);
    pg_run(&mut client, "r", 1);
    pg_run(&mut client, "other", 1);

    assert!(store.events("r").unwrap().is_empty());
    let event = |at_ms: i64, kind: EventKind, endpoint: Option<&str>, message: &str| Event {
        at_ms,
        kind,
        endpoint: endpoint.map(str::to_owned),
        message: message.to_owned(),
    };
    let first = vec![
        event(20, EventKind::Ready, Some("e1"), "ready"),
        event(10, EventKind::SessionStarted, None, "session 1"),
        event(20, EventKind::Started, Some("e2"), "started"),
    ];
    store.add_events("r", &first).unwrap();
    store
        .add_events("r", &[event(20, EventKind::Stopped, Some("e1"), "stopped")])
        .unwrap();
    store.add_events("r", &[]).unwrap();
    store
        .add_events("other", &[event(1, EventKind::Finished, None, "x")])
        .unwrap();
    assert_eq!(
        store.events("r").unwrap(),
        vec![
            first[1].clone(),
            first[0].clone(),
            first[2].clone(),
            event(20, EventKind::Stopped, Some("e1"), "stopped")
        ],
        "by time, then in the order they were added"
    );
    assert!(matches!(
        store.add_events("nope", &first),
        Err(StoreError::NoSuchRun(_))
    ));

    assert_eq!(store.endpoint_states("r").unwrap(), None);
    store
        .put_endpoint_states("r", "w1", &[snapshot("b", 1), snapshot("a", 2)])
        .unwrap();
    store
        .put_endpoint_states("r", "w1", &[snapshot("b", 3), snapshot("B", 0)])
        .unwrap();
    let states = store.endpoint_states("r").unwrap().unwrap();
    assert_eq!(
        states.endpoints,
        vec![snapshot("B", 0), snapshot("a", 2), snapshot("b", 3)],
        "by name, as bytes"
    );
    assert!(states.updated_at_ms > 0);
    assert_eq!(store.endpoint_states("other").unwrap(), None);

    store.add_sample("r", &sample(2_000, "w2", 1)).unwrap();
    store.add_sample("r", &sample(1_000, "w1", 1)).unwrap();
    store.add_sample("r", &sample(2_000, "W1", 2)).unwrap();
    // The same second of the same worker again replaces it.
    store.add_sample("r", &sample(2_000, "w2", 5)).unwrap();
    assert_eq!(
        store.samples("r", 0, usize::MAX).unwrap(),
        vec![
            sample(1_000, "w1", 1),
            sample(2_000, "W1", 2),
            sample(2_000, "w2", 5)
        ]
    );
    assert_eq!(
        store.samples("r", 1_000, 1).unwrap(),
        vec![sample(2_000, "W1", 2)]
    );
    assert!(store.samples("other", 0, 10).unwrap().is_empty());

    let change = |action: FleetAction, endpoint: &str, at_ms: i64| FleetChange {
        id: 0,
        action,
        endpoint: endpoint.to_owned(),
        at_ms,
    };
    let add = store
        .request_fleet_change("r", &change(FleetAction::Add, "e3", 5))
        .unwrap();
    let elsewhere = store
        .request_fleet_change("other", &change(FleetAction::Add, "x", 5))
        .unwrap();
    let remove = store
        .request_fleet_change("r", &change(FleetAction::Remove, "e1", 4))
        .unwrap();
    assert!(add.id > 0 && elsewhere.id > add.id && remove.id > elsewhere.id);
    assert_eq!(
        (remove.action, remove.endpoint.as_str(), remove.at_ms),
        (FleetAction::Remove, "e1", 4)
    );
    assert_eq!(
        store.fleet_changes("r", 0).unwrap(),
        vec![add.clone(), remove.clone()]
    );
    assert_eq!(store.fleet_changes("r", add.id).unwrap(), vec![remove]);
    assert_eq!(store.fleet_changes("other", 0).unwrap(), vec![elsewhere]);
}

/// The merging of a series that outgrows its bound is the same on both
/// backends (what it keeps of a series is checked by the store suite,
/// `tests/store.rs`, on each): the same samples make the same points.
#[test]
fn a_resource_series_is_merged_into_the_points_sqlite_makes() {
    use evalfleet_types::{POINTS_PER_SERIES, ResourcePoint};
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let (mut store, mut client) = open(&db);
    pg_run(&mut client, "r", 1);
    let dir = tempfile::tempdir().unwrap();
    let mut sqlite = SqliteStore::open(&dir.path().join("s.db")).unwrap();
    sqlite_fill(&dir.path().join("s.db"), "r", &[]);
    // Ten times the bound (see `resource_writes`).
    let (writes, _, rss) = common::resource_writes();
    let total = 10 * POINTS_PER_SERIES as i64;
    for points in &writes {
        store.add_resource_points("r", points).unwrap();
        sqlite.add_resource_points("r", points).unwrap();
    }
    let again = [ResourcePoint::sample(rss.clone(), (total - 1) * 100, 44.0)];
    store.add_resource_points("r", &again).unwrap();
    sqlite.add_resource_points("r", &again).unwrap();
    assert_eq!(
        store.resource_points("r", i64::MIN).unwrap(),
        sqlite.resource_points("r", i64::MIN).unwrap()
    );
    assert_eq!(
        store.resource_points("r", (total - 2) * 100).unwrap(),
        sqlite.resource_points("r", (total - 2) * 100).unwrap()
    );
}

#[test]
fn writers_of_one_series_at_once_keep_it_bounded_and_lose_no_sample() {
    use evalfleet_types::{
        POINTS_PER_SERIES, ResourceMetric, ResourcePoint, ResourceSeries, ResourceSource,
    };
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let (_, mut client) = open(&db);
    pg_run(&mut client, "r", 1);
    let series = ResourceSeries::new(ResourceSource::Evalfleet, "", ResourceMetric::RssMb);
    let per_writer = 2 * POINTS_PER_SERIES as i64;
    std::thread::scope(|scope| {
        for w in 0..4i64 {
            let (url, series) = (&db.url, &series);
            scope.spawn(move || {
                let mut store = PgStore::open(url, false).unwrap();
                for start in (0..per_writer).step_by(20) {
                    let points: Vec<ResourcePoint> = (start..start + 20)
                        .map(|at| ResourcePoint::sample(series.clone(), (at * 4 + w) * 10, 1.0))
                        .collect();
                    store.add_resource_points("r", &points).unwrap();
                }
            });
        }
    });
    let mut store = PgStore::open(&db.url, true).unwrap();
    let points = store.resource_points("r", i64::MIN).unwrap();
    assert!(points.len() <= POINTS_PER_SERIES, "{} points", points.len());
    assert_eq!(
        points.iter().map(|p| p.samples).sum::<u64>(),
        4 * per_writer as u64
    );
}
