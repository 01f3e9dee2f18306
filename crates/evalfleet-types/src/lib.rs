//! The bottom layer of evalfleet: plain types that every other part may use
//! and that use nothing of ours. What a call's error means
//! ([`ErrorClass`]), what an answer is worth ([`Verdict`], [`Assessment`]),
//! what is stored of calls and items ([`AttemptRecord`], [`ResultRecord`]),
//! what happened to a run and its endpoints ([`Event`], [`EndpointSnapshot`]),
//! what kind of failure an error is ([`Fault`]), and the one retry policy
//! ([`retry`]).
//!
//! Stores serialise these types; nothing here knows SQL, HTTP or a config.

mod answer;
mod class;
mod endpoint;
mod event;
mod fading;
mod fault;
mod record;
mod resource;
pub mod retry;

pub use answer::{Assessment, Score, Scores, Verdict};
pub use class::ErrorClass;
pub use endpoint::{
    BUCKETS_MS, Buckets, EndpointSample, EndpointSnapshot, EndpointState, Quantiles, RunSample,
    Timings,
};
pub use event::{Event, EventKind, FleetAction, FleetChange};
pub use fading::FadingMax;
pub use fault::{Fault, error_text, root_cause};
pub use record::{
    AgentCall, AttemptRecord, BODY_KEPT, CacheEntry, Failover, ImageRef, ItemStatus, ResultRecord,
    RunStatus, StateCounts, Telemetry,
};
pub use resource::{
    POINTS_PER_SERIES, ResourceMetric, ResourcePoint, ResourceSeries, ResourceSource, merge_evenly,
};
pub use retry::{BudgetSettings, RetryBudget, RetryPolicy};

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    unix_ms(std::time::SystemTime::now())
}

/// Milliseconds since the Unix epoch of `time` (0 before the epoch).
pub fn unix_ms(time: std::time::SystemTime) -> i64 {
    time.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A duration in milliseconds, to the microsecond.
pub fn ms(duration: std::time::Duration) -> f64 {
    duration.as_micros() as f64 / 1000.0
}

/// A name that is not one of a closed set's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownName {
    /// What the set is (`verdict`, `event kind`, ...).
    pub what: &'static str,
    pub name: String,
}

impl std::fmt::Display for UnknownName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown {} '{}'", self.what, self.name)
    }
}

impl std::error::Error for UnknownName {}

/// Implements `as_str`, `parse`, `ALL` and `Display` for a closed set of
/// names, each variant with its stored text.
macro_rules! names {
    ($type:ident, $what:literal, { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl $type {
            /// Every value, in declaration order.
            pub const ALL: &'static [$type] = &[$($type::$variant),+];

            /// The name as stored and shown.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($type::$variant => $text),+
                }
            }

            /// The value a stored name stands for.
            pub fn parse(text: &str) -> Result<Self, $crate::UnknownName> {
                match text {
                    $($text => Ok($type::$variant),)+
                    other => Err($crate::UnknownName { what: $what, name: other.to_owned() }),
                }
            }
        }

        impl std::fmt::Display for $type {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $type {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $type {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                Self::parse(&text).map_err(serde::de::Error::custom)
            }
        }

        // In an OpenAPI document: a string, one of the names.
        impl utoipa::PartialSchema for $type {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::schema::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .enum_values(Some([$($text),+]))
                    .into()
            }
        }

        impl utoipa::ToSchema for $type {}
    };
}
pub(crate) use names;
