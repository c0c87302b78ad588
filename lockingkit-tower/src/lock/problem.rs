//! The RFC 9457 problem document every refusal of the HTTP crates is written as.

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};
use serde::Serialize;

/// The media type of a problem document (RFC 9457).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem document, as LockingKit's HTTP crates send it.
///
/// `type` is always `about:blank`, so `title` is the status's reason phrase; clients tell the
/// cases apart by the `code` extension member, one of the stable [`ErrorKind`](lockingkit::ErrorKind) codes. The
/// members are serialized in the order `type`, `title`, `status`, `detail`, `code`:
///
/// ```text
/// {"type":"about:blank","title":"Conflict","status":409,"detail":"…","code":"locking.busy"}
/// ```
///
/// A document never carries the lock key, so it is safe to show to clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ProblemDocument {
    #[serde(rename = "type")]
    problem_type: &'static str,
    title: &'static str,
    status: u16,
    detail: &'static str,
    code: &'static str,
}

impl ProblemDocument {
    /// The document for `status`, with a sentence for the client and a stable error `code`.
    pub fn new(status: StatusCode, detail: &'static str, code: &'static str) -> Self {
        ProblemDocument {
            problem_type: "about:blank",
            title: status.canonical_reason().unwrap_or("Error"),
            status: status.as_u16(),
            detail,
            code,
        }
    }

    /// The HTTP status the document describes.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The stable error code, such as `locking.busy`.
    pub fn code(&self) -> &'static str {
        self.code
    }

    /// The sentence for the client.
    pub fn detail(&self) -> &'static str {
        self.detail
    }

    /// The document as JSON.
    pub fn to_json(&self) -> Bytes {
        // Serializing a struct of strings and a number cannot fail; the empty fallback only
        // keeps library code free of panics.
        serde_json::to_vec(self)
            .map(Bytes::from)
            .unwrap_or_default()
    }

    /// A response with the document's status, `Content-Type: application/problem+json` and the
    /// document as its body.
    pub fn response<B: From<Bytes>>(&self) -> Response<B> {
        let mut response = Response::new(B::from(self.to_json()));
        *response.status_mut() = self.status();
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        response
    }
}
