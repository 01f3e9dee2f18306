//! Resource telemetry: bounded series of points per run. Workers on many
//! machines add to a run's series at once (each its own GPUs and engines,
//! but the run's own series too): a writer locks each series it touches
//! for its transaction, so that two never merge one series at once.

use std::collections::BTreeSet;

use crate::{Resources, StoreError};
use evalfleet_types::{
    POINTS_PER_SERIES, ResourceMetric, ResourcePoint, ResourceSeries, ResourceSource, merge_evenly,
};
use postgres::{Row, Transaction};

use super::call_row::unsigned;
use super::{PgStore, Tx, unknown};

/// A point into its series; one at the same time as a stored one of its
/// series is merged into it.
const INSERT: &str =
    "INSERT INTO resource_points (rid, source, name, metric, at, until, mean, peak, samples)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
     ON CONFLICT (rid, source, name, metric, at) DO UPDATE SET
         until = GREATEST(resource_points.until, excluded.until),
         mean = (resource_points.mean * resource_points.samples + excluded.mean * excluded.samples)
                / (resource_points.samples + excluded.samples),
         peak = GREATEST(resource_points.peak, excluded.peak),
         samples = resource_points.samples + excluded.samples";

/// A series' rows.
const OF_SERIES: &str = "rid = $1 AND source = $2 AND name = $3 AND metric = $4";

const COLUMNS: &str = "source, name, metric, at, until, mean, peak, samples";

fn insert(tx: &mut Transaction<'_>, rid: i64, point: &ResourcePoint) -> Tx<()> {
    let samples = i64::try_from(point.samples).unwrap_or(i64::MAX);
    tx.execute(
        INSERT,
        &[
            &rid,
            &point.series.source.as_str(),
            &point.series.name,
            &point.series.metric.as_str(),
            &point.at_ms,
            &point.until_ms,
            &point.mean,
            &point.peak,
            &samples,
        ],
    )?;
    Ok(())
}

/// A row of [`COLUMNS`].
fn point(row: &Row) -> Tx<ResourcePoint> {
    let source: String = row.try_get(0)?;
    let metric: String = row.try_get(2)?;
    Ok(ResourcePoint {
        series: ResourceSeries {
            source: ResourceSource::parse(&source).map_err(unknown)?,
            name: row.try_get(1)?,
            metric: ResourceMetric::parse(&metric).map_err(unknown)?,
        },
        at_ms: row.try_get(3)?,
        until_ms: row.try_get(4)?,
        mean: row.try_get(5)?,
        peak: row.try_get(6)?,
        samples: unsigned(row.try_get(7)?, "a count of samples")?,
    })
}

impl Resources for PgStore {
    fn add_resource_points(
        &mut self,
        run_id: &str,
        points: &[ResourcePoint],
    ) -> Result<(), StoreError> {
        if points.is_empty() {
            return Ok(());
        }
        let touched: BTreeSet<&ResourceSeries> = points.iter().map(|p| &p.series).collect();
        self.with_once("cannot store resource telemetry", run_id, |tx, rid| {
            // Locked in one order (the set's), so that two writers never
            // wait for each other's.
            for series in &touched {
                tx.execute(
                    "SELECT pg_advisory_xact_lock(hashtext('evalfleet.resource_points'),
                         hashtext(json_build_array($1::bigint, $2::text, $3::text, $4::text)::text))",
                    &[
                        &rid,
                        &series.source.as_str(),
                        &series.name,
                        &series.metric.as_str(),
                    ],
                )?;
            }
            for point in points {
                insert(tx, rid, point)?;
            }
            for series in &touched {
                let source = series.source.as_str();
                let metric = series.metric.as_str();
                let key: [&(dyn postgres::types::ToSql + Sync); 4] =
                    [&rid, &source, &series.name, &metric];
                let count: i64 = tx
                    .query_one(
                        &format!("SELECT COUNT(*) FROM resource_points WHERE {OF_SERIES}"),
                        &key,
                    )?
                    .try_get(0)?;
                if usize::try_from(count).unwrap_or(0) <= POINTS_PER_SERIES {
                    continue;
                }
                let mut kept = tx
                    .query(
                        &format!(
                            "SELECT {COLUMNS} FROM resource_points WHERE {OF_SERIES} ORDER BY at"
                        ),
                        &key,
                    )?
                    .iter()
                    .map(point)
                    .collect::<Tx<Vec<_>>>()?;
                merge_evenly(&mut kept, POINTS_PER_SERIES);
                tx.execute(
                    &format!("DELETE FROM resource_points WHERE {OF_SERIES}"),
                    &key,
                )?;
                for point in &kept {
                    insert(tx, rid, point)?;
                }
            }
            Ok(0)
        })?;
        Ok(())
    }

    fn resource_points(
        &mut self,
        run_id: &str,
        after_ms: i64,
    ) -> Result<Vec<ResourcePoint>, StoreError> {
        self.with("cannot read resource telemetry", |conn| {
            let rid = conn.rid(run_id)?;
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM resource_points WHERE rid = $1 AND until > $2
                         ORDER BY source COLLATE \"C\", name COLLATE \"C\", metric COLLATE \"C\", at"
                    ),
                    &[&rid, &after_ms],
                )?
                .iter()
                .map(point)
                .collect()
        })
    }
}
