//! End-to-end tests of the `evalfleet` binary: real processes, real mock
//! servers on 127.0.0.1:0, real SQLite files.

// Test helpers fail loudly; that is their job.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Test helpers (stand-in servers) run outside any run's task tracker.
#![allow(clippy::disallowed_methods)]

mod agents;
mod backends;
mod bench;
mod code;
mod conversation;
mod crash;
mod dashboard;
mod failures;
mod fleet;
mod images;
mod input;
mod install;
mod messages;
mod original;
mod parquet;
mod persistent;
mod prompts;
mod remote;
mod run;
mod scaleout;
mod security;
mod serve;
mod sheets;
mod tasks;
mod telemetry;
mod trajectories;
mod trust;
mod util;
mod webdriver;
mod workers;
