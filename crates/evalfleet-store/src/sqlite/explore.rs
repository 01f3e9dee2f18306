//! A run's items explored: pages of them, filtered and sorted in SQL, and
//! one in full with its attempts.
//!
//! Pages are keyset-paged: a page starts after the sort key and `seq` of
//! the previous page's last row, so the thousandth page costs what the
//! first does. In dataset order the walk follows the items' primary key
//! and stops at the page's last row; filters are tested row by row on the
//! way (a filter that few rows pass reads more of them).

use crate::{
    Explore, ItemCursor, ItemPage, ItemQuery, ItemRecord, ItemRow, ItemState, JudgedRow,
    OUTPUT_PREVIEW, SortKey, StoreError,
};
use evalfleet_types::{AttemptRecord, ErrorClass, Scores, Telemetry, Verdict};
use rusqlite::types::Value as Sql;
use rusqlite::{OptionalExtension, Row, params_from_iter};

use super::{SqliteStore, db_err, json_column, json_err, unknown};

/// What an item without a value of the sort key sorts as (first, going
/// up).
const NO_VALUE: f64 = -1e300;

/// A JSON path to `key` of an object, quoted so that any key is one.
fn json_key(key: &str) -> String {
    format!("$.\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The SQL of a sort key, and whether it is the items' own `seq`.
fn sort_expression(key: &SortKey, params: &mut Vec<Sql>) -> String {
    let column = match key {
        SortKey::Seq => return "i.seq".to_owned(),
        SortKey::Latency => "r.latency_ms",
        SortKey::Ttft => "r.ttft_ms",
        SortKey::Tpot => "r.tpot_ms",
        SortKey::CompletionTokens => "r.completion_tokens",
        SortKey::Attempts => "r.attempts",
        SortKey::Finished => "r.finished_at",
        SortKey::Score(metric) => {
            params.push(Sql::Text(format!("{}.value", json_key(metric))));
            return format!(
                "COALESCE(json_extract(r.scores, ?{}), {NO_VALUE:e})",
                params.len()
            );
        }
    };
    format!("COALESCE({column}, {NO_VALUE:e})")
}

/// `?N` for a new parameter.
fn bind(params: &mut Vec<Sql>, value: Sql) -> String {
    params.push(value);
    format!("?{}", params.len())
}

const ROW_COLUMNS: &str = "i.seq, i.item_id, i.state, r.output, COALESCE(r.error, i.invalid),
    r.endpoint, r.model, COALESCE(r.attempts, 0), r.latency_ms, r.ttft_ms, r.tpot_ms,
    r.prompt_tokens, r.completion_tokens, r.verdict, r.scores, r.item, r.finished_at,
    json_extract(r.judge, '$.verdict'), json_extract(r.judge, '$.passed'),
    json_extract(r.judge, '$.total')";

/// The columns of [`ROW_COLUMNS`].
const ROW_WIDTH: usize = 20;

fn item_row(row: &Row<'_>, preview: bool) -> Result<ItemRow, StoreError> {
    let err = db_err("cannot read an item");
    let state: String = row.get(2).map_err(&err)?;
    let mut output: Option<String> = row.get(3).map_err(&err)?;
    if preview
        && let Some(text) = &mut output
        && let Some((cut, _)) = text.char_indices().nth(OUTPUT_PREVIEW)
    {
        text.truncate(cut);
    }
    let scores: Option<String> = row.get(14).map_err(&err)?;
    Ok(ItemRow {
        seq: row.get::<_, i64>(0).map_err(&err)? as u64,
        item_id: row.get(1).map_err(&err)?,
        state: ItemState::parse(&state)
            .ok_or_else(|| StoreError::Invariant(format!("an item is in state '{state}'")))?,
        output,
        error: row.get(4).map_err(&err)?,
        endpoint: row.get(5).map_err(&err)?,
        model: row.get(6).map_err(&err)?,
        attempts: row.get(7).map_err(&err)?,
        latency_ms: row.get(8).map_err(&err)?,
        ttft_ms: row.get(9).map_err(&err)?,
        tpot_ms: row.get(10).map_err(&err)?,
        prompt_tokens: row
            .get::<_, Option<i64>>(11)
            .map_err(&err)?
            .map(|t| t as u64),
        completion_tokens: row
            .get::<_, Option<i64>>(12)
            .map_err(&err)?
            .map(|t| t as u64),
        verdict: row
            .get::<_, Option<String>>(13)
            .map_err(&err)?
            .as_deref()
            .map(Verdict::parse)
            .transpose()
            .map_err(unknown)?,
        scores: scores
            .map(|text| {
                serde_json::from_str::<Scores>(&text)
                    .map_err(json_err("stored scores cannot be read"))
            })
            .transpose()?,
        item: json_column(row.get(15).map_err(&err)?)?,
        finished_at_ms: row.get(16).map_err(&err)?,
        judged: match row.get::<_, Option<String>>(17).map_err(&err)? {
            None => None,
            Some(verdict) => Some(JudgedRow {
                verdict,
                passed: row.get::<_, Option<i64>>(18).map_err(&err)?.unwrap_or(0) as u64,
                total: row.get::<_, Option<i64>>(19).map_err(&err)?.unwrap_or(0) as u64,
            }),
        },
    })
}

impl Explore for SqliteStore {
    fn items(&mut self, run_id: &str, query: &ItemQuery) -> Result<ItemPage, StoreError> {
        let rid = self.rid(run_id)?;
        let mut params: Vec<Sql> = vec![Sql::Integer(rid)];
        let key = sort_expression(&query.sort, &mut params);
        let mut filters: Vec<String> = Vec::new();
        if !query.states.is_empty() {
            let states: Vec<String> = query
                .states
                .iter()
                .map(|s| bind(&mut params, Sql::Text(s.as_str().to_owned())))
                .collect();
            filters.push(format!("i.state IN ({})", states.join(", ")));
        }
        for (field, value) in &query.fields {
            let path = bind(&mut params, Sql::Text(json_key(field)));
            let value = bind(&mut params, Sql::Text(value.clone()));
            filters.push(format!(
                "CAST(json_extract(r.item, {path}) AS TEXT) = {value}"
            ));
        }
        for range in &query.scores {
            let path = format!("{}.value", json_key(&range.metric));
            let path = bind(&mut params, Sql::Text(path));
            if let Some(min) = range.min {
                let min = bind(&mut params, Sql::Real(min));
                filters.push(format!("json_extract(r.scores, {path}) >= {min}"));
            }
            if let Some(max) = range.max {
                let max = bind(&mut params, Sql::Real(max));
                filters.push(format!("json_extract(r.scores, {path}) <= {max}"));
            }
            if range.min.is_none() && range.max.is_none() {
                filters.push(format!("json_extract(r.scores, {path}) IS NOT NULL"));
            }
        }
        if let Some(class) = query.error_class {
            let class = bind(&mut params, Sql::Text(class.as_str().to_owned()));
            filters.push(format!(
                "EXISTS (SELECT 1 FROM attempts a WHERE a.rid = i.rid AND a.seq = i.seq AND a.error_class = {class})"
            ));
        }
        if let Some(endpoint) = &query.endpoint {
            let endpoint = bind(&mut params, Sql::Text(endpoint.clone()));
            filters.push(format!("r.endpoint = {endpoint}"));
        }
        let (low, high) = query.latency_ms;
        if let Some(low) = low {
            let low = bind(&mut params, Sql::Real(low));
            filters.push(format!("r.latency_ms >= {low}"));
        }
        if let Some(high) = high {
            let high = bind(&mut params, Sql::Real(high));
            filters.push(format!("r.latency_ms <= {high}"));
        }
        let (low, high) = query.completion_tokens;
        if let Some(low) = low {
            let low = bind(&mut params, Sql::Integer(low as i64));
            filters.push(format!("r.completion_tokens >= {low}"));
        }
        if let Some(high) = high {
            let high = bind(&mut params, Sql::Integer(high as i64));
            filters.push(format!("r.completion_tokens <= {high}"));
        }
        if let Some(text) = query.text.as_deref().filter(|t| !t.is_empty()) {
            let text = bind(&mut params, Sql::Text(text.to_lowercase()));
            filters.push(format!(
                "(instr(lower(r.output), {text}) > 0 OR instr(lower(COALESCE(r.error, i.invalid)), {text}) > 0)"
            ));
        }
        let (order, past) = if query.descending {
            ("DESC", "<")
        } else {
            ("ASC", ">")
        };
        if let Some(after) = query.after {
            let seq = bind(&mut params, Sql::Integer(after.seq as i64));
            if query.sort == SortKey::Seq {
                filters.push(format!("i.seq {past} {seq}"));
            } else {
                let value = bind(&mut params, Sql::Real(after.value.unwrap_or(NO_VALUE)));
                filters.push(format!("({key}, i.seq) {past} ({value}, {seq})"));
            }
        }
        let limit = query.limit.clamp(1, 1000);
        let filters = if filters.is_empty() {
            String::new()
        } else {
            format!(" AND {}", filters.join(" AND "))
        };
        let sql = format!(
            "SELECT {ROW_COLUMNS}, {key} FROM items i
             LEFT JOIN results r ON r.rid = i.rid AND r.seq = i.seq
             WHERE i.rid = ?1{filters}
             ORDER BY {key} {order}, i.seq {order}
             LIMIT {}",
            limit + 1
        );
        let err = db_err("cannot list items");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(&err)?;
        let mut rows = stmt.query(params_from_iter(params)).map_err(&err)?;
        let mut out = Vec::new();
        let mut keys = Vec::new();
        while let Some(row) = rows.next().map_err(&err)? {
            out.push(item_row(row, true)?);
            keys.push(row.get::<_, f64>(ROW_WIDTH).map_err(&err)?);
        }
        let next = if out.len() > limit as usize {
            out.truncate(limit as usize);
            out.last().map(|last| ItemCursor {
                value: keys.get(out.len() - 1).copied().filter(|v| *v > NO_VALUE),
                seq: last.seq,
            })
        } else {
            None
        };
        Ok(ItemPage { rows: out, next })
    }

    fn item(&mut self, run_id: &str, item_id: &str) -> Result<Option<ItemRecord>, StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read an item");
        let found = self
            .conn
            .query_row(
                &format!(
                    "SELECT {ROW_COLUMNS}, r.parsed, r.check_error, COALESCE(r.reasks, 0), r.judge,
                            COALESCE(r.cached, 0), r.prompt
                     FROM items i LEFT JOIN results r ON r.rid = i.rid AND r.seq = i.seq
                     WHERE i.rid = ?1 AND i.item_id = ?2"
                ),
                rusqlite::params![rid, item_id],
                |row| {
                    Ok((
                        item_row(row, false),
                        row.get::<_, Option<String>>(ROW_WIDTH)?,
                        row.get::<_, Option<String>>(ROW_WIDTH + 1)?,
                        row.get::<_, u32>(ROW_WIDTH + 2)?,
                        row.get::<_, Option<String>>(ROW_WIDTH + 3)?,
                        row.get::<_, u32>(ROW_WIDTH + 4)?,
                        row.get::<_, Option<String>>(ROW_WIDTH + 5)?,
                    ))
                },
            )
            .optional()
            .map_err(&err)?;
        let Some((row, parsed, check_error, reasks, judge, cached, prompt)) = found else {
            return Ok(None);
        };
        let row = row?;
        let attempts = self.attempts_of(rid, row.seq)?;
        let mut calls = Vec::new();
        self.calls_of(rid, row.seq..=row.seq, &mut |call| calls.push(call))?;
        Ok(Some(ItemRecord {
            row,
            parsed: json_column(parsed)?,
            check_error,
            reasks,
            judge: json_column(judge)?,
            attempt_records: attempts,
            cached,
            prompt,
            calls,
        }))
    }

    fn answers(
        &mut self,
        run_id: &str,
        item_ids: &[&str],
        chars: usize,
    ) -> Result<Vec<Option<String>>, StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read answers");
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT substr(r.output, 1, ?3) FROM items i
                 JOIN results r ON r.rid = i.rid AND r.seq = i.seq
                 WHERE i.rid = ?1 AND i.item_id = ?2",
            )
            .map_err(&err)?;
        item_ids
            .iter()
            .map(|id| {
                stmt.query_row(rusqlite::params![rid, id, chars as i64], |row| {
                    row.get::<_, Option<String>>(0)
                })
                .optional()
                .map(Option::flatten)
                .map_err(&err)
            })
            .collect()
    }
}

impl SqliteStore {
    /// An item's attempts, in order.
    fn attempts_of(&mut self, rid: i64, seq: u64) -> Result<Vec<AttemptRecord>, StoreError> {
        let err = db_err("cannot read attempts");
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT attempt, session, sent_at, endpoint, model, latency_ms, ttft_ms, tpot_ms,
                        prompt_tokens, completion_tokens, tokens_estimated, finish_reason,
                        http_status, error_class, error
                 FROM attempts WHERE rid = ?1 AND seq = ?2 ORDER BY attempt",
            )
            .map_err(&err)?;
        let mut rows = stmt
            .query(rusqlite::params![rid, seq as i64])
            .map_err(&err)?;
        let mut out = Vec::new();
        while let Some(row) = rows.next().map_err(&err)? {
            let class: Option<String> = row.get(13).map_err(&err)?;
            out.push(AttemptRecord {
                seq,
                attempt: row.get(0).map_err(&err)?,
                session: row.get(1).map_err(&err)?,
                sent_at_ms: row.get(2).map_err(&err)?,
                telemetry: Telemetry {
                    endpoint: row.get(3).map_err(&err)?,
                    model: row.get(4).map_err(&err)?,
                    latency_ms: row.get(5).map_err(&err)?,
                    ttft_ms: row.get(6).map_err(&err)?,
                    tpot_ms: row.get(7).map_err(&err)?,
                    prompt_tokens: row
                        .get::<_, Option<i64>>(8)
                        .map_err(&err)?
                        .map(|t| t as u64),
                    completion_tokens: row
                        .get::<_, Option<i64>>(9)
                        .map_err(&err)?
                        .map(|t| t as u64),
                    tokens_estimated: row.get(10).map_err(&err)?,
                    finish_reason: row.get(11).map_err(&err)?,
                },
                http_status: row.get(12).map_err(&err)?,
                error_class: class
                    .as_deref()
                    .map(ErrorClass::parse)
                    .transpose()
                    .map_err(unknown)?,
                error: row.get(14).map_err(&err)?,
            });
        }
        Ok(out)
    }
}
