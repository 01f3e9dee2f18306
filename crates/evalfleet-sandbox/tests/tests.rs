//! Integration tests of the judge: hostile programs in the sandbox, real
//! problems (HumanEval, MBPP, stdin/stdout in Python, C++ and Rust), and
//! the SandboxFusion backend.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Test helpers (stand-in servers) run outside any run's task tracker.
#![allow(clippy::disallowed_methods)]

mod agent;
mod code_judge;
mod fusion;
mod sandbox;
