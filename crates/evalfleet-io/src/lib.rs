//! What a run reads: streaming dataset readers (JSONL, CSV, Parquet), the
//! images its messages carry, its templates, and the fingerprint of what
//! determines its results.

pub mod confine;
pub mod dataset;
pub mod fingerprint;
pub mod images;
pub mod template;
