//! Integration tests of the core: control logic on paused time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod concurrency;
