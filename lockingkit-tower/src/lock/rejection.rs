//! Why a request was refused, and how a refusal becomes a response.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{HeaderValue, Response, StatusCode};
use lockingkit::{ErrorKind, LockError, LockMode};

use super::answers::{Answer, RetryAfters, Situation};
use super::{LockBody, ProblemDocument};

/// Why a [`LockLayer`](crate::LockLayer) refused or stopped a request.
///
/// The layer turns a rejection into a response through its rejection mapper; by default that
/// is [`ProblemDetails`](crate::ProblemDetails), which sends
/// [`problem_response`](Self::problem_response): the status, `Retry-After` and problem `code`
/// of the table in the [crate docs](crate), whose situations [`kind`](Self::kind),
/// [`is_concurrency_limit`](Self::is_concurrency_limit),
/// [`is_lost_mid_request`](Self::is_lost_mid_request), [`is_miswired`](Self::is_miswired) and
/// [`is_missing_key`](Self::is_missing_key) tell apart.
///
/// A lock lost mid-request is not `503`: the handler may have applied some or all of its
/// effects before it was stopped (a database commits a statement whose future was dropped),
/// so the request must not be retried blindly, and `503` is the status clients and proxies
/// retry. The document says the outcome is unknown; docs/http.md says how to make such
/// handlers safe.
///
/// A rejection never carries the lock key, so it is safe to log and to show to clients.
///
/// With the `axum` feature (on whenever `lockingkit-axum` is used) a rejection is axum's
/// `IntoResponse`, answering [`problem_response`](Self::problem_response): a rejection mapper
/// can end in `rejection.into_response()`, and a handler can return `Result<_, LockRejection>`.
/// A handler that meets a [`LockError`] itself — locking another key, or finding its lock lost
/// — turns it into the layer's own answer with `?` or `LockRejection::from`.
pub struct LockRejection {
    cause: Cause,
    mode: LockMode,
    situation: Situation,
    retry_after: Option<Duration>,
}

enum Cause {
    NoKey,
    Acquire(LockError),
    Lost(LockError),
    /// The service is wired so that this request cannot be locked: a server bug.
    Miswired(LockError),
}

impl LockRejection {
    /// No key could be derived from the request.
    pub(crate) fn no_key(mode: LockMode) -> Self {
        Self::new(Cause::NoKey, mode, RetryAfters::DEFAULT)
    }

    /// Taking the lock failed with `error`; `retry` are the layer's `Retry-After`s.
    pub(crate) fn acquire(error: LockError, mode: LockMode, retry: RetryAfters) -> Self {
        Self::new(Cause::Acquire(error), mode, retry)
    }

    /// The lock was lost while the inner service handled the request.
    pub(crate) fn lost(error: LockError, mode: LockMode) -> Self {
        Self::new(Cause::Lost(error), mode, RetryAfters::DEFAULT)
    }

    /// The service is wired so that the request cannot be locked, as `explanation` says.
    pub(crate) fn miswired(explanation: &str, mode: LockMode) -> Self {
        let error = LockError::new(
            ErrorKind::Misconfigured,
            format!("the lock layer is wired wrong: {explanation}"),
        );
        Self::new(Cause::Miswired(error), mode, RetryAfters::DEFAULT)
    }

    fn new(cause: Cause, mode: LockMode, retry: RetryAfters) -> Self {
        let situation = match &cause {
            Cause::NoKey => Situation::NoKey,
            Cause::Acquire(error) => Situation::of_acquire(error.kind(), mode),
            Cause::Lost(_) => Situation::LostMidRequest,
            Cause::Miswired(_) => Situation::Miswired,
        };
        LockRejection {
            cause,
            mode,
            situation,
            retry_after: situation.answer().retry_after.map(|after| retry.of(after)),
        }
    }

    /// Its row of the table of answers.
    pub(crate) fn answer(&self) -> &'static Answer {
        self.situation.answer()
    }

    /// The kind of failure; [`ErrorKind::InvalidKey`] when no key could be derived.
    pub fn kind(&self) -> ErrorKind {
        match &self.cause {
            Cause::NoKey => ErrorKind::InvalidKey,
            Cause::Acquire(error) | Cause::Lost(error) | Cause::Miswired(error) => error.kind(),
        }
    }

    /// The stable error code, such as `locking.busy`.
    pub fn code(&self) -> &'static str {
        self.answer().kind.code()
    }

    /// The mode of the layer that refused: [`LockMode::Semaphore`] for a concurrency limit
    /// (whose busy answer is `429`), else [`LockMode::Exclusive`] or [`LockMode::Shared`].
    pub fn mode(&self) -> LockMode {
        self.mode
    }

    /// Whether every slot of a [semaphore](crate::LockLayer::semaphore) layer was taken (for
    /// the whole wait, in wait mode): a capacity limit rather than a conflict.
    pub fn is_concurrency_limit(&self) -> bool {
        matches!(
            self.situation,
            Situation::SlotsTaken | Situation::SlotsTakenForTheWait
        )
    }

    /// Whether the lock was lost while the inner service was handling the request: the
    /// inner service's future was dropped at its current `.await` point, and the outcome of
    /// the request is unknown (some or all of its effects may have been applied).
    pub fn is_lost_mid_request(&self) -> bool {
        matches!(self.cause, Cause::Lost(_))
    }

    /// Whether the service is wired so that the request could not be locked (two layers
    /// locking the same key, a key template naming a parameter the route does not capture): a
    /// bug in the server, not in the request, answered `500`.
    pub fn is_miswired(&self) -> bool {
        matches!(self.cause, Cause::Miswired(_))
    }

    /// Whether no key could be derived from the request (as opposed to a derived key that the
    /// lock refused as invalid).
    pub fn is_missing_key(&self) -> bool {
        matches!(self.cause, Cause::NoKey)
    }

    /// The lock error behind the rejection, if there is one.
    pub fn error(&self) -> Option<&LockError> {
        match &self.cause {
            Cause::NoKey => None,
            Cause::Acquire(error) | Cause::Lost(error) | Cause::Miswired(error) => Some(error),
        }
    }

    /// How long the client should wait before retrying, for contention and outages.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The HTTP status of the default response.
    pub fn status(&self) -> StatusCode {
        self.answer().status
    }

    /// A sentence for the client. It names neither the key nor backend internals.
    pub fn detail(&self) -> &'static str {
        self.answer().detail
    }

    /// The RFC 9457 [`ProblemDocument`] of this rejection: `type`, `title`, `status`, `detail`
    /// and `code`.
    pub fn problem(&self) -> ProblemDocument {
        let answer = self.answer();
        ProblemDocument::new(answer.status, answer.detail, answer.kind.code())
    }

    /// The [problem document](Self::problem) as JSON.
    pub fn problem_json(&self) -> Bytes {
        self.problem().to_json()
    }

    /// The default response: the status, `Content-Type: application/problem+json`,
    /// `Retry-After` in whole seconds where it applies, and the [problem document](Self::problem).
    ///
    /// Any body type that can be made from [`Bytes`] works, so a custom mapper can fall back to
    /// it for the cases it does not handle itself.
    pub fn problem_response<B: From<Bytes>>(&self) -> Response<B> {
        let mut response = self.problem().response::<B>();
        if let Some(after) = self.retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(retry_after_seconds(after)));
        }
        response
    }
}

/// The default rejection mapper: RFC 9457 `application/problem+json` responses, as described
/// on [`LockRejection`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ProblemDetails;

/// Turns a [`LockRejection`] into the response the client gets.
///
/// Implemented by [`ProblemDetails`] and by every `Fn(LockRejection) -> Response<B>`, where
/// `B` is the inner service's response body type.
pub trait RejectionResponse<B>: Send + Sync + 'static {
    /// The response for `rejection`.
    fn rejection_response(&self, rejection: LockRejection) -> Response<LockBody<B>>;
}

impl<B> RejectionResponse<B> for ProblemDetails {
    fn rejection_response(&self, rejection: LockRejection) -> Response<LockBody<B>> {
        rejection.problem_response::<Bytes>().map(LockBody::full)
    }
}

impl<B, F> RejectionResponse<B> for F
where
    F: Fn(LockRejection) -> Response<B> + Send + Sync + 'static,
{
    fn rejection_response(&self, rejection: LockRejection) -> Response<LockBody<B>> {
        self(rejection).map(LockBody::new)
    }
}

impl From<LockError> for LockRejection {
    /// The rejection an exclusive layer would send for `error`: a [`ErrorKind::Lost`] error
    /// is the lost-mid-request rejection, any other an acquisition's, with the default
    /// `Retry-After`s ([`DEFAULT_BUSY_RETRY_AFTER`](crate::DEFAULT_BUSY_RETRY_AFTER),
    /// [`DEFAULT_UNAVAILABLE_RETRY_AFTER`](crate::DEFAULT_UNAVAILABLE_RETRY_AFTER)). A
    /// busy error is therefore `409`, also when it came from a semaphore.
    fn from(error: LockError) -> Self {
        match error.kind() {
            ErrorKind::Lost => Self::lost(error, LockMode::Exclusive),
            _ => Self::acquire(error, LockMode::Exclusive, RetryAfters::DEFAULT),
        }
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for LockRejection {
    /// The [`problem_response`](Self::problem_response): status, problem document and
    /// `Retry-After` where it applies.
    fn into_response(self) -> axum_core::response::Response {
        self.problem_response()
    }
}

/// `Retry-After` takes whole seconds; rounding up keeps clients from retrying too early, and a
/// zero would invite a retry storm.
fn retry_after_seconds(after: Duration) -> u64 {
    let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    seconds.max(1)
}

impl fmt::Debug for LockRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockRejection")
            .field("code", &self.code())
            .field("mode", &self.mode)
            .field("status", &self.status().as_u16())
            .field("lost_mid_request", &self.is_lost_mid_request())
            .field("miswired", &self.is_miswired())
            .field("retry_after", &self.retry_after)
            .finish()
    }
}

impl fmt::Display for LockRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code(), self.detail())
    }
}

impl std::error::Error for LockRejection {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error()
            .map(|error| error as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use http::header::CONTENT_TYPE;

    use super::super::answers::{DEFAULT_BUSY_RETRY_AFTER, DEFAULT_UNAVAILABLE_RETRY_AFTER};
    use super::super::PROBLEM_JSON;
    use super::*;

    fn rejection(kind: ErrorKind) -> LockRejection {
        rejection_in(kind, LockMode::Exclusive)
    }

    fn rejection_in(kind: ErrorKind, mode: LockMode) -> LockRejection {
        let retry = RetryAfters {
            busy: Duration::from_millis(1500),
            unavailable: Duration::from_secs(5),
        };
        LockRejection::acquire(LockError::new(kind, "test"), mode, retry)
    }

    #[test]
    fn statuses_follow_the_documented_table() {
        assert_eq!(rejection(ErrorKind::Busy).status(), StatusCode::CONFLICT);
        assert_eq!(rejection(ErrorKind::Timeout).status(), StatusCode::CONFLICT);
        assert_eq!(
            rejection(ErrorKind::Unavailable).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            rejection(ErrorKind::InvalidKey).status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            rejection(ErrorKind::Misconfigured).status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        assert_eq!(
            rejection(ErrorKind::Backend).status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        let lost = LockRejection::lost(LockError::lost(None), LockMode::Exclusive);
        assert_eq!(lost.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(lost.retry_after().is_none());
        assert!(lost.detail().contains("outcome is unknown"));
        let miswired = LockRejection::miswired("two layers", LockMode::Exclusive);
        assert_eq!(miswired.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            LockRejection::no_key(LockMode::Exclusive).status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            LockRejection::no_key(LockMode::Exclusive).code(),
            "locking.invalid_key"
        );
    }

    #[test]
    fn a_full_semaphore_is_429_with_retry_after_and_keeps_its_code() {
        let slots = LockMode::Semaphore { max_count: 2 };
        for (kind, code) in [
            (ErrorKind::Busy, "locking.busy"),
            (ErrorKind::Timeout, "locking.timeout"),
        ] {
            let full = rejection_in(kind, slots);
            assert!(full.is_concurrency_limit());
            let response = full.problem_response::<Bytes>();
            assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(response.headers()[RETRY_AFTER], "2");
            let doc: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
            assert_eq!(doc["code"], code);
            assert_eq!(doc["title"], "Too Many Requests");
        }
        // Only contention is a capacity limit; the rest answer as any lock layer does.
        let down = rejection_in(ErrorKind::Unavailable, slots);
        assert!(!down.is_concurrency_limit());
        assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
        // A busy reader is a conflict with a writer, like a busy lock.
        let reader = rejection_in(ErrorKind::Busy, LockMode::Shared);
        assert_eq!(reader.status(), StatusCode::CONFLICT);
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds_and_is_never_zero() {
        let busy = rejection(ErrorKind::Busy).problem_response::<Bytes>();
        assert_eq!(busy.headers()[RETRY_AFTER], "2");
        let down = rejection(ErrorKind::Unavailable).problem_response::<Bytes>();
        assert_eq!(down.headers()[RETRY_AFTER], "5");
        assert_eq!(retry_after_seconds(Duration::ZERO), 1);
        let backend = rejection(ErrorKind::Backend).problem_response::<Bytes>();
        assert!(backend.headers().get(RETRY_AFTER).is_none());
    }

    #[test]
    fn problem_document_is_json_with_the_code() {
        let response = rejection(ErrorKind::Busy).problem_response::<Bytes>();
        assert_eq!(response.headers()[CONTENT_TYPE], PROBLEM_JSON);
        let doc: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(doc["type"], "about:blank");
        assert_eq!(doc["title"], "Conflict");
        assert_eq!(doc["status"], 409);
        assert_eq!(doc["code"], "locking.busy");
        assert!(doc["detail"].as_str().unwrap().contains("locked"));
    }

    #[test]
    fn a_handlers_lock_error_becomes_the_layers_own_rejection() {
        let lost = LockRejection::from(LockError::lost(None));
        assert!(lost.is_lost_mid_request());
        assert_eq!(lost.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let busy = LockRejection::from(LockError::new(ErrorKind::Busy, "held"));
        assert_eq!(busy.retry_after(), Some(DEFAULT_BUSY_RETRY_AFTER));
        let down = LockRejection::from(LockError::new(ErrorKind::Unavailable, "down"));
        assert_eq!(down.retry_after(), Some(DEFAULT_UNAVAILABLE_RETRY_AFTER));
    }

    #[cfg(feature = "axum")]
    #[test]
    fn into_response_is_the_problem_response() {
        use axum_core::response::IntoResponse;

        let expected = rejection(ErrorKind::Busy).problem_response::<Bytes>();
        let response = rejection(ErrorKind::Busy).into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers(), expected.headers());
    }

    #[test]
    fn problem_document_members_keep_their_documented_order() {
        let json = LockRejection::no_key(LockMode::Exclusive).problem_json();
        assert_eq!(
            std::str::from_utf8(&json).unwrap(),
            "{\"type\":\"about:blank\",\"title\":\"Bad Request\",\"status\":400,\
             \"detail\":\"No lock key could be derived from the request.\",\
             \"code\":\"locking.invalid_key\"}"
        );
    }
}
