//! Names the commit the binary was built from, for `evalfleet --version`:
//! `EVALFLEET_COMMIT` is the short hash, with `-dirty` when tracked files
//! had changes, or `unknown` when the source is not a git checkout (a
//! source tarball, a wheel's sdist) or git is absent.
//!
//! The script runs again only when HEAD moves (a commit, a checkout), so
//! that an edit does not rebuild the binary twice; `-dirty` therefore says
//! what the tree was when HEAD last moved or the crate was built afresh.

use std::path::{Path, PathBuf};
use std::process::Command;

/// git's answer, trimmed, or None when git is absent or fails.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The commit, or None outside a checkout that tracks this crate (a
/// tarball unpacked inside some other repository is not one).
fn commit(dir: &Path) -> Option<String> {
    git(dir, &["ls-files", "--error-unmatch", "Cargo.toml"])?;
    let hash = git(dir, &["rev-parse", "--short", "HEAD"])?;
    let dirty = git(dir, &["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|changes| !changes.is_empty());
    Some(if dirty { format!("{hash}-dirty") } else { hash })
}

/// Makes the script run again when HEAD or the branch it names moves.
fn watch_head(dir: &Path) {
    let path = |args: &[&str]| git(dir, args).map(|p| dir.join(PathBuf::from(p)));
    if let Some(head) = path(&["rev-parse", "--git-path", "HEAD"]) {
        println!("cargo:rerun-if-changed={}", head.display());
    }
    if let Some(branch) = git(dir, &["symbolic-ref", "-q", "HEAD"])
        && let Some(reference) = path(&["rev-parse", "--git-path", &branch])
    {
        if reference.exists() {
            println!("cargo:rerun-if-changed={}", reference.display());
        } else {
            // A packed ref (as in a fresh clone) has no file of its own
            // until the next commit writes one: watch packed-refs, and the
            // nearest folder above where that file will be (a path that
            // does not exist would run the script on every build).
            if let Some(packed) = path(&["rev-parse", "--git-path", "packed-refs"]) {
                println!("cargo:rerun-if-changed={}", packed.display());
            }
            if let Some(folder) = reference.ancestors().skip(1).find(|a| a.is_dir()) {
                println!("cargo:rerun-if-changed={}", folder.display());
            }
        }
    }
}

fn main() {
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    // Without a checkout nothing can change the answer but the sources.
    println!("cargo:rerun-if-changed=build.rs");
    let commit = commit(&dir);
    if commit.is_some() {
        watch_head(&dir);
    } else {
        // Outside a checkout, run again on every build: cargo keys a
        // workspace's crates by their path inside it, so a checkout built
        // later in the same target folder (after an sdist) would otherwise
        // keep `unknown`. The workspace's .git is absent there, which cargo
        // takes as changed.
        println!(
            "cargo:rerun-if-changed={}",
            dir.join("../../.git").display()
        );
    }
    println!(
        "cargo:rustc-env=EVALFLEET_COMMIT={}",
        commit.as_deref().unwrap_or("unknown")
    );
}
