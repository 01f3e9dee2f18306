//! Reading rows of `agent_calls` (and the small conversions every reader
//! of this schema needs): the one reader of call rows, used by `explore`
//! (an item's calls) and `calls` (scans of a run's calls).
//! Integers that Rust holds unsigned are stored as PostgreSQL's signed
//! ones; a stored value out of the Rust type's range is an invariant
//! broken, not a value to wrap.

use crate::StoreError;
use evalfleet_types::{AgentCall, ErrorClass, Telemetry};
use postgres::Row;

use super::{Tx, unknown};

/// The columns [`call_from_row`] reads, in its order.
pub(crate) const CALL_COLUMNS: &str = "seq, attempt, idx, call_id, api, asked_model, sent_at, \
                                       endpoint, model, latency_ms, ttft_ms, tpot_ms, \
                                       prompt_tokens, completion_tokens, tokens_estimated, \
                                       finish_reason, stream, cached, http_status, error_class, \
                                       error, request, request_cut, response, tags, failovers, \
                                       request_z, response_z";

/// An unsigned count or number stored as a signed integer.
pub(crate) fn unsigned<T: TryFrom<i64>>(value: i64, what: &str) -> Tx<T> {
    T::try_from(value).map_err(|_| {
        StoreError::Invariant(format!("the store holds {what} {value}, out of range")).into()
    })
}

/// Column `idx` of `row`: an `integer` read as a `u32`.
pub(crate) fn get_u32(row: &Row, idx: usize, what: &str) -> Tx<u32> {
    unsigned(i64::from(row.try_get::<_, i32>(idx)?), what)
}

/// Column `idx` of `row`: a nullable `integer` read as a `u16` (an HTTP
/// status).
pub(crate) fn get_opt_u16(row: &Row, idx: usize, what: &str) -> Tx<Option<u16>> {
    row.try_get::<_, Option<i32>>(idx)?
        .map(|v| unsigned(i64::from(v), what))
        .transpose()
}

/// Column `idx` of `row`: a nullable `bigint` count of tokens.
pub(crate) fn get_tokens(row: &Row, idx: usize) -> Tx<Option<u64>> {
    row.try_get::<_, Option<i64>>(idx)?
        .map(|v| unsigned(v, "a token count"))
        .transpose()
}

/// An error class column, parsed.
pub(crate) fn error_class(text: Option<String>) -> Tx<Option<ErrorClass>> {
    Ok(text
        .as_deref()
        .map(ErrorClass::parse)
        .transpose()
        .map_err(unknown)?)
}

/// A row of [`CALL_COLUMNS`].
pub(crate) fn call_from_row(row: &Row) -> Tx<AgentCall> {
    Ok(AgentCall {
        seq: unsigned(row.try_get(0)?, "an item seq")?,
        attempt: get_u32(row, 1, "an attempt number")?,
        index: get_u32(row, 2, "a call index")?,
        call_id: row.try_get(3)?,
        api: row.try_get(4)?,
        asked_model: row.try_get(5)?,
        sent_at_ms: row.try_get(6)?,
        telemetry: Telemetry {
            endpoint: row.try_get(7)?,
            model: row.try_get(8)?,
            latency_ms: row.try_get(9)?,
            ttft_ms: row.try_get(10)?,
            tpot_ms: row.try_get(11)?,
            prompt_tokens: get_tokens(row, 12)?,
            completion_tokens: get_tokens(row, 13)?,
            tokens_estimated: row.try_get(14)?,
            finish_reason: row.try_get(15)?,
        },
        stream: row.try_get(16)?,
        cached: row.try_get(17)?,
        http_status: unsigned(i64::from(row.try_get::<_, i32>(18)?), "an HTTP status")?,
        error_class: error_class(row.try_get(19)?)?,
        error: row.try_get(20)?,
        request: crate::columns::unpack(row.try_get(21)?, row.try_get(26)?)?.unwrap_or_default(),
        request_cut: row.try_get(22)?,
        response: crate::columns::unpack(row.try_get(23)?, row.try_get(27)?)?,
        tags: row.try_get(24)?,
        failovers: crate::failovers_of(row.try_get(25)?)?,
    })
}
