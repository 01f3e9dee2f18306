//! The calls agents made through the gateway (`kind: exec`), read back in
//! the order they were made: by item, attempt and place in the attempt.

use std::ops::RangeInclusive;

use crate::{CallSample, StoreError};
use evalfleet_types::{AgentCall, Telemetry};
use rusqlite::params;

use super::{SqliteStore, db_err};

/// The columns [`agent_call`] reads, in its order.
const CALL_COLUMNS: &str = "seq, attempt, idx, call_id, api, asked_model, sent_at, endpoint, model, \
                            latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens, \
                            tokens_estimated, finish_reason, stream, cached, http_status, \
                            error_class, error, request, request_cut, response, tags, failovers, \
                            request_z, response_z";

fn agent_call(row: &rusqlite::Row<'_>) -> Result<AgentCall, StoreError> {
    let err = db_err("cannot read agent calls");
    let tokens = |i: usize| -> Result<Option<u64>, StoreError> {
        Ok(row
            .get::<_, Option<i64>>(i)
            .map_err(&err)?
            .map(|t| t as u64))
    };
    Ok(AgentCall {
        seq: row.get::<_, i64>(0).map_err(&err)? as u64,
        attempt: row.get(1).map_err(&err)?,
        index: row.get(2).map_err(&err)?,
        call_id: row.get(3).map_err(&err)?,
        api: row.get(4).map_err(&err)?,
        asked_model: row.get(5).map_err(&err)?,
        sent_at_ms: row.get(6).map_err(&err)?,
        telemetry: Telemetry {
            endpoint: row.get(7).map_err(&err)?,
            model: row.get(8).map_err(&err)?,
            latency_ms: row.get(9).map_err(&err)?,
            ttft_ms: row.get(10).map_err(&err)?,
            tpot_ms: row.get(11).map_err(&err)?,
            prompt_tokens: tokens(12)?,
            completion_tokens: tokens(13)?,
            tokens_estimated: row.get(14).map_err(&err)?,
            finish_reason: row.get(15).map_err(&err)?,
        },
        stream: row.get(16).map_err(&err)?,
        cached: row.get(17).map_err(&err)?,
        http_status: row.get(18).map_err(&err)?,
        error_class: crate::columns::error_class_column(row.get(19).map_err(&err)?)?,
        error: row.get(20).map_err(&err)?,
        request: crate::columns::unpack(row.get(21).map_err(&err)?, row.get(26).map_err(&err)?)?
            .unwrap_or_default(),
        request_cut: row.get(22).map_err(&err)?,
        response: crate::columns::unpack(row.get(23).map_err(&err)?, row.get(27).map_err(&err)?)?,
        tags: row.get(24).map_err(&err)?,
        failovers: crate::failovers_of(row.get(25).map_err(&err)?)?,
    })
}

impl SqliteStore {
    /// The agent calls of run `rid`'s items whose `seq` is in `seqs`, in
    /// (`seq`, `attempt`, `index`) order: the table's key, so no sort.
    pub(super) fn calls_of(
        &self,
        rid: i64,
        seqs: RangeInclusive<u64>,
        each: &mut dyn FnMut(AgentCall),
    ) -> Result<(), StoreError> {
        let err = db_err("cannot read agent calls");
        let mut stmt = self
            .conn
            .prepare_cached(&format!(
                "SELECT {CALL_COLUMNS} FROM agent_calls
                 WHERE rid = ?1 AND seq BETWEEN ?2 AND ?3
                 ORDER BY seq, attempt, idx"
            ))
            .map_err(&err)?;
        // Seqs are stored as SQLite's signed integers.
        let clamp = |seq: u64| i64::try_from(seq).unwrap_or(i64::MAX);
        let mut rows = stmt
            .query(params![rid, clamp(*seqs.start()), clamp(*seqs.end())])
            .map_err(&err)?;
        while let Some(row) = rows.next().map_err(&err)? {
            each(agent_call(row)?);
        }
        Ok(())
    }

    /// The figures of run `rid`'s agent calls, in key order: the columns
    /// before the bodies only, so the bodies' overflow pages are not read.
    pub(super) fn call_samples_of(
        &self,
        rid: i64,
        each: &mut dyn FnMut(CallSample),
    ) -> Result<(), StoreError> {
        let err = db_err("cannot read agent calls");
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT seq, attempt, api, latency_ms, prompt_tokens, completion_tokens, cached,
                        error_class IS NOT NULL OR http_status < 200 OR http_status >= 300,
                        endpoint, ttft_ms, tpot_ms, error_class, failovers
                 FROM agent_calls WHERE rid = ?1
                 ORDER BY seq, attempt, idx",
            )
            .map_err(&err)?;
        let mut rows = stmt.query([rid]).map_err(&err)?;
        while let Some(row) = rows.next().map_err(&err)? {
            each(CallSample {
                seq: row.get::<_, i64>(0).map_err(&err)? as u64,
                attempt: row.get(1).map_err(&err)?,
                api: row.get(2).map_err(&err)?,
                latency_ms: row.get(3).map_err(&err)?,
                prompt_tokens: row
                    .get::<_, Option<i64>>(4)
                    .map_err(&err)?
                    .map(|t| t as u64),
                completion_tokens: row
                    .get::<_, Option<i64>>(5)
                    .map_err(&err)?
                    .map(|t| t as u64),
                cached: row.get(6).map_err(&err)?,
                failed: row.get(7).map_err(&err)?,
                endpoint: row.get(8).map_err(&err)?,
                ttft_ms: row.get(9).map_err(&err)?,
                tpot_ms: row.get(10).map_err(&err)?,
                error_class: crate::columns::error_class_column(row.get(11).map_err(&err)?)?,
                failovers: crate::failovers_of(row.get(12).map_err(&err)?)?,
            });
        }
        Ok(())
    }
}
