//! A run's items explored: pages of them, filtered and sorted in SQL, and
//! one in full with its attempts and its agent's calls. What the SQLite
//! store answers, this one answers the same, row for row.
//!
//! Pages are keyset-paged: a page starts after the sort key and `seq` of
//! the previous page's last row, so the thousandth page costs what the
//! first does. An item is its fixed row (`item_rows`), its place in the
//! queue (`items`) and its result, if any; an item claimed but not ended
//! (`running`) is pending to whoever looks.
//!
//! JSON is read as SQLite's `json_extract` reads it: a score sorts and
//! filters by its `value` when that is a number (no value: it sorts
//! first); a dataset field compares as the text SQLite makes of it (a
//! string unquoted, a number as written, `true`/`false` as 1/0).

use crate::{
    Explore, ItemCursor, ItemPage, ItemQuery, ItemRecord, ItemRow, ItemState, JudgedRow,
    OUTPUT_PREVIEW, SortKey, StoreError,
};
use evalfleet_types::{AttemptRecord, Scores, Telemetry, Verdict};
use postgres::Row;
use postgres::types::ToSql;

use super::call_row::{
    CALL_COLUMNS, call_from_row, error_class, get_opt_u16, get_tokens, get_u32, unsigned,
};
use super::{PgStore, Tx, json_column, json_err, snapshot, unknown};

/// What an item without a value of the sort key sorts as (first, going
/// up).
const NO_VALUE: f64 = -1e300;

/// The SQL of [`NO_VALUE`].
const NO_VALUE_SQL: &str = "CAST(-1e300 AS double precision)";

/// A query's parameters after the run's row id (`$1`).
type Params = Vec<Box<dyn ToSql + Sync>>;

/// `$N` for a new parameter.
fn bind(params: &mut Params, value: impl ToSql + Sync + 'static) -> String {
    params.push(Box::new(value));
    format!("${}", params.len() + 1)
}

/// The value of metric `key`'s score (a parameter) when it is a number:
/// what SQLite's `json_extract(scores, '$."key".value')` gives for every
/// score evalfleet stores (a value is a number, or absent).
fn score_value(key: &str) -> String {
    format!(
        "CASE WHEN jsonb_typeof(r.scores::jsonb -> {key}::text -> 'value') = 'number'
              THEN (r.scores::jsonb -> {key}::text ->> 'value')::double precision END"
    )
}

/// The text SQLite's `CAST(json_extract(item, '$."key"') AS TEXT)` makes of
/// the dataset row's field `key` (a parameter): a string unquoted, a
/// number as the row writes it, a boolean as 1 or 0, JSON null as NULL.
fn field_text(key: &str) -> String {
    format!(
        "CASE json_typeof(r.item::json -> {key}::text)
              WHEN 'boolean' THEN CASE WHEN (r.item::json ->> {key}::text)::boolean THEN '1' ELSE '0' END
              ELSE r.item::json ->> {key}::text END"
    )
}

/// The SQL of a sort key, as a `double precision` never NULL (items
/// without a value sort as [`NO_VALUE`]).
fn sort_expression(key: &SortKey, params: &mut Params) -> String {
    let column = match key {
        SortKey::Seq => return "ir.seq::double precision".to_owned(),
        SortKey::Latency => "r.latency_ms",
        SortKey::Ttft => "r.ttft_ms",
        SortKey::Tpot => "r.tpot_ms",
        SortKey::CompletionTokens => "r.completion_tokens::double precision",
        SortKey::Attempts => "r.attempts::double precision",
        SortKey::Finished => "r.finished_at::double precision",
        SortKey::Score(metric) => {
            let key = bind(params, metric.clone());
            return format!("COALESCE({}, {NO_VALUE_SQL})", score_value(&key));
        }
    };
    format!("COALESCE({column}, {NO_VALUE_SQL})")
}

/// The columns [`item_row`] reads; `output` is the answer's column (cut to
/// a preview on pages).
fn row_columns(output: &str) -> String {
    format!(
        "ir.seq, ir.item_id, CASE WHEN q.state = 'running' THEN 'pending' ELSE q.state END,
         {output}, COALESCE(r.error, ir.invalid), r.endpoint, r.model, COALESCE(r.attempts, 0),
         r.latency_ms, r.ttft_ms, r.tpot_ms, r.prompt_tokens, r.completion_tokens, r.verdict,
         r.scores, r.item, r.finished_at, r.judge::jsonb ->> 'verdict',
         (r.judge::jsonb ->> 'passed')::bigint, (r.judge::jsonb ->> 'total')::bigint"
    )
}

/// The columns of [`row_columns`].
const ROW_WIDTH: usize = 20;

/// An item with its place in the queue and its result, if any.
const ITEM_TABLES: &str = "item_rows ir
     JOIN items q ON q.rid = ir.rid AND q.seq = ir.seq
     LEFT JOIN results r ON r.rid = ir.rid AND r.seq = ir.seq";

fn item_row(row: &Row) -> Tx<ItemRow> {
    let state: String = row.try_get(2)?;
    let scores: Option<String> = row.try_get(14)?;
    Ok(ItemRow {
        seq: unsigned(row.try_get(0)?, "an item seq")?,
        item_id: row.try_get(1)?,
        state: ItemState::parse(&state)
            .ok_or_else(|| StoreError::Invariant(format!("an item is in state '{state}'")))?,
        output: row.try_get(3)?,
        error: row.try_get(4)?,
        endpoint: row.try_get(5)?,
        model: row.try_get(6)?,
        attempts: get_u32(row, 7, "an attempt count")?,
        latency_ms: row.try_get(8)?,
        ttft_ms: row.try_get(9)?,
        tpot_ms: row.try_get(10)?,
        prompt_tokens: get_tokens(row, 11)?,
        completion_tokens: get_tokens(row, 12)?,
        verdict: row
            .try_get::<_, Option<String>>(13)?
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
        item: json_column(row.try_get(15)?)?,
        finished_at_ms: row.try_get(16)?,
        judged: match row.try_get::<_, Option<String>>(17)? {
            None => None,
            Some(verdict) => Some(JudgedRow {
                verdict,
                passed: unsigned(
                    row.try_get::<_, Option<i64>>(18)?.unwrap_or(0),
                    "a count of tests",
                )?,
                total: unsigned(
                    row.try_get::<_, Option<i64>>(19)?.unwrap_or(0),
                    "a count of tests",
                )?,
            }),
        },
    })
}

impl Explore for PgStore {
    fn items(&mut self, run_id: &str, query: &ItemQuery) -> Result<ItemPage, StoreError> {
        let mut params: Params = Vec::new();
        let key = sort_expression(&query.sort, &mut params);
        let mut filters: Vec<String> = Vec::new();
        if !query.states.is_empty() {
            // A claimed item not ended yet is pending to users.
            let mut states: Vec<String> = Vec::new();
            for state in &query.states {
                states.push(state.as_str().to_owned());
                if *state == ItemState::Pending {
                    states.push("running".to_owned());
                }
            }
            let states = bind(&mut params, states);
            filters.push(format!("q.state = ANY({states}::text[])"));
        }
        for (field, value) in &query.fields {
            let field = bind(&mut params, field.clone());
            let value = bind(&mut params, value.clone());
            filters.push(format!("{} = {value}::text", field_text(&field)));
        }
        for range in &query.scores {
            let metric = bind(&mut params, range.metric.clone());
            let value = score_value(&metric);
            if let Some(min) = range.min {
                let min = bind(&mut params, min);
                filters.push(format!("{value} >= {min}::double precision"));
            }
            if let Some(max) = range.max {
                let max = bind(&mut params, max);
                filters.push(format!("{value} <= {max}::double precision"));
            }
            if range.min.is_none() && range.max.is_none() {
                filters.push(format!("{value} IS NOT NULL"));
            }
        }
        if let Some(class) = query.error_class {
            let class = bind(&mut params, class.as_str().to_owned());
            filters.push(format!(
                "EXISTS (SELECT 1 FROM attempts a WHERE a.rid = ir.rid AND a.seq = ir.seq AND a.error_class = {class}::text)"
            ));
        }
        if let Some(endpoint) = &query.endpoint {
            let endpoint = bind(&mut params, endpoint.clone());
            filters.push(format!("r.endpoint = {endpoint}::text"));
        }
        let (low, high) = query.latency_ms;
        if let Some(low) = low {
            let low = bind(&mut params, low);
            filters.push(format!("r.latency_ms >= {low}::double precision"));
        }
        if let Some(high) = high {
            let high = bind(&mut params, high);
            filters.push(format!("r.latency_ms <= {high}::double precision"));
        }
        let (low, high) = query.completion_tokens;
        if let Some(low) = low {
            let low = bind(&mut params, i64::try_from(low).unwrap_or(i64::MAX));
            filters.push(format!("r.completion_tokens >= {low}::bigint"));
        }
        if let Some(high) = high {
            let high = bind(&mut params, i64::try_from(high).unwrap_or(i64::MAX));
            filters.push(format!("r.completion_tokens <= {high}::bigint"));
        }
        if let Some(text) = query.text.as_deref().filter(|t| !t.is_empty()) {
            // As SQLite's `lower`: the stored text has its ASCII letters
            // lowered (the "C" collation's `lower`), the text looked for
            // is lowered whole.
            let text = bind(&mut params, text.to_lowercase());
            filters.push(format!(
                "(strpos(lower(r.output COLLATE \"C\"), {text}::text) > 0
                  OR strpos(lower(COALESCE(r.error, ir.invalid) COLLATE \"C\"), {text}::text) > 0)"
            ));
        }
        let (order, past) = if query.descending {
            ("DESC", "<")
        } else {
            ("ASC", ">")
        };
        if let Some(after) = query.after {
            let seq = bind(&mut params, i64::try_from(after.seq).unwrap_or(i64::MAX));
            if query.sort == SortKey::Seq {
                filters.push(format!("ir.seq {past} {seq}::bigint"));
            } else {
                let value = bind(&mut params, after.value.unwrap_or(NO_VALUE));
                filters.push(format!(
                    "({key}, ir.seq) {past} ({value}::double precision, {seq}::bigint)"
                ));
            }
        }
        let limit = query.limit.clamp(1, 1000);
        let filters = if filters.is_empty() {
            String::new()
        } else {
            format!(" AND {}", filters.join(" AND "))
        };
        let order_key = if query.sort == SortKey::Seq {
            "ir.seq"
        } else {
            key.as_str()
        };
        let sql = format!(
            "SELECT {columns}, {key} FROM {ITEM_TABLES}
             WHERE ir.rid = $1{filters}
             ORDER BY {order_key} {order}, ir.seq {order}
             LIMIT {}",
            limit + 1,
            columns = row_columns(&format!("left(r.output, {OUTPUT_PREVIEW})")),
        );
        let (mut out, keys) = self.with("cannot list items", |conn| {
            let rid = conn.rid(run_id)?;
            let mut values: Vec<&(dyn ToSql + Sync)> = vec![&rid];
            values.extend(params.iter().map(|p| &**p as &(dyn ToSql + Sync)));
            // One statement: one snapshot of its own.
            let rows = conn.client.query(&sql, &values)?;
            let mut out = Vec::with_capacity(rows.len());
            let mut keys = Vec::with_capacity(rows.len());
            for row in &rows {
                out.push(item_row(row)?);
                keys.push(row.try_get::<_, f64>(ROW_WIDTH)?);
            }
            Ok((out, keys))
        })?;
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
        let sql = format!(
            "SELECT {columns}, r.parsed, r.check_error, COALESCE(r.reasks, 0), r.judge,
                    COALESCE(r.cached, 0), r.prompt
             FROM {ITEM_TABLES}
             WHERE ir.rid = $1 AND ir.item_id = $2",
            columns = row_columns("r.output"),
        );
        self.with("cannot read an item", |conn| {
            let rid = conn.rid(run_id)?;
            let mut tx = snapshot(&mut conn.client)?;
            let Some(found) = tx.query_opt(&sql, &[&rid, &item_id])? else {
                tx.commit()?;
                return Ok(None);
            };
            let row = item_row(&found)?;
            let seq = i64::try_from(row.seq).unwrap_or(i64::MAX);
            let attempts = tx
                .query(
                    "SELECT attempt, session, sent_at, endpoint, model, latency_ms, ttft_ms,
                            tpot_ms, prompt_tokens, completion_tokens, tokens_estimated,
                            finish_reason, http_status, error_class, error
                     FROM attempts WHERE rid = $1 AND seq = $2 ORDER BY attempt",
                    &[&rid, &seq],
                )?
                .iter()
                .map(|a| attempt_record(row.seq, a))
                .collect::<Tx<Vec<_>>>()?;
            let calls = tx
                .query(
                    &format!(
                        "SELECT {CALL_COLUMNS} FROM agent_calls
                         WHERE rid = $1 AND seq = $2 ORDER BY seq, attempt, idx"
                    ),
                    &[&rid, &seq],
                )?
                .iter()
                .map(call_from_row)
                .collect::<Tx<Vec<_>>>()?;
            tx.commit()?;
            Ok(Some(ItemRecord {
                parsed: json_column(found.try_get(ROW_WIDTH)?)?,
                check_error: found.try_get(ROW_WIDTH + 1)?,
                reasks: get_u32(&found, ROW_WIDTH + 2, "a count of reasks")?,
                judge: json_column(found.try_get(ROW_WIDTH + 3)?)?,
                cached: get_u32(&found, ROW_WIDTH + 4, "a count of cached calls")?,
                prompt: found.try_get(ROW_WIDTH + 5)?,
                attempt_records: attempts,
                calls,
                row,
            }))
        })
    }

    fn answers(
        &mut self,
        run_id: &str,
        item_ids: &[&str],
        chars: usize,
    ) -> Result<Vec<Option<String>>, StoreError> {
        let chars = i32::try_from(chars).unwrap_or(i32::MAX);
        self.with("cannot read answers", |conn| {
            let rid = conn.rid(run_id)?;
            let rows = conn.client.query(
                "SELECT ir.item_id, substr(r.output, 1, $3) FROM item_rows ir
                 JOIN results r ON r.rid = ir.rid AND r.seq = ir.seq
                 WHERE ir.rid = $1 AND ir.item_id = ANY($2)",
                &[&rid, &item_ids, &chars],
            )?;
            let mut found = std::collections::HashMap::with_capacity(rows.len());
            for row in &rows {
                found.insert(
                    row.try_get::<_, String>(0)?,
                    row.try_get::<_, Option<String>>(1)?,
                );
            }
            Ok(item_ids
                .iter()
                .map(|id| found.get(*id).cloned().flatten())
                .collect())
        })
    }
}

/// A row of an item's attempts.
fn attempt_record(seq: u64, row: &Row) -> Tx<AttemptRecord> {
    Ok(AttemptRecord {
        seq,
        attempt: get_u32(row, 0, "an attempt number")?,
        session: get_u32(row, 1, "a session number")?,
        sent_at_ms: row.try_get(2)?,
        telemetry: Telemetry {
            endpoint: row.try_get(3)?,
            model: row.try_get(4)?,
            latency_ms: row.try_get(5)?,
            ttft_ms: row.try_get(6)?,
            tpot_ms: row.try_get(7)?,
            prompt_tokens: get_tokens(row, 8)?,
            completion_tokens: get_tokens(row, 9)?,
            tokens_estimated: row.try_get(10)?,
            finish_reason: row.try_get(11)?,
        },
        http_status: get_opt_u16(row, 12, "an HTTP status")?,
        error_class: error_class(row.try_get(13)?)?,
        error: row.try_get(14)?,
    })
}
