//! `endpoints[].concurrency`: a fixed number of calls in flight, or the
//! adaptive limit and its bounds.

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::Deserialize;
use serde_json::Value;

use crate::path;
use crate::problems::Problems;
use crate::read;

/// The concurrency controller's settings (`concurrency: {min, max, initial,
/// decrease_ratio, gain}`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AimdSettings {
    /// The limit to start from.
    pub initial: usize,
    pub min: usize,
    pub max: usize,
    /// The factor a decrease multiplies by (0 < ratio < 1).
    pub decrease_ratio: f64,
    /// The share of a step's proportional gain in throughput that it must
    /// bring for the limit to grow on (0 < gain < 1).
    pub gain: f64,
}

impl Default for AimdSettings {
    fn default() -> Self {
        Self {
            initial: 8,
            min: 1,
            max: 1024,
            decrease_ratio: 0.7,
            gain: 0.2,
        }
    }
}

/// `concurrency:` a fixed number of calls in flight, or adaptive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LimitMode {
    Fixed(usize),
    Adaptive(AimdSettings),
}

/// The adaptive limit's bounds and settings: once a round trip, the limit
/// grows while round trips stay near their unloaded level, and is cut when
/// they rise clearly above it or the server pushes back (429, 503, 408, a
/// timeout).
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub(super) struct RawAdaptive {
    /// The lowest limit, at least 1. Default 1.
    min: Option<usize>,
    /// The highest limit, at most 100000. Default 1024 (or `min`, when
    /// that is higher).
    max: Option<usize>,
    /// The limit to start from, between `min` and `max`. Default 8 (kept
    /// between `min` and `max`).
    initial: Option<usize>,
    /// The factor a cut multiplies the limit by, between 0 and 1. Default
    /// 0.7.
    decrease_ratio: Option<f64>,
    /// How much a step up of the limit must add to throughput, as a share
    /// of what it would add if every added call were served as fast as the
    /// others (0.2: a fifth); where it adds less, more calls would only
    /// wait, and the limit goes back to the fewest calls that served as
    /// well. Between 0 and 1. Default 0.2.
    gain: Option<f64>,
    /// Ignored: the limit no longer follows round trips but throughput
    /// (see `gain`); kept so that configurations that set it still load.
    /// Default: none.
    rtt_tolerance: Option<f64>,
}

/// `endpoints[].concurrency`: `adaptive`, a number of calls, or bounds.
pub(super) struct Concurrency;

impl JsonSchema for Concurrency {
    fn schema_name() -> Cow<'static, str> {
        "Concurrency".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        json_schema!({"anyOf": [
            {"const": "adaptive"},
            {"type": "integer", "minimum": 1},
            generator.subschema_for::<RawAdaptive>(),
        ]})
    }
}

pub(super) const MAX_CONCURRENCY: u64 = 100_000;

pub(super) fn concurrency(
    raw: Option<&Value>,
    at: &str,
    p: &mut Problems<'_>,
) -> Option<LimitMode> {
    let adaptive = AimdSettings::default();
    match raw {
        None => Some(LimitMode::Adaptive(adaptive)),
        Some(Value::String(s)) if s == "adaptive" => Some(LimitMode::Adaptive(adaptive)),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(0) => p.push(at, "must be at least 1, got 0"),
            Some(c) if c > MAX_CONCURRENCY => {
                p.push(at, format!("must be at most {MAX_CONCURRENCY}, got {c}"))
            }
            Some(c) => Some(LimitMode::Fixed(c as usize)),
            None => p.push(at, format!("must be a whole number of at least 1, got {n}")),
        },
        Some(value @ Value::Object(_)) => {
            let raw = read::section::<RawAdaptive>(value, at, p.0)?;
            let min = raw.min.unwrap_or(adaptive.min);
            let max = raw.max.unwrap_or(adaptive.max.max(min));
            // Not `clamp`: min and max are not checked yet.
            let initial = raw
                .initial
                .unwrap_or(adaptive.initial.max(min).min(max.max(min)));
            let ratio = raw.decrease_ratio.unwrap_or(adaptive.decrease_ratio);
            let gain = raw.gain.unwrap_or(adaptive.gain);
            let _ignored = raw.rtt_tolerance;
            let before = p.0.len();
            if min == 0 {
                p.push::<()>(&path::key(at, "min"), "must be at least 1, got 0");
            }
            if max < min || max as u64 > MAX_CONCURRENCY {
                p.push::<()>(
                    &path::key(at, "max"),
                    format!("must be between min ({min}) and {MAX_CONCURRENCY}, got {max}"),
                );
            }
            if !(min..=max).contains(&initial) {
                p.push::<()>(
                    &path::key(at, "initial"),
                    format!("must be between min ({min}) and max ({max}), got {initial}"),
                );
            }
            if !(ratio > 0.0 && ratio < 1.0) {
                p.push::<()>(
                    &path::key(at, "decrease_ratio"),
                    format!("must be between 0 and 1, got {ratio}"),
                );
            }
            if !(gain > 0.0 && gain < 1.0) {
                p.push::<()>(
                    &path::key(at, "gain"),
                    format!("must be between 0 and 1 (0.2: a fifth), got {gain}"),
                );
            }
            (p.0.len() == before).then_some(LimitMode::Adaptive(AimdSettings {
                initial,
                min,
                max,
                decrease_ratio: ratio,
                gain,
            }))
        }
        Some(other) => p.push(
            at,
            format!("must be 'adaptive', a whole number, or {{min, max, initial}}, got {other}"),
        ),
    }
}
