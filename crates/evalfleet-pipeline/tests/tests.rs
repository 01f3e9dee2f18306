//! Integration tests of the tasks: messages that carry images.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Test helpers (stand-in servers) run outside any run's task tracker.
#![allow(clippy::disallowed_methods)]

mod images;
