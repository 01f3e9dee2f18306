//! Events, endpoint snapshots and the fleet mailbox.

use crate::{EndpointStates, Events, FleetMailbox, StoreError};
use evalfleet_types::{
    EndpointSnapshot, Event, EventKind, FleetAction, FleetChange, RunSample, now_ms,
};
use rusqlite::params;

use super::{SqliteStore, db_err, json_err, unknown};

impl Events for SqliteStore {
    fn add_events(&mut self, run_id: &str, events: &[Event]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let rid = self.rid(run_id)?;
        let err = db_err("cannot record an event");
        let tx = self.write("cannot record an event")?;
        {
            let mut insert = tx
                .prepare_cached(
                    "INSERT INTO events (rid, at, kind, endpoint, message) VALUES (?1, ?2, ?3, ?4, ?5)",
                )
                .map_err(&err)?;
            for event in events {
                insert
                    .execute(params![
                        rid,
                        event.at_ms,
                        event.kind.as_str(),
                        event.endpoint,
                        event.message
                    ])
                    .map_err(&err)?;
            }
        }
        tx.commit().map_err(&err)
    }

    fn events(&mut self, run_id: &str) -> Result<Vec<Event>, StoreError> {
        let rid = self.rid(run_id)?;
        let mut stmt = self
            .conn
            .prepare(
                "SELECT at, kind, endpoint, message FROM events WHERE rid = ?1 ORDER BY at, rowid",
            )
            .map_err(db_err("cannot read events"))?;
        let rows = stmt
            .query_map([rid], |row| {
                Ok((
                    row.get::<_, i64>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, Option<String>>(2)?,
                    row.get::<_, String>(3)?,
                ))
            })
            .map_err(db_err("cannot read events"))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(db_err("cannot read events"))?;
        rows.into_iter()
            .map(|(at_ms, kind, endpoint, message)| {
                Ok(Event {
                    at_ms,
                    kind: EventKind::parse(&kind).map_err(unknown)?,
                    endpoint,
                    message,
                })
            })
            .collect()
    }

    fn put_endpoint_states(
        &mut self,
        run_id: &str,
        worker: &str,
        states: &[EndpointSnapshot],
    ) -> Result<(), StoreError> {
        self.without_sync(|store| store.put_endpoint_states_now(run_id, worker, states))
    }

    fn endpoint_states(&mut self, run_id: &str) -> Result<Option<EndpointStates>, StoreError> {
        let rid = self.rid(run_id)?;
        let mut stmt = self
            .conn
            .prepare(
                "SELECT snapshot, updated_at FROM endpoint_states WHERE rid = ?1
                 ORDER BY endpoint, worker",
            )
            .map_err(db_err("cannot read endpoint states"))?;
        let rows = stmt
            .query_map([rid], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?))
            })
            .map_err(db_err("cannot read endpoint states"))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(db_err("cannot read endpoint states"))?;
        crate::columns::endpoint_states(rows)
    }

    fn add_sample(&mut self, run_id: &str, sample: &RunSample) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let json = serde_json::to_string(sample).map_err(json_err("cannot encode a sample"))?;
        // A second of the timeline is worth no sync of its own.
        self.without_sync(|store| {
            super::execute_cached(
                &store.conn,
                "INSERT OR REPLACE INTO samples (rid, at, worker, sample) VALUES (?1, ?2, ?3, ?4)",
                params![rid, sample.at_ms, sample.worker, json],
            )
            .map(|_| ())
            .map_err(db_err("cannot store a sample"))
        })
    }

    fn samples(
        &mut self,
        run_id: &str,
        after_ms: i64,
        limit: usize,
    ) -> Result<Vec<RunSample>, StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read the timeline");
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT sample FROM samples WHERE rid = ?1 AND at > ?2 ORDER BY at, worker LIMIT ?3",
            )
            .map_err(&err)?;
        let rows = stmt
            .query_map(params![rid, after_ms, limit as i64], |row| {
                row.get::<_, String>(0)
            })
            .map_err(&err)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(&err)?;
        rows.iter()
            .map(|json| {
                serde_json::from_str(json).map_err(json_err("a stored sample cannot be read"))
            })
            .collect()
    }
}

impl SqliteStore {
    fn put_endpoint_states_now(
        &mut self,
        run_id: &str,
        worker: &str,
        states: &[EndpointSnapshot],
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let tx = self.write("cannot store endpoint states")?;
        {
            let mut upsert = tx
                .prepare_cached(
                    "INSERT INTO endpoint_states (rid, endpoint, worker, snapshot, updated_at)
                     VALUES (?1, ?2, ?5, ?3, ?4)
                     ON CONFLICT (rid, endpoint, worker) DO UPDATE SET snapshot = ?3, updated_at = ?4",
                )
                .map_err(db_err("cannot store endpoint states"))?;
            let now = now_ms();
            for state in states {
                let json = serde_json::to_string(state)
                    .map_err(json_err("cannot encode an endpoint state"))?;
                upsert
                    .execute(params![rid, state.endpoint, json, now, worker])
                    .map_err(db_err("cannot store endpoint states"))?;
            }
        }
        tx.commit().map_err(db_err("cannot store endpoint states"))
    }
}

impl FleetMailbox for SqliteStore {
    fn request_fleet_change(
        &mut self,
        run_id: &str,
        change: &FleetChange,
    ) -> Result<FleetChange, StoreError> {
        let rid = self.rid(run_id)?;
        self.conn
            .execute(
                "INSERT INTO fleet_changes (rid, at, action, endpoint) VALUES (?1, ?2, ?3, ?4)",
                params![rid, change.at_ms, change.action.as_str(), change.endpoint],
            )
            .map_err(db_err("cannot record the fleet change"))?;
        Ok(FleetChange {
            id: self.conn.last_insert_rowid(),
            ..change.clone()
        })
    }

    fn fleet_changes(
        &mut self,
        run_id: &str,
        after_id: i64,
    ) -> Result<Vec<FleetChange>, StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read fleet changes");
        let rows = self
            .conn
            .prepare_cached(
                "SELECT id, at, action, endpoint FROM fleet_changes WHERE rid = ?1 AND id > ?2 ORDER BY id",
            )
            .map_err(&err)?
            .query_map(params![rid, after_id], |row| {
                Ok((
                    row.get::<_, i64>(0)?,
                    row.get::<_, i64>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, String>(3)?,
                ))
            })
            .map_err(&err)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(&err)?;
        rows.into_iter()
            .map(|(id, at_ms, action, endpoint)| {
                Ok(FleetChange {
                    id,
                    action: FleetAction::parse(&action).map_err(unknown)?,
                    endpoint,
                    at_ms,
                })
            })
            .collect()
    }
}
