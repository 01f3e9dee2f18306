//! Resource telemetry: bounded series of points per run.

use std::collections::BTreeSet;

use crate::{Resources, StoreError};
use evalfleet_types::{
    POINTS_PER_SERIES, ResourceMetric, ResourcePoint, ResourceSeries, ResourceSource, merge_evenly,
};
use rusqlite::params;

use super::{SqliteStore, db_err, unknown};

const INSERT: &str =
    "INSERT INTO resource_points (rid, source, name, metric, at, until, mean, peak, samples)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
     ON CONFLICT (rid, source, name, metric, at) DO UPDATE SET
         until = max(until, excluded.until),
         mean = (mean * samples + excluded.mean * excluded.samples) / (samples + excluded.samples),
         peak = max(peak, excluded.peak),
         samples = samples + excluded.samples";

fn insert(
    tx: &rusqlite::Transaction<'_>,
    rid: i64,
    point: &ResourcePoint,
) -> Result<(), rusqlite::Error> {
    super::execute_cached(
        tx,
        INSERT,
        params![
            rid,
            point.series.source.as_str(),
            point.series.name,
            point.series.metric.as_str(),
            point.at_ms,
            point.until_ms,
            point.mean,
            point.peak,
            point.samples as i64,
        ],
    )
    .map(|_| ())
}

type Row = (String, String, String, i64, i64, f64, f64, i64);

fn point(row: Row) -> Result<ResourcePoint, StoreError> {
    let (source, name, metric, at_ms, until_ms, mean, peak, samples) = row;
    Ok(ResourcePoint {
        series: ResourceSeries {
            source: ResourceSource::parse(&source).map_err(unknown)?,
            name,
            metric: ResourceMetric::parse(&metric).map_err(unknown)?,
        },
        at_ms,
        until_ms,
        mean,
        peak,
        samples: u64::try_from(samples).unwrap_or(0),
    })
}

fn read_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    Ok((
        row.get(0)?,
        row.get(1)?,
        row.get(2)?,
        row.get(3)?,
        row.get(4)?,
        row.get(5)?,
        row.get(6)?,
        row.get(7)?,
    ))
}

const COLUMNS: &str = "source, name, metric, at, until, mean, peak, samples";

impl Resources for SqliteStore {
    fn add_resource_points(
        &mut self,
        run_id: &str,
        points: &[ResourcePoint],
    ) -> Result<(), StoreError> {
        if points.is_empty() {
            return Ok(());
        }
        let rid = self.rid(run_id)?;
        // A second of telemetry is worth no sync of its own.
        self.without_sync(|store| {
            let err = db_err("cannot store resource telemetry");
            let tx = store.write("cannot store resource telemetry")?;
            let mut touched = BTreeSet::new();
            for point in points {
                insert(&tx, rid, point).map_err(&err)?;
                touched.insert(&point.series);
            }
            for series in touched {
                let key = params![
                    rid,
                    series.source.as_str(),
                    series.name,
                    series.metric.as_str()
                ];
                let count: i64 = tx
                    .prepare_cached(
                        "SELECT COUNT(*) FROM resource_points WHERE rid = ?1 AND source = ?2 AND name = ?3 AND metric = ?4",
                    )
                    .and_then(|mut q| q.query_row(key, |row| row.get(0)))
                    .map_err(&err)?;
                if usize::try_from(count).unwrap_or(0) <= POINTS_PER_SERIES {
                    continue;
                }
                let rows = tx
                    .prepare_cached(&format!(
                        "SELECT {COLUMNS} FROM resource_points WHERE rid = ?1 AND source = ?2 AND name = ?3 AND metric = ?4 ORDER BY at"
                    ))
                    .and_then(|mut q| q.query_map(key, read_row)?.collect::<Result<Vec<_>, _>>())
                    .map_err(&err)?;
                let mut kept = rows.into_iter().map(point).collect::<Result<Vec<_>, _>>()?;
                merge_evenly(&mut kept, POINTS_PER_SERIES);
                super::execute_cached(
                    &tx,
                    "DELETE FROM resource_points WHERE rid = ?1 AND source = ?2 AND name = ?3 AND metric = ?4",
                    key,
                )
                .map_err(&err)?;
                for point in &kept {
                    insert(&tx, rid, point).map_err(&err)?;
                }
            }
            tx.commit().map_err(&err)
        })
    }

    fn resource_points(
        &mut self,
        run_id: &str,
        after_ms: i64,
    ) -> Result<Vec<ResourcePoint>, StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read resource telemetry");
        let rows = self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM resource_points WHERE rid = ?1 AND until > ?2 ORDER BY source, name, metric, at"
            ))
            .and_then(|mut q| {
                q.query_map(params![rid, after_ms], read_row)?
                    .collect::<Result<Vec<_>, _>>()
            })
            .map_err(&err)?;
        rows.into_iter().map(point).collect()
    }
}
