//! Rejections of the lock extractors.

use std::fmt;

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use lockingkit::ErrorKind;
use lockingkit_tower::ProblemDocument;

/// Rejection of [`HeldLock`](crate::HeldLock) when the request carries no lock.
///
/// The route is not behind a lock layer — typically the route was added after the
/// `route_layer(lock_route(…))` call, which wraps only the routes added before it, or no lock
/// layer was added at all.
/// That is a server bug, so the response is `500 Internal Server Error`, as an RFC 9457 problem
/// document with code `locking.misconfigured`.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MissingLock;

impl MissingLock {
    /// The message of the rejection.
    pub fn body_text(&self) -> &'static str {
        "This route is not protected by a lock layer."
    }

    /// The status of the rejection: always `500 Internal Server Error`.
    pub fn status(&self) -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
    }

    /// The RFC 9457 problem document of the rejection, with code `locking.misconfigured`.
    pub fn problem(&self) -> ProblemDocument {
        ProblemDocument::new(
            self.status(),
            self.body_text(),
            ErrorKind::Misconfigured.code(),
        )
    }
}

impl IntoResponse for MissingLock {
    fn into_response(self) -> Response {
        tracing::error!(
            code = ErrorKind::Misconfigured.code(),
            "a handler asked for the request's lock, but the route has no lock layer"
        );
        self.problem().response()
    }
}

impl fmt::Debug for MissingLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MissingLock")
    }
}

impl fmt::Display for MissingLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.body_text())
    }
}

impl std::error::Error for MissingLock {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_lock_is_the_documented_problem_document() {
        let response = MissingLock.into_response();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            response.headers()[http::header::CONTENT_TYPE],
            lockingkit_tower::PROBLEM_JSON
        );
        assert_eq!(
            MissingLock.problem().to_json(),
            "{\"type\":\"about:blank\",\"title\":\"Internal Server Error\",\"status\":500,\
             \"detail\":\"This route is not protected by a lock layer.\",\
             \"code\":\"locking.misconfigured\"}"
        );
    }
}
