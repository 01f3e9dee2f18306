//! Results and attempts read back, and new assessments of stored answers.
//!
//! Scans read through a portal a page of [`PAGE`] rows at a time, so a run
//! of a million results is never held in memory; each page is read whole
//! before its rows are handed out, and the scan remembers the key of the
//! last row handed out, so that a scan run again after a lost connection
//! goes on after it: no row is handed out twice.

use crate::{
    AttemptSample, ExportError, ExportRow, ResultOrder, ResultView, Results, StoreError,
    StoredResult,
};
use evalfleet_types::{Assessment, ErrorClass, ItemStatus, Scores, Verdict, now_ms};
use postgres::Row;
use postgres::types::ToSql;

use super::call_row::{get_u32, unsigned};
use super::{Fail, PgStore, Tx, db_err, json_column, json_err, unknown};
use crate::columns::FAILURE;

/// Rows read per round trip of a scan.
const PAGE: i32 = 1_000;

/// Assessments updated per statement of a rescore.
const ASSESSMENTS_PER_UPDATE: usize = 2_000;

/// A query's parameters, owned (they are made again from the cursor each
/// time a scan is run).
pub(super) type Params = Vec<Box<dyn ToSql + Sync>>;

impl PgStore {
    /// Runs `sql` (its parameters from `params`, given the key of the last
    /// row handed out, or `start`) in a read-only transaction through a
    /// portal, and hands each row, as `decode` reads it, to `each`, a
    /// page at a time; `decode` gives each row's key too. `sql` must order
    /// its rows by that key and begin after the key it is given. Run again
    /// after a lost connection, it goes on after the last row handed out.
    pub(super) fn scan_pages<K, T>(
        &mut self,
        context: &str,
        sql: &str,
        start: K,
        params: impl Fn(&K) -> Params,
        decode: impl Fn(&Row) -> Result<(K, T), StoreError>,
        mut each: impl FnMut(T) -> Tx<()>,
    ) -> Result<(), StoreError> {
        let mut cursor = start;
        self.with(context, |conn| {
            let mut tx = conn
                .client
                .build_transaction()
                .read_only(true)
                .isolation_level(postgres::IsolationLevel::RepeatableRead)
                .start()?;
            let owned = params(&cursor);
            let refs: Vec<&(dyn ToSql + Sync)> = owned.iter().map(|p| &**p).collect();
            let portal = tx.bind(sql, &refs)?;
            loop {
                let rows = tx.query_portal(&portal, PAGE)?;
                let page = rows
                    .iter()
                    .map(&decode)
                    .collect::<Result<Vec<_>, StoreError>>()?;
                for (key, value) in page {
                    each(value)?;
                    cursor = key;
                }
                if rows.len() < PAGE as usize {
                    break;
                }
            }
            tx.commit()?;
            Ok(())
        })
    }
}

/// The columns of [`stored_result`].
const RESULT_COLUMNS: &str = "r.seq, r.item_id, r.status, r.output, r.endpoint, r.model, r.item, r.parsed, \
                              r.verdict, r.check_error, r.scores, r.reasks, r.judge, r.prompt";

/// A result from the columns [`RESULT_COLUMNS`] and [`FAILURE`].
fn stored_result(row: &Row) -> Result<StoredResult, StoreError> {
    let err = db_err("cannot read results");
    let text = |i: usize| row.try_get::<_, Option<&str>>(i).map_err(&err);
    crate::columns::stored_result(
        row.try_get::<_, i64>(0).map_err(&err)? as u64,
        row.try_get::<_, i32>(11).map_err(&err)?.max(0) as u32,
        text,
    )
}

/// A row of `export`, from its query's columns.
fn export_row(row: &Row) -> Result<(i64, ExportRow), StoreError> {
    let err = db_err("cannot export");
    let item = match row.try_get::<_, Option<&str>>(12).map_err(&err)? {
        Some(text) => serde_json::from_str(text).map_err(json_err("a stored item is not JSON"))?,
        None => serde_json::Value::Null,
    };
    let status: &str = row.try_get(1).map_err(&err)?;
    let scores: Option<&str> = row.try_get(15).map_err(&err)?;
    let tokens = |i: usize| -> Result<Option<u64>, StoreError> {
        Ok(row
            .try_get::<_, Option<i64>>(i)
            .map_err(&err)?
            .map(|t| t as u64))
    };
    let exported = ExportRow {
        item_id: row.try_get(0).map_err(&err)?,
        status: ItemStatus::parse(status).map_err(unknown)?,
        output: row.try_get(2).map_err(&err)?,
        error: row.try_get(3).map_err(&err)?,
        endpoint: row.try_get(4).map_err(&err)?,
        model: row.try_get(5).map_err(&err)?,
        attempts: row.try_get::<_, i32>(6).map_err(&err)?.max(0) as u32,
        latency_ms: row.try_get(7).map_err(&err)?,
        ttft_ms: row.try_get(8).map_err(&err)?,
        tpot_ms: row.try_get(9).map_err(&err)?,
        prompt_tokens: tokens(10)?,
        completion_tokens: tokens(11)?,
        tokens_estimated: row.try_get(17).map_err(&err)?,
        item,
        parsed: json_column(row.try_get(13).map_err(&err)?)?,
        valid: row
            .try_get::<_, Option<&str>>(14)
            .map_err(&err)?
            .map(Verdict::parse)
            .transpose()
            .map_err(unknown)?
            .map(|v| v == Verdict::Ok),
        scores: scores
            .map(|text| {
                serde_json::from_str::<Scores>(text)
                    .map_err(json_err("stored scores cannot be read"))
            })
            .transpose()?,
        judge: json_column(row.try_get(16).map_err(&err)?)?,
        check_error: row.try_get(18).map_err(&err)?,
        prompt: row.try_get(19).map_err(&err)?,
        images: row
            .try_get::<_, Option<&str>>(20)
            .map_err(&err)?
            .map(|text| {
                serde_json::from_str(text).map_err(json_err("stored images cannot be read"))
            })
            .transpose()?
            .unwrap_or_default(),
    };
    Ok((row.try_get(21).map_err(&err)?, exported))
}

/// An assessment's columns, as text: parsed, verdict, check_error, scores,
/// judge (the JSON ones as JSON text; no scores is NULL).
type AssessmentColumns = (
    Option<String>,
    Option<&'static str>,
    Option<String>,
    Option<String>,
    Option<String>,
);

fn assessment_columns(a: &Assessment) -> Result<AssessmentColumns, StoreError> {
    let scores = if a.scores.is_empty() {
        None
    } else {
        Some(serde_json::to_string(&a.scores).map_err(json_err("cannot encode scores"))?)
    };
    Ok((
        a.parsed.as_ref().map(ToString::to_string),
        a.verdict.map(Verdict::as_str),
        a.check_error.clone(),
        scores,
        a.code.as_ref().map(ToString::to_string),
    ))
}

/// A seq as stored (a signed integer), those beyond it as its largest.
pub(super) fn stored_seq(seq: u64) -> i64 {
    i64::try_from(seq).unwrap_or(i64::MAX)
}

impl Results for PgStore {
    fn scan_attempts(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(AttemptSample),
    ) -> Result<(), StoreError> {
        let rid = self.with("cannot read attempts", |conn| conn.rid(run_id))?;
        let err = db_err("cannot read attempts");
        self.scan_pages(
            "cannot read attempts",
            "SELECT endpoint, latency_ms, ttft_ms, tpot_ms, completion_tokens, error_class,
                    error IS NOT NULL, seq, attempt
             FROM attempts WHERE rid = $1 AND (seq, attempt) > ($2, $3)
             ORDER BY seq, attempt",
            (-1_i64, 0_i32),
            |&(seq, attempt)| vec![Box::new(rid), Box::new(seq), Box::new(attempt)],
            |row| {
                let class: Option<&str> = row.try_get(5).map_err(&err)?;
                let sample = AttemptSample {
                    endpoint: row.try_get(0).map_err(&err)?,
                    latency_ms: row.try_get(1).map_err(&err)?,
                    ttft_ms: row.try_get(2).map_err(&err)?,
                    tpot_ms: row.try_get(3).map_err(&err)?,
                    completion_tokens: row
                        .try_get::<_, Option<i64>>(4)
                        .map_err(&err)?
                        .map(|t| t as u64),
                    error_class: class.map(ErrorClass::parse).transpose().map_err(unknown)?,
                    failed: row.try_get(6).map_err(&err)?,
                };
                let key = (row.try_get(7).map_err(&err)?, row.try_get(8).map_err(&err)?);
                Ok((key, sample))
            },
            |sample| {
                each(sample);
                Ok(())
            },
        )
    }

    fn scan_results(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(StoredResult),
    ) -> Result<(), StoreError> {
        let rid = self.with("cannot read results", |conn| conn.rid(run_id))?;
        self.scan_pages(
            "cannot read results",
            &format!(
                "SELECT {RESULT_COLUMNS}, {FAILURE}, r.error FROM results r
                 WHERE r.rid = $1 AND r.seq > $2 ORDER BY r.seq"
            ),
            -1_i64,
            |&seq| vec![Box::new(rid), Box::new(seq)],
            |row| {
                let result = stored_result(row)?;
                Ok((result.seq as i64, result))
            },
            |result| {
                each(result);
                Ok(())
            },
        )
    }

    fn results_page(
        &mut self,
        run_id: &str,
        order: ResultOrder,
        after: Option<(&str, u64)>,
        limit: usize,
        with_item: bool,
        each: &mut dyn FnMut(ResultView<'_>) -> Result<(), StoreError>,
    ) -> Result<usize, StoreError> {
        let item = if with_item { "r.item" } else { "NULL" };
        let sql = match order {
            ResultOrder::Seq => format!(
                "SELECT r.seq, r.item_id, r.status, r.verdict, r.scores, {item}, {FAILURE}
                 FROM results r WHERE r.rid = $1 AND r.seq > $2 ORDER BY r.seq LIMIT $3"
            ),
            // Byte order of the ids, as SQLite compares them, whatever
            // the database's collation.
            ResultOrder::Key => format!(
                r#"SELECT r.seq, r.item_id, r.status, r.verdict, r.scores, {item}, {FAILURE}
                   FROM results r
                   WHERE r.rid = $1 AND r.item_id COLLATE "C" > $2
                   ORDER BY r.item_id COLLATE "C" LIMIT $3"#
            ),
        };
        let (after_id, after_seq) = after.map_or(("", -1), |(id, seq)| (id, stored_seq(seq)));
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // A page is as long as its caller asked: read whole, then handed
        // out, so that a read run again hands nothing out twice.
        let rows = self.with("cannot read results", |conn| {
            let rid = conn.rid(run_id)?;
            let rows = match order {
                ResultOrder::Seq => conn.client.query(&sql, &[&rid, &after_seq, &limit])?,
                ResultOrder::Key => conn.client.query(&sql, &[&rid, &after_id, &limit])?,
            };
            Ok(rows)
        })?;
        let err = db_err("cannot read results");
        let mut handed = 0;
        for row in &rows {
            let text = |i: usize| row.try_get::<_, Option<&str>>(i).map_err(&err);
            let seq = row.try_get::<_, i64>(0).map_err(&err)? as u64;
            each(crate::columns::result_view(seq, text)?)?;
            handed += 1;
        }
        Ok(handed)
    }

    fn export(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(ExportRow) -> std::io::Result<()>,
    ) -> Result<(), ExportError> {
        let rid = self.with("cannot export", |conn| conn.rid(run_id))?;
        // A write that failed ends the scan; it is told as what it is.
        let mut write_failed: Option<std::io::Error> = None;
        let scanned = self.scan_pages(
            "cannot export",
            "SELECT r.item_id, r.status, r.output, r.error, r.endpoint, r.model, r.attempts, r.latency_ms,
                    r.ttft_ms, r.tpot_ms, r.prompt_tokens, r.completion_tokens, r.item,
                    r.parsed, r.verdict, r.scores, r.judge, r.tokens_estimated, r.check_error,
                    r.prompt, r.images, r.seq
             FROM results r WHERE r.rid = $1 AND r.seq > $2 ORDER BY r.seq",
            -1_i64,
            |&seq| vec![Box::new(rid), Box::new(seq)],
            export_row,
            |row| {
                each(row).map_err(|err| {
                    write_failed = Some(err);
                    Fail::Store(StoreError::Backend {
                        message: "the export could not be written".to_owned(),
                        source: None,
                    })
                })
            },
        );
        if let Some(err) = write_failed {
            return Err(ExportError::Write(err));
        }
        Ok(scanned?)
    }

    fn attempt_ends_of(
        &mut self,
        run_id: &str,
        seqs: std::ops::RangeInclusive<u64>,
        each: &mut dyn FnMut(crate::AttemptEnd),
    ) -> Result<(), StoreError> {
        let context = "cannot read attempts";
        let rid = self.with(context, |conn| conn.rid(run_id))?;
        let (from, to) = (stored_seq(*seqs.start()), stored_seq(*seqs.end()));
        // Read and checked as every reader of these columns is (a stored
        // number out of range is an invariant broken, not one to wrap).
        let ends = self.with(context, |conn| {
            conn.client
                .query(
                    "SELECT seq, attempt, error FROM attempts
                     WHERE rid = $1 AND seq BETWEEN $2 AND $3 ORDER BY seq, attempt",
                    &[&rid, &from, &to],
                )?
                .iter()
                .map(|row| {
                    Ok(crate::AttemptEnd {
                        seq: unsigned(row.try_get::<_, i64>(0)?, "an item's seq")?,
                        attempt: get_u32(row, 1, "an attempt number")?,
                        error: row.try_get(2)?,
                    })
                })
                .collect::<Tx<Vec<_>>>()
        })?;
        ends.into_iter().for_each(each);
        Ok(())
    }

    fn scan_calls_of(
        &mut self,
        run_id: &str,
        seqs: std::ops::RangeInclusive<u64>,
        each: &mut dyn FnMut(evalfleet_types::AgentCall),
    ) -> Result<(), StoreError> {
        let rid = self.with("cannot read agent calls", |conn| conn.rid(run_id))?;
        self.calls_of(rid, seqs, each)
    }

    fn scan_call_samples(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(crate::CallSample),
    ) -> Result<(), StoreError> {
        let rid = self.with("cannot read agent calls", |conn| conn.rid(run_id))?;
        self.call_samples_of(rid, each)
    }

    fn put_assessments(
        &mut self,
        run_id: &str,
        assessments: &[(u64, Assessment)],
        config: &serde_json::Value,
    ) -> Result<(), StoreError> {
        // Encoded once, outside the transaction (which may run twice). An
        // item assessed twice keeps its last assessment, as when they are
        // applied in turn.
        let mut last: std::collections::HashMap<u64, usize> =
            std::collections::HashMap::with_capacity(assessments.len());
        for (at, (seq, _)) in assessments.iter().enumerate() {
            last.insert(*seq, at);
        }
        let mut columns = Vec::with_capacity(last.len());
        for (at, (seq, a)) in assessments.iter().enumerate() {
            if last.get(seq) == Some(&at) {
                columns.push((stored_seq(*seq), assessment_columns(a)?));
            }
        }
        let config = serde_json::to_string(config).map_err(json_err("cannot store the config"))?;
        self.with("cannot store new scores", |conn| {
            let rid = conn.rid(run_id)?;
            let mut tx = conn.client.transaction()?;
            for chunk in columns.chunks(ASSESSMENTS_PER_UPDATE) {
                let seqs: Vec<i64> = chunk.iter().map(|(seq, _)| *seq).collect();
                let parsed: Vec<Option<&str>> = chunk.iter().map(|(_, c)| c.0.as_deref()).collect();
                let verdicts: Vec<Option<&str>> = chunk.iter().map(|(_, c)| c.1).collect();
                let check_errors: Vec<Option<&str>> =
                    chunk.iter().map(|(_, c)| c.2.as_deref()).collect();
                let scores: Vec<Option<&str>> = chunk.iter().map(|(_, c)| c.3.as_deref()).collect();
                let judges: Vec<Option<&str>> = chunk.iter().map(|(_, c)| c.4.as_deref()).collect();
                tx.execute(
                    "UPDATE results r SET parsed = u.parsed, verdict = u.verdict,
                         check_error = u.check_error, scores = u.scores,
                         judge = COALESCE(u.judge, r.judge)
                     FROM unnest($2::bigint[], $3::text[], $4::text[], $5::text[], $6::text[],
                                 $7::text[]) AS u(seq, parsed, verdict, check_error, scores, judge)
                     WHERE r.rid = $1 AND r.seq = u.seq",
                    &[
                        &rid,
                        &seqs,
                        &parsed,
                        &verdicts,
                        &check_errors,
                        &scores,
                        &judges,
                    ],
                )?;
            }
            tx.execute(
                "UPDATE runs SET config = $2, updated_at = $3, generation = generation + 1
                 WHERE rid = $1",
                &[&rid, &config, &now_ms()],
            )?;
            tx.commit()?;
            Ok(())
        })
    }
}
