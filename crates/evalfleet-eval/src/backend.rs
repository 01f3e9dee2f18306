//! Outside metric backends as the config declares them
//! (`task.metric_backends`): a program that scores answers, with the
//! metrics it gives. Plain data; the `metric_backend` module prepares and runs
//! the programs.

use std::path::PathBuf;
use std::time::Duration;

use sha2::Digest;

/// The backend name the built-in metrics answer to (`anls@native@1`).
pub const NATIVE: &str = "native";

/// One metric a backend gives.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendMetric {
    pub name: String,
    pub higher_is_better: bool,
    pub summary: String,
}

/// An outside metric backend.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendSpec {
    pub name: String,
    /// Part of its metrics' keys (`anls@evalscope@1`): a change of what the
    /// program computes is a new version, so stored scores keep their
    /// meaning.
    pub version: u32,
    /// The program and its arguments; `{setup_dir}` in an argument is the
    /// folder the setup made.
    pub command: Vec<String>,
    /// Run once, in a folder of its own kept by the hash of this command.
    pub setup: Option<Vec<String>>,
    /// How long the program may take over one answer.
    pub timeout: Duration,
    /// How long the setup may run.
    pub setup_timeout: Duration,
    /// Answers sent to the program ahead of its scores.
    pub queue: usize,
    pub metrics: Vec<BackendMetric>,
    /// The config file's folder: the program runs there.
    pub dir: PathBuf,
}

impl BackendSpec {
    /// The name of the folder its setup makes: a hash of the setup command
    /// and of the config's folder (the setup is given it as
    /// `EVALFLEET_CONFIG_DIR`, and may read files there), so a changed setup,
    /// or the same one of another project, makes a new folder and an
    /// unchanged one is reused.
    pub fn setup_key(&self) -> Option<String> {
        let setup = self.setup.as_ref()?;
        let mut hash = sha2::Sha256::new();
        let dir = self.dir.as_os_str().as_encoded_bytes();
        for arg in setup.iter().map(String::as_bytes).chain([dir]) {
            hash.update((arg.len() as u64).to_le_bytes());
            hash.update(arg);
        }
        Some(hex::encode(&hash.finalize()[..8]))
    }

    pub fn metric(&self, name: &str) -> Option<&BackendMetric> {
        self.metrics.iter().find(|m| m.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(setup: Option<&[&str]>) -> BackendSpec {
        BackendSpec {
            name: "b".to_owned(),
            version: 1,
            command: vec!["true".to_owned()],
            setup: setup.map(|s| s.iter().map(|a| (*a).to_owned()).collect()),
            timeout: Duration::from_secs(1),
            setup_timeout: Duration::from_secs(1),
            queue: 1,
            metrics: Vec::new(),
            dir: PathBuf::new(),
        }
    }

    #[test]
    fn the_setup_folder_changes_with_the_setup_and_only_with_it() {
        assert_eq!(spec(None).setup_key(), None);
        let a = spec(Some(&["sh", "-c", "x"])).setup_key();
        assert_eq!(a, spec(Some(&["sh", "-c", "x"])).setup_key());
        assert_ne!(a, spec(Some(&["sh", "-c", "y"])).setup_key());
        // Two projects' setups may read their own files: not shared.
        let mut elsewhere = spec(Some(&["sh", "-c", "x"]));
        elsewhere.dir = PathBuf::from("/other/project");
        assert_ne!(a, elsewhere.setup_key());
        // Argument boundaries count.
        assert_ne!(
            spec(Some(&["ab", "c"])).setup_key(),
            spec(Some(&["a", "bc"])).setup_key()
        );
    }
}
