//! The request's parts as the handlers take them: axum's own extractors,
//! whose refusals (a body that is not JSON, a query that does not parse)
//! become the API's JSON errors instead of plain text.

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON body (`Content-Type: application/json`).
pub struct Json<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(request, state).await {
            Ok(axum::Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(match rejection {
                axum::extract::rejection::JsonRejection::MissingJsonContentType(_) => {
                    ApiError::UnsupportedMediaType(
                        "send the body as JSON (Content-Type: application/json)".to_owned(),
                    )
                }
                other if other.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE => {
                    ApiError::TooLarge(other.body_text())
                }
                other => ApiError::BadRequest(other.body_text()),
            }),
        }
    }
}

/// A JSON body, or none at all.
pub struct OptionalJson<T>(pub Option<T>);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let empty = request
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .is_some_and(|len| len == "0")
            || (!request
                .headers()
                .contains_key(axum::http::header::CONTENT_TYPE)
                && !request
                    .headers()
                    .contains_key(axum::http::header::TRANSFER_ENCODING));
        if empty {
            return Ok(Self(None));
        }
        Json::<T>::from_request(request, state)
            .await
            .map(|Json(value)| Self(Some(value)))
    }
}

/// The query string.
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(value)| Self(value))
            .map_err(|rejection| ApiError::BadRequest(rejection.body_text()))
    }
}

/// The path's parameters.
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(value)| Self(value))
            .map_err(|rejection| ApiError::BadRequest(rejection.body_text()))
    }
}
