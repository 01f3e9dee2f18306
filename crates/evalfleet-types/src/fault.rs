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
    /// The store could not be reached (a database down or unreachable,
    /// past how long the command waits for it): nothing committed is
    /// lost; run the command again once it is back.
    Unreachable,
    /// Anything else: the store, the machine, a broken invariant.
    Failure,
}

/// An error and its causes in one line, each said once: a cause whose text
/// the line already holds (an error that prints its source and also names
/// it as its source) is left out, and one that adds to it follows after
/// `: ` (a client's "error sending request" says nothing of the reason;
/// its sources do).
pub fn error_text(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(inner) = cause {
        let said = inner.to_string();
        if !said.is_empty() && !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = inner.source();
    }
    text
}

/// The innermost cause of an error: what went wrong at the bottom
/// ("Connection refused (os error 111)", a DNS or TLS failure), for a
/// message that already says what was being done.
pub fn root_cause(err: &dyn std::error::Error) -> String {
    let mut bottom = err;
    while let Some(inner) = bottom.source() {
        bottom = inner;
    }
    bottom.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Plain(&'static str, Option<Box<Plain>>);

    impl std::fmt::Display for Plain {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Plain {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|p| p as _)
        }
    }

    #[test]
    fn each_cause_is_said_once() {
        let refused = Plain("Connection refused (os error 111)", None);
        let client = Plain("error sending request", Some(Box::new(refused)));
        assert_eq!(
            error_text(&client),
            "error sending request: Connection refused (os error 111)"
        );
        // A message that already prints its source does not print it twice.
        let inner = Plain("file is not a database", None);
        let outer = Plain(
            "cannot open x.db: file is not a database",
            Some(Box::new(inner)),
        );
        assert_eq!(
            error_text(&outer),
            "cannot open x.db: file is not a database"
        );
        assert_eq!(root_cause(&client), "Connection refused (os error 111)");
    }
}
