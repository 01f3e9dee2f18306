//! Integration tests of the core: control logic on paused time, and metrics
//! against the numbers of reference implementations.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Test helpers (stand-in servers) run outside any run's task tracker.
#![allow(clippy::disallowed_methods)]

mod concurrency;
mod images;
mod load;
mod metric_vectors;
mod outage;
mod procs;
