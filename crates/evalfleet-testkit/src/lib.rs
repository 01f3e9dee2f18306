//! What evalfleet's tests share across crates: skipping a test whose
//! prerequisite (a dataset, a browser, a compiler, root, a PostgreSQL
//! server) is absent, and PostgreSQL databases and servers of a test's own
//! ([`postgres`]).
//!
//! `cargo test` shows such a test as passed and hides what it printed, so a
//! skip here is also written down, one file per skipped test in
//! `skipped/` under the target directory's `tmp/`, for `tools/test` to list
//! after the run. Under CI (`CI=true`) a skip fails the test instead: CI
//! installs every prerequisite (`.ci/run`), so one that is missing there is
//! a broken CI, not a reason to pass.

use std::path::PathBuf;

pub mod postgres;

/// Skips the running test: `skip!("g++ is absent"); return;`. Takes
/// `format!`'s arguments. Prints `skipped: REASON` and records it for
/// `tools/test`'s summary; under CI it panics instead.
#[macro_export]
macro_rules! skip {
    ($($reason:tt)+) => {
        $crate::skipped(
            env!("CARGO_PKG_NAME"),
            option_env!("CARGO_TARGET_TMPDIR"),
            &format!($($reason)+),
        )
    };
}

/// `../shared/data/NAME` beside the repository (or `$EVALFLEET_TEST_DATA/NAME`),
/// or `None` after [`skip!`] when it is absent: `shared_data!("gsm8k-test.jsonl")?`.
#[macro_export]
macro_rules! shared_data {
    ($name:expr) => {{
        let path = $crate::shared_data_path($name);
        if path.is_file() {
            Some(path)
        } else {
            $crate::skip!("{} is absent", path.display());
            None
        }
    }};
}

/// Where the test datasets are: `$EVALFLEET_TEST_DATA`, else `shared/data`
/// beside the repository's clone.
pub fn shared_data_path(name: &str) -> PathBuf {
    std::env::var_os("EVALFLEET_TEST_DATA")
        .map_or_else(
            || PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data")),
            PathBuf::from,
        )
        .join(name)
}

/// Whether the tests run as root (whose effective uid owns /proc/self).
pub fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
}

/// Whether this is CI, as CI services (and `.ci/run`) say: `CI` is `true`
/// or `1`.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// What [`skip!`] does; `target_tmpdir` is the test crate's
/// `CARGO_TARGET_TMPDIR` (integration tests have one; unit tests find the
/// target directory from their own executable).
#[allow(clippy::panic)] // a test that cannot run must fail under CI
pub fn skipped(package: &str, target_tmpdir: Option<&str>, reason: &str) {
    // libtest runs each test on a thread named after it.
    let thread = std::thread::current();
    let test = thread.name().filter(|n| *n != "main").unwrap_or("(a test)");
    if in_ci() {
        panic!(
            "{package} {test}: a prerequisite is missing: {reason}. \
             Under CI this fails rather than skips: .ci/run should have installed it."
        );
    }
    eprintln!("skipped: {reason}");
    let Some(dir) = records(target_tmpdir) else {
        panic!("{test} skipped ({reason}), and there is no target directory to record it in");
    };
    let file: String = format!("{package}.{test}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '.'
            }
        })
        .collect();
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(file), format!("{package} {test}: {reason}\n")));
    if let Err(e) = written {
        panic!(
            "{test} skipped ({reason}), and the skip could not be recorded in {}: {e}",
            dir.display()
        );
    }
}

/// `skipped/` in the target directory's `tmp/`, where `tools/test` reads.
fn records(target_tmpdir: Option<&str>) -> Option<PathBuf> {
    let tmp = match target_tmpdir {
        Some(dir) => PathBuf::from(dir),
        None => {
            // target/debug/deps/NAME-HASH: cargo marks the target directory
            // with CACHEDIR.TAG.
            let exe = std::env::current_exe().ok()?;
            exe.ancestors()
                .find(|dir| dir.join("CACHEDIR.TAG").is_file())
                .map(|target| target.join("tmp"))?
        }
    };
    Some(tmp.join("skipped"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skips_are_recorded_under_the_target_directory() {
        assert_eq!(
            records(Some("/t/tmp")),
            Some(PathBuf::from("/t/tmp/skipped"))
        );
        // A unit test has no CARGO_TARGET_TMPDIR: its executable is under
        // the target directory.
        let found = records(None).unwrap();
        let target = found.parent().unwrap().parent().unwrap();
        assert!(target.join("CACHEDIR.TAG").is_file(), "{found:?}");
        assert!(std::env::current_exe().unwrap().starts_with(target));
    }
}
