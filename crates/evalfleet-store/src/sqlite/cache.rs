//! The response cache.

use evalfleet_core::store::{CacheStats, ResponseCache, StoreError};
use evalfleet_types::CacheEntry;
use rusqlite::{OptionalExtension, params};

use super::{SqliteStore, db_err};

/// Keys looked up by one statement.
const LOOKUP: usize = 1024;

const ENTRY_COLUMNS: &str = "hex(key), content, endpoint, model, prompt_tokens, completion_tokens, \
                             finish_reason, latency_ms, created_at";

fn entry_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<CacheEntry> {
    Ok(CacheEntry {
        key: row.get::<_, String>(0)?.to_ascii_lowercase(),
        content: row.get(1)?,
        endpoint: row.get(2)?,
        model: row.get(3)?,
        prompt_tokens: row.get::<_, Option<i64>>(4)?.map(|t| t as u64),
        completion_tokens: row.get::<_, Option<i64>>(5)?.map(|t| t as u64),
        finish_reason: row.get(6)?,
        latency_ms: row.get(7)?,
        created_at_ms: row.get(8)?,
    })
}

impl ResponseCache for SqliteStore {
    fn cache_get(&mut self, key: &str, since_ms: i64) -> Result<Option<CacheEntry>, StoreError> {
        let err = db_err("cannot read the cache");
        self.conn
            .prepare_cached(&format!(
                "SELECT {ENTRY_COLUMNS} FROM {db}.cache WHERE key = unhex(?1) AND created_at >= ?2",
                db = self.cache_db
            ))
            .map_err(&err)?
            .query_row(params![key, since_ms], entry_from_row)
            .optional()
            .map_err(&err)
    }

    fn cache_get_many(
        &mut self,
        keys: &[&str],
        since_ms: i64,
    ) -> Result<Vec<CacheEntry>, StoreError> {
        let err = db_err("cannot read the cache");
        let mut found = Vec::with_capacity(keys.len());
        // Up to LOOKUP keys a statement: SQLite allows a few thousand
        // parameters, and one statement per page keeps the lookups in one
        // pass over the key index.
        for chunk in keys.chunks(LOOKUP) {
            let mut stmt = self
                .conn
                .prepare_cached(&format!(
                    "SELECT {ENTRY_COLUMNS} FROM {db}.cache
                     WHERE key IN (SELECT unhex(value) FROM json_each(?1)) AND created_at >= ?2",
                    db = self.cache_db
                ))
                .map_err(&err)?;
            let list = serde_json::to_string(chunk)
                .map_err(|e| StoreError::backend("cannot encode cache keys", e))?;
            let rows = stmt
                .query_map(params![list, since_ms], entry_from_row)
                .map_err(&err)?;
            for row in rows {
                found.push(row.map_err(&err)?);
            }
        }
        Ok(found)
    }

    fn cache_evict(
        &mut self,
        before_ms: Option<i64>,
        max_entries: Option<u64>,
    ) -> Result<u64, StoreError> {
        let err = db_err("cannot evict from the cache");
        let mut gone = 0;
        if let Some(before) = before_ms {
            gone += self
                .conn
                .execute(
                    &format!(
                        "DELETE FROM {db}.cache WHERE created_at < ?1",
                        db = self.cache_db
                    ),
                    [before],
                )
                .map_err(&err)? as u64;
        }
        if let Some(max) = max_entries {
            gone += self
                .conn
                .execute(
                    &format!(
                        "DELETE FROM {db}.cache WHERE rowid IN (SELECT rowid FROM {db}.cache ORDER BY rowid
                         LIMIT max(0, (SELECT COUNT(*) FROM {db}.cache) - ?1))",
                        db = self.cache_db
                    ),
                    [max as i64],
                )
                .map_err(&err)? as u64;
        }
        Ok(gone)
    }

    fn cache_stats(&mut self) -> Result<CacheStats, StoreError> {
        let err = db_err("cannot read the cache");
        let (entries, content_bytes, oldest_ms, newest_ms): (i64, i64, Option<i64>, Option<i64>) = self
            .conn
            .query_row(
                &format!(
                    "SELECT COUNT(*), COALESCE(SUM(length(CAST(content AS BLOB))), 0), MIN(created_at), MAX(created_at) FROM {db}.cache",
                    db = self.cache_db
                ),
                [],
                |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)),
            )
            .map_err(&err)?;
        let hits: i64 = self
            .conn
            .query_row(
                "SELECT (SELECT COUNT(*) FROM attempts WHERE cached = 1)
                      + (SELECT COALESCE(SUM(cached), 0) FROM results)",
                [],
                |row| row.get(0),
            )
            .map_err(&err)?;
        Ok(CacheStats {
            entries: entries as u64,
            content_bytes: content_bytes as u64,
            oldest_ms,
            newest_ms,
            hits: hits as u64,
        })
    }

    fn cache_clear(&mut self) -> Result<u64, StoreError> {
        self.conn
            .execute(&format!("DELETE FROM {db}.cache", db = self.cache_db), [])
            .map(|n| n as u64)
            .map_err(db_err("cannot clear the cache"))
    }
}
