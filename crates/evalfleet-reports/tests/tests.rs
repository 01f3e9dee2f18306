//! Integration tests of the reports: metrics against the numbers of
//! reference implementations.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod metric_vectors;
