//! What a failed call means for what to do next.

/// How an error bears on what to do next. Retry and concurrency logic read
/// this; they never parse messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorClass {
    /// A transient failure (connection refused or reset, 500, 502, 504): retry.
    Retryable,
    /// The endpoint is overloaded or rate-limiting (429, 503, 408, timeouts):
    /// retry later, and send it less.
    BackPressure,
    /// The request itself is wrong (other 4xx): retrying will not help.
    Fatal,
    /// The endpoint answered something that is not a valid completion
    /// (unparseable, truncated): retry.
    BadResponse,
    /// The call succeeded but its answer could not be used (unparsed, or
    /// not of the task's schema): the model was asked again.
    InvalidAnswer,
    /// No first byte of the answer within `timeouts.first_byte`: retry,
    /// and send it less (the endpoint is queueing or stuck).
    FirstByteTimeout,
    /// A stream that sent nothing for `timeouts.stream_idle` after it had
    /// begun: retry (a fault of that call).
    Stalled,
}

crate::names!(ErrorClass, "error class", {
    Retryable => "retryable",
    BackPressure => "back_pressure",
    Fatal => "fatal",
    BadResponse => "bad_response",
    InvalidAnswer => "invalid_answer",
    FirstByteTimeout => "first_byte_timeout",
    Stalled => "stalled",
});

impl ErrorClass {
    /// The classes of failed calls, in the order reports show them (a
    /// re-asked answer is not a failed call).
    pub const FAILURES: [ErrorClass; 6] = [
        ErrorClass::Retryable,
        ErrorClass::BackPressure,
        ErrorClass::FirstByteTimeout,
        ErrorClass::Stalled,
        ErrorClass::BadResponse,
        ErrorClass::Fatal,
    ];

    pub fn is_retryable(self) -> bool {
        !matches!(self, Self::Fatal)
    }

    /// Whether the endpoint asked for less (a 429, 503 or 408, no first
    /// byte in time): a sign of its load, where the other failures are
    /// faults of the call alone.
    pub fn is_back_pressure(self) -> bool {
        matches!(self, Self::BackPressure | Self::FirstByteTimeout)
    }

    /// Whether a call that failed so says nothing of the model: the server
    /// refused it, cut it, let it time out, or answered with an error of
    /// its own (5xx, 429) or with no valid completion. An item whose last
    /// call failed so failed for the server's sake, and counts in no mean;
    /// a request the server found wrong (`Fatal`: a prompt past the
    /// model's context) says something of the item and the model.
    pub fn is_the_server_s(self) -> bool {
        matches!(
            self,
            Self::Retryable
                | Self::BackPressure
                | Self::BadResponse
                | Self::FirstByteTimeout
                | Self::Stalled
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for class in ErrorClass::ALL {
            assert_eq!(ErrorClass::parse(class.as_str()), Ok(*class));
        }
        assert_eq!(
            ErrorClass::parse("back_pressure"),
            Ok(ErrorClass::BackPressure)
        );
        let err = ErrorClass::parse("slow").unwrap_err();
        assert_eq!(err.to_string(), "unknown error class 'slow'");
        assert!(!ErrorClass::Fatal.is_retryable());
        let servers: Vec<_> = ErrorClass::ALL
            .iter()
            .filter(|c| c.is_the_server_s())
            .collect();
        assert_eq!(
            servers,
            [
                &ErrorClass::Retryable,
                &ErrorClass::BackPressure,
                &ErrorClass::BadResponse,
                &ErrorClass::FirstByteTimeout,
                &ErrorClass::Stalled
            ]
        );
        assert_eq!(
            serde_json::to_string(&ErrorClass::InvalidAnswer).unwrap(),
            "\"invalid_answer\""
        );
    }
}
