//! What a request that cannot be served gets: a status and a JSON body
//! that says what was wrong, naming the parameter or the config's line.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use evalfleet_config::ConfigError;
use evalfleet_reports::ReportError;
use evalfleet_store::StoreError;
use serde::Serialize;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Report(#[from] ReportError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Conflict(String),
    /// What was sent cannot be used (a template, a dataset, a GPU in use).
    #[error("{0}")]
    Invalid(String),
    #[error("an API key is required: send it as X-API-Key or Authorization: Bearer")]
    Unauthorized,
    /// Too many wrong keys from this client: none is looked at for this
    /// many seconds.
    #[error("too many wrong keys from this address: try again in {0} s")]
    TooManyTries(u64),
    #[error("{0}")]
    Forbidden(String),
    /// Addressed to a name that is not the server's (DNS rebinding).
    #[error("{0}")]
    Misdirected(String),
    /// This server does not do what was asked (it only reads the store).
    #[error("{0}")]
    NotHere(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// The body of every error response.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// The HTTP status, again.
    pub status: u16,
    pub message: String,
    /// Each problem of a config that cannot be used, with its line.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<ProblemBody>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ProblemBody {
    pub line: Option<usize>,
    pub message: String,
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Store(StoreError::NoSuchRun(_)) | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Store(StoreError::BadLocation(_)) | Self::BadRequest(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::Store(_) | Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Report(ReportError::Store(StoreError::NoSuchRun(_))) => StatusCode::NOT_FOUND,
            Self::Report(ReportError::Store(_)) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Config(ConfigError::Refused { .. }) => StatusCode::FORBIDDEN,
            Self::Report(_) | Self::Config(_) | Self::Invalid(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::TooManyTries(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::Misdirected(_) => StatusCode::MISDIRECTED_REQUEST,
            Self::NotHere(_) => StatusCode::FORBIDDEN,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!("A request failed: {}.", evalfleet_types::error_text(&self));
        }
        let problems = match &self {
            Self::Config(err) => err
                .problems()
                .into_iter()
                .map(|p| ProblemBody {
                    line: p.line,
                    message: p.message,
                })
                .collect(),
            _ => Vec::new(),
        };
        // The whole chain ("the stored config cannot be used: ...why") for
        // what the client can fix; a failure of the server's own (its store,
        // its files) is told in its log, not to whoever asked: its paths
        // and causes are none of a client's business.
        let message = if status.is_server_error() {
            "the server failed to answer (its log says why)".to_owned()
        } else {
            evalfleet_types::error_text(&self)
        };
        let mut response = (
            status,
            Json(ErrorBody {
                error: ErrorDetail {
                    status: status.as_u16(),
                    message,
                    problems,
                },
            }),
        )
            .into_response();
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        if let Self::TooManyTries(seconds) = self
            && let Ok(value) = axum::http::HeaderValue::from_str(&seconds.to_string())
        {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, value);
        }
        response
    }
}
