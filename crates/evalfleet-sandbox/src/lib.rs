//! evalfleet's code judge: a program is taken out of a model's answer,
//! assembled with its problem's tests (HumanEval, MBPP, stdin/stdout), run
//! in a sandbox on this machine or on a SandboxFusion server, and judged:
//! a verdict per test, one per problem.

pub mod cgroup;
pub mod code;
pub mod fusion;
pub mod judge;
pub mod lang;
pub mod sandbox;
mod sys;

pub use code::{Format, Judgement, Verdict};
pub use judge::{Backend, CodeJudge, CodeJudgeError, CodeSettings};
pub use lang::Language;
pub use sys::kill_group;
