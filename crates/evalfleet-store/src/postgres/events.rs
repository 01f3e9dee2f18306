//! Events, endpoint snapshots, the timeline and the fleet mailbox. Text is
//! ordered by its bytes (`COLLATE "C"`), as SQLite orders it, whatever the
//! database's own collation.

use crate::{EndpointStates, Events, FleetMailbox, StoreError};
use evalfleet_types::{
    EndpointSnapshot, Event, EventKind, FleetAction, FleetChange, RunSample, now_ms,
};

use super::{PgStore, json_err, unknown};

impl Events for PgStore {
    fn add_events(&mut self, run_id: &str, events: &[Event]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        self.with_once("cannot record an event", run_id, |tx, rid| {
            let insert = tx.prepare(
                "INSERT INTO events (rid, at, kind, endpoint, message) VALUES ($1, $2, $3, $4, $5)",
            )?;
            // One by one, so that `id` keeps their order.
            for event in events {
                tx.execute(
                    &insert,
                    &[
                        &rid,
                        &event.at_ms,
                        &event.kind.as_str(),
                        &event.endpoint,
                        &event.message,
                    ],
                )?;
            }
            Ok(0)
        })?;
        Ok(())
    }

    fn events(&mut self, run_id: &str) -> Result<Vec<Event>, StoreError> {
        self.with("cannot read events", |conn| {
            let rid = conn.rid(run_id)?;
            let rows = conn.client.query(
                "SELECT at, kind, endpoint, message FROM events WHERE rid = $1 ORDER BY at, id",
                &[&rid],
            )?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                let kind: String = row.try_get(1)?;
                out.push(Event {
                    at_ms: row.try_get(0)?,
                    kind: EventKind::parse(&kind).map_err(unknown)?,
                    endpoint: row.try_get(2)?,
                    message: row.try_get(3)?,
                });
            }
            Ok(out)
        })
    }

    fn put_endpoint_states(
        &mut self,
        run_id: &str,
        worker: &str,
        states: &[EndpointSnapshot],
    ) -> Result<(), StoreError> {
        let snapshots = states
            .iter()
            .map(|state| {
                serde_json::to_string(state)
                    .map(|json| (state.endpoint.as_str(), json))
                    .map_err(json_err("cannot encode an endpoint state"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let now = now_ms();
        self.with("cannot store endpoint states", |conn| {
            let rid = conn.rid(run_id)?;
            let mut tx = conn.client.transaction()?;
            let upsert = tx.prepare(
                "INSERT INTO endpoint_states (rid, endpoint, worker, snapshot, updated_at)
                 VALUES ($1, $2, $5, $3, $4)
                 ON CONFLICT (rid, endpoint, worker) DO UPDATE SET snapshot = $3, updated_at = $4",
            )?;
            for (endpoint, json) in &snapshots {
                tx.execute(&upsert, &[&rid, endpoint, json, &now, &worker])?;
            }
            tx.commit()?;
            Ok(())
        })
    }

    fn endpoint_states(&mut self, run_id: &str) -> Result<Option<EndpointStates>, StoreError> {
        let rows = self.with("cannot read endpoint states", |conn| {
            let rid = conn.rid(run_id)?;
            let rows = conn.client.query(
                "SELECT snapshot, updated_at FROM endpoint_states WHERE rid = $1
                 ORDER BY endpoint COLLATE \"C\", worker COLLATE \"C\"",
                &[&rid],
            )?;
            rows.iter()
                .map(|row| Ok((row.try_get::<_, String>(0)?, row.try_get::<_, i64>(1)?)))
                .collect::<super::Tx<Vec<_>>>()
        })?;
        crate::columns::endpoint_states(rows)
    }

    fn add_sample(&mut self, run_id: &str, sample: &RunSample) -> Result<(), StoreError> {
        let json = serde_json::to_string(sample).map_err(json_err("cannot encode a sample"))?;
        self.with("cannot store a sample", |conn| {
            let rid = conn.rid(run_id)?;
            // The same second of the same worker again (a write run again)
            // replaces it.
            conn.client.execute(
                "INSERT INTO samples (rid, at, worker, sample) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (rid, at, worker) DO UPDATE SET sample = excluded.sample",
                &[&rid, &sample.at_ms, &sample.worker, &json],
            )?;
            Ok(())
        })
    }

    fn samples(
        &mut self,
        run_id: &str,
        after_ms: i64,
        limit: usize,
    ) -> Result<Vec<RunSample>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.with("cannot read the timeline", |conn| {
            let rid = conn.rid(run_id)?;
            let rows = conn.client.query(
                "SELECT sample FROM samples WHERE rid = $1 AND at > $2
                 ORDER BY at, worker COLLATE \"C\" LIMIT $3",
                &[&rid, &after_ms, &limit],
            )?;
            rows.iter()
                .map(|row| Ok(row.try_get::<_, String>(0)?))
                .collect::<super::Tx<Vec<_>>>()
        })?;
        rows.iter()
            .map(|json| {
                serde_json::from_str(json).map_err(json_err("a stored sample cannot be read"))
            })
            .collect()
    }
}

impl FleetMailbox for PgStore {
    fn request_fleet_change(
        &mut self,
        run_id: &str,
        change: &FleetChange,
    ) -> Result<FleetChange, StoreError> {
        let id = self.with_once("cannot record the fleet change", run_id, |tx, rid| {
            let row = tx.query_one(
                "INSERT INTO fleet_changes (rid, at, action, endpoint) VALUES ($1, $2, $3, $4)
                 RETURNING id",
                &[
                    &rid,
                    &change.at_ms,
                    &change.action.as_str(),
                    &change.endpoint,
                ],
            )?;
            Ok(row.try_get::<_, i64>(0)?)
        })?;
        Ok(FleetChange {
            id,
            ..change.clone()
        })
    }

    fn fleet_changes(
        &mut self,
        run_id: &str,
        after_id: i64,
    ) -> Result<Vec<FleetChange>, StoreError> {
        self.with("cannot read fleet changes", |conn| {
            let rid = conn.rid(run_id)?;
            let rows = conn.client.query(
                "SELECT id, at, action, endpoint FROM fleet_changes WHERE rid = $1 AND id > $2
                 ORDER BY id",
                &[&rid, &after_id],
            )?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                let action: String = row.try_get(2)?;
                out.push(FleetChange {
                    id: row.try_get(0)?,
                    at_ms: row.try_get(1)?,
                    action: FleetAction::parse(&action).map_err(unknown)?,
                    endpoint: row.try_get(3)?,
                });
            }
            Ok(out)
        })
    }
}
