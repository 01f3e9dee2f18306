//! What kind of failure an error is, which is what the binary's exit code
//! says.

/// The kind of an error that ends a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Something the user must fix: a config, a dataset, an argument, a
    /// missing toolchain, a run id that does not exist.
    BadInput,
    /// Stopped before the end; what was committed is safe and the run
    /// resumes.
    Interrupted,
    /// Anything else: the store, the machine, a broken invariant.
    Failure,
}
