//! The calls agents made through the gateway (`kind: exec`), read back in
//! the order they were made: by item, attempt and place in the attempt
//! (the table's key), a page at a time (see `PgStore::scan_pages`).

use std::ops::RangeInclusive;

use crate::{CallSample, StoreError};
use evalfleet_types::AgentCall;
use postgres::Row;

use super::call_row::{CALL_COLUMNS, call_from_row};
use super::results::stored_seq;
use super::{Fail, PgStore, db_err};

/// A call's key: its item, attempt and place, as stored.
type CallKey = (i64, i32, i32);

/// The key of a call row, from its first three columns.
fn call_key(row: &Row) -> Result<CallKey, StoreError> {
    let err = db_err("cannot read agent calls");
    Ok((
        row.try_get(0).map_err(&err)?,
        row.try_get(1).map_err(&err)?,
        row.try_get(2).map_err(&err)?,
    ))
}

/// A number stored as a signed integer, read back as the unsigned one it was.
fn unsigned(value: i32) -> u32 {
    value.max(0) as u32
}

/// A call from the columns [`CALL_COLUMNS`] (read by the one reader of
/// `agent_calls` rows, which `explore` uses too), with its key.
fn agent_call(row: &Row) -> Result<(CallKey, AgentCall), StoreError> {
    let key = call_key(row)?;
    let call = call_from_row(row).map_err(|fail| match fail {
        Fail::Db(err) => StoreError::backend("cannot read agent calls", err),
        Fail::Store(err) => err,
    })?;
    Ok((key, call))
}

/// Before every call's key.
const FIRST: CallKey = (i64::MIN, i32::MIN, i32::MIN);

impl PgStore {
    /// The agent calls of run `rid`'s items whose `seq` is in `seqs`, in
    /// (`seq`, `attempt`, `index`) order.
    pub(super) fn calls_of(
        &mut self,
        rid: i64,
        seqs: RangeInclusive<u64>,
        each: &mut dyn FnMut(AgentCall),
    ) -> Result<(), StoreError> {
        let (from, to) = (stored_seq(*seqs.start()), stored_seq(*seqs.end()));
        self.scan_pages(
            "cannot read agent calls",
            &format!(
                "SELECT {CALL_COLUMNS} FROM agent_calls
                 WHERE rid = $1 AND seq BETWEEN $2 AND $3 AND (seq, attempt, idx) > ($4, $5, $6)
                 ORDER BY seq, attempt, idx"
            ),
            FIRST,
            |&(seq, attempt, idx)| {
                vec![
                    Box::new(rid),
                    Box::new(from),
                    Box::new(to),
                    Box::new(seq),
                    Box::new(attempt),
                    Box::new(idx),
                ]
            },
            agent_call,
            |call| {
                each(call);
                Ok(())
            },
        )
    }

    /// The figures of run `rid`'s agent calls, in key order: the columns
    /// before the bodies only, so the bodies are not sent.
    pub(super) fn call_samples_of(
        &mut self,
        rid: i64,
        each: &mut dyn FnMut(CallSample),
    ) -> Result<(), StoreError> {
        let err = db_err("cannot read agent calls");
        self.scan_pages(
            "cannot read agent calls",
            "SELECT seq, attempt, idx, api, latency_ms, prompt_tokens, completion_tokens, cached,
                    error_class IS NOT NULL OR http_status < 200 OR http_status >= 300,
                    endpoint, ttft_ms, tpot_ms, error_class, failovers
             FROM agent_calls WHERE rid = $1 AND (seq, attempt, idx) > ($2, $3, $4)
             ORDER BY seq, attempt, idx",
            FIRST,
            |&(seq, attempt, idx)| {
                vec![
                    Box::new(rid),
                    Box::new(seq),
                    Box::new(attempt),
                    Box::new(idx),
                ]
            },
            |row| {
                let key = call_key(row)?;
                let sample = CallSample {
                    seq: key.0 as u64,
                    attempt: unsigned(key.1),
                    api: row.try_get(3).map_err(&err)?,
                    latency_ms: row.try_get(4).map_err(&err)?,
                    prompt_tokens: row
                        .try_get::<_, Option<i64>>(5)
                        .map_err(&err)?
                        .map(|t| t as u64),
                    completion_tokens: row
                        .try_get::<_, Option<i64>>(6)
                        .map_err(&err)?
                        .map(|t| t as u64),
                    cached: row.try_get(7).map_err(&err)?,
                    failed: row.try_get(8).map_err(&err)?,
                    endpoint: row.try_get(9).map_err(&err)?,
                    ttft_ms: row.try_get(10).map_err(&err)?,
                    tpot_ms: row.try_get(11).map_err(&err)?,
                    error_class: crate::columns::error_class_column(
                        row.try_get(12).map_err(&err)?,
                    )?,
                    failovers: crate::failovers_of(row.try_get(13).map_err(&err)?)?,
                };
                Ok((key, sample))
            },
            |sample| {
                each(sample);
                Ok(())
            },
        )
    }
}
