//! Results and attempts read back, and new assessments of stored answers.

use crate::{
    AttemptSample, ExportError, ExportRow, ResultOrder, ResultView, Results, StoreError,
    StoredResult,
};
use evalfleet_types::{Assessment, ErrorClass, ItemStatus, Scores, Verdict, now_ms};
use rusqlite::params;

use super::{SqliteStore, db_err, json_column, json_err, unknown};
use crate::columns::{FAILURE, assessment_columns};

/// The columns of [`stored_result`].
const RESULT_COLUMNS: &str = "seq, item_id, status, output, endpoint, model, item, parsed, verdict, \
                              check_error, scores, reasks, judge, prompt";

/// A result from the columns seq, item_id, status, output, endpoint,
/// model, item, parsed, verdict, check_error, scores, reasks, judge,
/// prompt, and [`FAILURE`].
fn stored_result(row: &rusqlite::Row<'_>) -> Result<StoredResult, StoreError> {
    let err = db_err("cannot read results");
    let text = |i: usize| -> Result<Option<&str>, StoreError> {
        row.get_ref(i)
            .and_then(|v| v.as_str_or_null().map_err(Into::into))
            .map_err(&err)
    };
    crate::columns::stored_result(
        row.get::<_, i64>(0).map_err(&err)? as u64,
        row.get(11).map_err(&err)?,
        text,
    )
}

impl Results for SqliteStore {
    fn scan_attempts(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(AttemptSample),
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let mut stmt = self
            .conn
            .prepare(
                "SELECT endpoint, latency_ms, ttft_ms, tpot_ms, completion_tokens, error_class,
                        error IS NOT NULL
                 FROM attempts WHERE rid = ?1",
            )
            .map_err(db_err("cannot read attempts"))?;
        let mut rows = stmt.query([rid]).map_err(db_err("cannot read attempts"))?;
        while let Some(row) = rows.next().map_err(db_err("cannot read attempts"))? {
            let class: Option<String> = row.get(5).map_err(db_err("cannot read attempts"))?;
            each(AttemptSample {
                endpoint: row.get(0).map_err(db_err("cannot read attempts"))?,
                latency_ms: row.get(1).map_err(db_err("cannot read attempts"))?,
                ttft_ms: row.get(2).map_err(db_err("cannot read attempts"))?,
                tpot_ms: row.get(3).map_err(db_err("cannot read attempts"))?,
                completion_tokens: row
                    .get::<_, Option<i64>>(4)
                    .map_err(db_err("cannot read attempts"))?
                    .map(|t| t as u64),
                error_class: class
                    .as_deref()
                    .map(ErrorClass::parse)
                    .transpose()
                    .map_err(unknown)?,
                failed: row.get(6).map_err(db_err("cannot read attempts"))?,
            });
        }
        Ok(())
    }

    fn scan_results(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(StoredResult),
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read results");
        let mut stmt = self
            .conn
            .prepare(&format!(
                "SELECT {RESULT_COLUMNS}, {FAILURE}, r.error FROM results r WHERE r.rid = ?1 ORDER BY r.seq"
            ))
            .map_err(&err)?;
        let mut rows = stmt.query([rid]).map_err(&err)?;
        while let Some(row) = rows.next().map_err(&err)? {
            each(stored_result(row)?);
        }
        Ok(())
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
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read results");
        let item = if with_item { "r.item" } else { "NULL" };
        let sql = match order {
            ResultOrder::Seq => format!(
                "SELECT r.seq, r.item_id, r.status, r.verdict, r.scores, {item}, {FAILURE}
                 FROM results r WHERE r.rid = ?1 AND r.seq > ?2 ORDER BY r.seq LIMIT ?4"
            ),
            // Items' ids in order from their index, each item's result by
            // its key: no sort, and a page costs its own rows whatever its
            // place.
            ResultOrder::Key => format!(
                "SELECT r.seq, r.item_id, r.status, r.verdict, r.scores, {item}, {FAILURE}
                 FROM items i INDEXED BY items_by_id
                 CROSS JOIN results r ON r.rid = i.rid AND r.seq = i.seq
                 WHERE i.rid = ?1 AND i.item_id > ?3 ORDER BY i.item_id LIMIT ?4"
            ),
        };
        let mut stmt = self.conn.prepare_cached(&sql).map_err(&err)?;
        let (after_id, after_seq) = after.map_or(("", -1), |(id, seq)| (id, seq as i64));
        let mut rows = stmt
            .query(params![rid, after_seq, after_id, limit as i64])
            .map_err(&err)?;
        let mut handed = 0;
        while let Some(row) = rows.next().map_err(&err)? {
            let text = |i: usize| -> Result<Option<&str>, StoreError> {
                row.get_ref(i)
                    .and_then(|v| v.as_str_or_null().map_err(Into::into))
                    .map_err(&err)
            };
            let seq = row.get::<_, i64>(0).map_err(&err)? as u64;
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
        let rid = self.rid(run_id)?;
        let mut stmt = self
            .conn
            .prepare(
                "SELECT r.item_id, r.status, r.output, r.error, r.endpoint, r.model, r.attempts, r.latency_ms,
                        r.ttft_ms, r.tpot_ms, r.prompt_tokens, r.completion_tokens, r.item,
                        r.parsed, r.verdict, r.scores, r.judge, r.tokens_estimated, r.check_error,
                        r.prompt, r.images
                 FROM results r WHERE r.rid = ?1 ORDER BY r.seq",
            )
            .map_err(db_err("cannot export"))?;
        let mut rows = stmt.query([rid]).map_err(db_err("cannot export"))?;
        while let Some(row) = rows.next().map_err(db_err("cannot export"))? {
            let get_err = db_err("cannot export");
            let item: Option<String> = row.get(12).map_err(&get_err)?;
            let item = match item {
                Some(text) => {
                    serde_json::from_str(&text).map_err(json_err("a stored item is not JSON"))?
                }
                None => serde_json::Value::Null,
            };
            let status: String = row.get(1).map_err(&get_err)?;
            let scores: Option<String> = row.get(15).map_err(&get_err)?;
            each(ExportRow {
                item_id: row.get(0).map_err(&get_err)?,
                status: ItemStatus::parse(&status).map_err(unknown)?,
                output: row.get(2).map_err(&get_err)?,
                error: row.get(3).map_err(&get_err)?,
                endpoint: row.get(4).map_err(&get_err)?,
                model: row.get(5).map_err(&get_err)?,
                attempts: row.get(6).map_err(&get_err)?,
                latency_ms: row.get(7).map_err(&get_err)?,
                ttft_ms: row.get(8).map_err(&get_err)?,
                tpot_ms: row.get(9).map_err(&get_err)?,
                prompt_tokens: row
                    .get::<_, Option<i64>>(10)
                    .map_err(&get_err)?
                    .map(|t| t as u64),
                completion_tokens: row
                    .get::<_, Option<i64>>(11)
                    .map_err(&get_err)?
                    .map(|t| t as u64),
                tokens_estimated: row.get(17).map_err(&get_err)?,
                item,
                parsed: json_column(row.get(13).map_err(&get_err)?)?,
                valid: row
                    .get::<_, Option<String>>(14)
                    .map_err(&get_err)?
                    .as_deref()
                    .map(Verdict::parse)
                    .transpose()
                    .map_err(unknown)?
                    .map(|v| v == Verdict::Ok),
                scores: scores
                    .map(|text| {
                        serde_json::from_str::<Scores>(&text)
                            .map_err(json_err("stored scores cannot be read"))
                    })
                    .transpose()?,
                judge: json_column(row.get(16).map_err(&get_err)?)?,
                check_error: row.get(18).map_err(&get_err)?,
                prompt: row.get(19).map_err(&get_err)?,
                images: row
                    .get::<_, Option<String>>(20)
                    .map_err(&get_err)?
                    .map(|text| {
                        serde_json::from_str(&text)
                            .map_err(json_err("stored images cannot be read"))
                    })
                    .transpose()?
                    .unwrap_or_default(),
            })?;
        }
        Ok(())
    }

    fn attempt_ends_of(
        &mut self,
        run_id: &str,
        seqs: std::ops::RangeInclusive<u64>,
        each: &mut dyn FnMut(crate::AttemptEnd),
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read attempts");
        let clamp = |seq: u64| i64::try_from(seq).unwrap_or(i64::MAX);
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT seq, attempt, error FROM attempts
                 WHERE rid = ?1 AND seq BETWEEN ?2 AND ?3 ORDER BY seq, attempt",
            )
            .map_err(&err)?;
        let mut rows = stmt
            .query(params![rid, clamp(*seqs.start()), clamp(*seqs.end())])
            .map_err(&err)?;
        while let Some(row) = rows.next().map_err(&err)? {
            each(crate::AttemptEnd {
                seq: row.get::<_, i64>(0).map_err(&err)? as u64,
                attempt: row.get(1).map_err(&err)?,
                error: row.get(2).map_err(&err)?,
            });
        }
        Ok(())
    }

    fn scan_calls_of(
        &mut self,
        run_id: &str,
        seqs: std::ops::RangeInclusive<u64>,
        each: &mut dyn FnMut(evalfleet_types::AgentCall),
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        self.calls_of(rid, seqs, each)
    }

    fn scan_call_samples(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(crate::CallSample),
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        self.call_samples_of(rid, each)
    }

    fn put_assessments(
        &mut self,
        run_id: &str,
        assessments: &[(u64, Assessment)],
        config: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot store new scores");
        let tx = self.write("cannot store new scores")?;
        {
            let mut update = tx
                .prepare_cached(
                    "UPDATE results SET parsed = ?3, verdict = ?4, check_error = ?5, scores = ?6,
                         judge = COALESCE(?7, judge)
                     WHERE rid = ?1 AND seq = ?2",
                )
                .map_err(&err)?;
            for (seq, a) in assessments {
                let (parsed, verdict, check_error, scores, _, judge) = assessment_columns(a)?;
                update
                    .execute(params![
                        rid,
                        *seq as i64,
                        parsed,
                        verdict,
                        check_error,
                        scores,
                        judge
                    ])
                    .map_err(&err)?;
            }
            let config =
                serde_json::to_string(config).map_err(json_err("cannot store the config"))?;
            tx.execute(
                "UPDATE runs SET config = ?2, updated_at = ?3, generation = generation + 1
                 WHERE rid = ?1",
                params![rid, config, now_ms()],
            )
            .map_err(&err)?;
        }
        tx.commit().map_err(&err)
    }
}
