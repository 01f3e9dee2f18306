//! The response cache.

use crate::{CacheStats, ResponseCache, StoreError};
use evalfleet_types::CacheEntry;
use rusqlite::{OptionalExtension, params};

use super::{SqliteStore, db_err};

const ENTRY_COLUMNS: &str = "content, endpoint, model, prompt_tokens, completion_tokens, \
                             finish_reason, latency_ms, created_at";

fn entry_from_row(key: &str, row: &rusqlite::Row<'_>) -> rusqlite::Result<CacheEntry> {
    Ok(CacheEntry {
        key: key.to_owned(),
        content: row.get(0)?,
        endpoint: row.get(1)?,
        model: row.get(2)?,
        prompt_tokens: row.get::<_, Option<i64>>(3)?.map(|t| t as u64),
        completion_tokens: row.get::<_, Option<i64>>(4)?.map(|t| t as u64),
        finish_reason: row.get(5)?,
        latency_ms: row.get(6)?,
        created_at_ms: row.get(7)?,
    })
}

impl ResponseCache for SqliteStore {
    fn prepare_for_lookups(&mut self) {
        super::map_reads(&self.conn);
    }

    fn cache_get(&mut self, key: &str, since_ms: i64) -> Result<Option<CacheEntry>, StoreError> {
        let err = db_err("cannot read the cache");
        self.conn
            .prepare_cached(&format!(
                "SELECT {ENTRY_COLUMNS} FROM {db}.cache WHERE key = unhex(?1) AND created_at >= ?2",
                db = self.cache_db
            ))
            .map_err(&err)?
            .query_row(params![key, since_ms], |row| entry_from_row(key, row))
            .optional()
            .map_err(&err)
    }

    fn cache_get_many(
        &mut self,
        keys: &[&str],
        since_ms: i64,
    ) -> Result<Vec<Option<CacheEntry>>, StoreError> {
        let err = db_err("cannot read the cache");
        // One read transaction for the page: each lookup is a point query on
        // the key's index, without taking and dropping the database's read
        // lock for every one. The keys are looked up in the index's order
        // (hex sorts as the bytes do): hashes are spread over the whole
        // index, and in order each descent finds the pages of the last one
        // in the page cache.
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_unstable_by_key(|&i| keys[i]);
        let mut found = vec![None; keys.len()];
        let tx = self.conn.transaction().map_err(&err)?;
        {
            let mut stmt = tx
                .prepare_cached(&format!(
                    "SELECT {ENTRY_COLUMNS} FROM {db}.cache WHERE key = unhex(?1) AND created_at >= ?2",
                    db = self.cache_db
                ))
                .map_err(&err)?;
            for i in order {
                let key = keys[i];
                found[i] = stmt
                    .query_row(params![key, since_ms], |row| entry_from_row(key, row))
                    .optional()
                    .map_err(&err)?;
            }
        }
        tx.commit().map_err(&err)?;
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
                    // A bound past i64's range keeps everything (cast, it
                    // would be negative and drop every entry).
                    [i64::try_from(max).unwrap_or(i64::MAX)],
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

#[cfg(test)]
mod tests {
    use super::SqliteStore;
    use crate::ResponseCache;

    fn mapped_bytes(store: &SqliteStore) -> i64 {
        store
            .conn
            .query_row("PRAGMA mmap_size", [], |row| row.get(0))
            .unwrap()
    }

    #[test]
    fn only_a_connection_prepared_for_lookups_reads_through_a_map() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.db");
        let mut looking = SqliteStore::open(&path).unwrap();
        let other = SqliteStore::open(&path).unwrap();
        looking.prepare_for_lookups();
        assert_eq!(mapped_bytes(&looking), super::super::MAP_BYTES);
        assert_eq!(mapped_bytes(&other), 0);
    }
}
