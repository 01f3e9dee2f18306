//! The response cache, shared by every run of the store: answers by the
//! SHA-256 of their request (its 32 bytes; callers name it in hex).
//! Entries are written by commits (`queue`); here they are read, counted
//! and evicted, the oldest (lowest `id`, insertion order) first.

use std::collections::HashMap;

use crate::{CacheStats, ResponseCache, StoreError};
use evalfleet_types::CacheEntry;
use postgres::Row;

use super::call_row::{get_tokens, unsigned};
use super::{PgStore, Tx, snapshot};

const ENTRY_COLUMNS: &str = "content, endpoint, model, prompt_tokens, completion_tokens, \
                             finish_reason, latency_ms, created_at";

/// The columns of [`ENTRY_COLUMNS`].
const ENTRY_WIDTH: usize = 8;

/// A key's bytes; `None` for text that is not hex, which no entry has (as
/// SQLite's `unhex` makes NULL of it).
fn key_bytes(key: &str) -> Option<Vec<u8>> {
    hex::decode(key).ok()
}

fn entry_from_row(key: &str, row: &Row) -> Tx<CacheEntry> {
    Ok(CacheEntry {
        key: key.to_owned(),
        content: row.try_get(0)?,
        endpoint: row.try_get(1)?,
        model: row.try_get(2)?,
        prompt_tokens: get_tokens(row, 3)?,
        completion_tokens: get_tokens(row, 4)?,
        finish_reason: row.try_get(5)?,
        latency_ms: row.try_get(6)?,
        created_at_ms: row.try_get(7)?,
    })
}

impl ResponseCache for PgStore {
    fn cache_get(&mut self, key: &str, since_ms: i64) -> Result<Option<CacheEntry>, StoreError> {
        let Some(bytes) = key_bytes(key) else {
            return Ok(None);
        };
        self.with("cannot read the cache", |conn| {
            conn.client
                .query_opt(
                    &format!(
                        "SELECT {ENTRY_COLUMNS} FROM cache WHERE key = $1 AND created_at >= $2"
                    ),
                    &[&bytes, &since_ms],
                )?
                .map(|row| entry_from_row(key, &row))
                .transpose()
        })
    }

    fn cache_get_many(
        &mut self,
        keys: &[&str],
        since_ms: i64,
    ) -> Result<Vec<Option<CacheEntry>>, StoreError> {
        let wanted: Vec<Option<Vec<u8>>> = keys.iter().map(|key| key_bytes(key)).collect();
        let asked: Vec<&Vec<u8>> = wanted.iter().flatten().collect();
        if asked.is_empty() {
            return Ok(vec![None; keys.len()]);
        }
        // One statement for the page: one look at the key's index per key,
        // and one round trip for them all.
        self.with("cannot read the cache", |conn| {
            let rows = conn.client.query(
                &format!(
                    "SELECT {ENTRY_COLUMNS}, key FROM cache WHERE key = ANY($1) AND created_at >= $2"
                ),
                &[&asked, &since_ms],
            )?;
            let mut found: HashMap<Vec<u8>, &Row> = HashMap::with_capacity(rows.len());
            for row in &rows {
                found.insert(row.try_get(ENTRY_WIDTH)?, row);
            }
            keys.iter()
                .zip(&wanted)
                .map(|(key, bytes)| {
                    bytes
                        .as_ref()
                        .and_then(|b| found.get(b))
                        .map(|row| entry_from_row(key, row))
                        .transpose()
                })
                .collect()
        })
    }

    fn cache_evict(
        &mut self,
        before_ms: Option<i64>,
        max_entries: Option<u64>,
    ) -> Result<u64, StoreError> {
        let max_entries = max_entries.map(|max| i64::try_from(max).unwrap_or(i64::MAX));
        self.with("cannot evict from the cache", |conn| {
            let mut tx = conn.client.transaction()?;
            let mut gone = 0;
            if let Some(before) = before_ms {
                gone += tx.execute("DELETE FROM cache WHERE created_at < $1", &[&before])?;
            }
            if let Some(max) = max_entries {
                // Every entry up to the newest beyond the `max` newest.
                gone += tx.execute(
                    "DELETE FROM cache WHERE id <= (SELECT id FROM cache ORDER BY id DESC OFFSET $1 LIMIT 1)",
                    &[&max],
                )?;
            }
            tx.commit()?;
            Ok(gone)
        })
    }

    fn cache_stats(&mut self) -> Result<CacheStats, StoreError> {
        self.with("cannot read the cache", |conn| {
            let mut tx = snapshot(&mut conn.client)?;
            let row = tx.query_one(
                "SELECT COUNT(*), COALESCE(SUM(octet_length(content)), 0)::bigint,
                        MIN(created_at), MAX(created_at)
                 FROM cache",
                &[],
            )?;
            // Calls answered from the cache: attempts marked so (stores of
            // older evalfleets), and the counts of results.
            let hits: i64 = tx
                .query_one(
                    "SELECT (SELECT COUNT(*) FROM attempts WHERE cached)
                          + (SELECT COALESCE(SUM(cached), 0) FROM results)",
                    &[],
                )?
                .try_get(0)?;
            tx.commit()?;
            Ok(CacheStats {
                entries: unsigned(row.try_get(0)?, "a count of entries")?,
                content_bytes: unsigned(row.try_get(1)?, "a count of bytes")?,
                oldest_ms: row.try_get(2)?,
                newest_ms: row.try_get(3)?,
                hits: unsigned(hits, "a count of hits")?,
            })
        })
    }

    fn cache_clear(&mut self) -> Result<u64, StoreError> {
        self.with("cannot clear the cache", |conn| {
            Ok(conn.client.execute("DELETE FROM cache", &[])?)
        })
    }
}
