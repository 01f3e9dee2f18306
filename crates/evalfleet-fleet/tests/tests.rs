//! Integration tests of the fleet: control logic on paused time, engines'
//! load and unload, outages, and the processes it starts.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Test helpers (stand-in servers) run outside any run's task tracker.
#![allow(clippy::disallowed_methods)]

mod concurrency;
mod load;
mod outage;
mod procs;
