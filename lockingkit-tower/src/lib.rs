//! A Tower layer that holds a [LockingKit](lockingkit) distributed lock for each request.
//!
//! [`LockLayer`] derives a key from each request, takes the lock before calling the inner
//! service, hands the inner service the lock's [`LockView`](lockingkit::LockView) (key, mode,
//! fencing token, loss signal) in the request extensions, and drops the inner service's future
//! if the lock is lost mid-request.
//! It releases the lock once the response is produced (or, optionally, once a streamed body
//! ends). By default each request holds its key alone; [`LockLayer::shared`] lets reading
//! requests hold it together (writers still alone), and [`LockLayer::semaphore`] turns the
//! layer into a fleet-wide concurrency limit of N requests per key. Requests it cannot serve
//! get RFC 9457 `application/problem+json` responses with a stable error code:
//!
//! | situation | status | `Retry-After` | `code` |
//! |---|---|---|---|
//! | another request holds the lock | 409 Conflict | 1 s (`busy_retry_after`) | `locking.busy` |
//! | waited the whole timeout (wait mode) | 409 Conflict | 1 s (`busy_retry_after`) | `locking.timeout` |
//! | every slot of a `.semaphore(n)` layer taken | 429 Too Many Requests | 1 s (`busy_retry_after`) | `locking.busy` |
//! | every slot of a `.semaphore(n)` layer taken for the whole wait | 429 Too Many Requests | 1 s (`busy_retry_after`) | `locking.timeout` |
//! | lock backend down, frozen or failing (never for contention) | 503 Service Unavailable | 5 s (`unavailable_retry_after`) | `locking.unavailable` |
//! | no key derivable from the request | 400 Bad Request | no | `locking.invalid_key` |
//! | the derived key is empty or over 512 characters | 400 Bad Request | no | `locking.invalid_key` |
//! | lock lost while the handler ran (handler dropped): the outcome is unknown | 500 Internal Server Error | no | `locking.lost` |
//! | misconfigured backend (credentials refused, missing container) | 500 Internal Server Error | no | `locking.misconfigured` |
//! | the backend failed in a way no retry fixes | 500 Internal Server Error | no | `locking.backend` |
//! | the server is wired wrong (two layers locking one key, a template naming a parameter its route does not capture), logged once | 500 Internal Server Error | no | `locking.misconfigured` |
//!
//! The `Retry-After`s are the defaults; [`LockLayer::busy_retry_after`] and
//! [`LockLayer::unavailable_retry_after`] change them. Each rejection's problem document carries
//! the situation's own `detail` sentence, and [`LockRejection`] tells the situations apart.
//!
//! A custom mapper ([`LockLayer::map_rejection`]) can replace these responses. The layer works
//! with `tower::ServiceBuilder`, axum's `Router::route_layer` and `Router::layer`, and any
//! server built on `tower-service` (hyper-util, tonic, …). Keys never appear in responses or
//! logs.
//!
//! For axum, `lockingkit-axum` adds an extractor and a route helper that builds keys from path
//! parameters.

#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]

mod lock;
mod readiness;

pub use lock::{
    LockBody, LockKey, LockKeys, LockLayer, LockRejection, LockService, OnLoss, ProblemDetails,
    ProblemDocument, RejectionResponse, ResponseFuture, DEFAULT_BUSY_RETRY_AFTER,
    DEFAULT_UNAVAILABLE_RETRY_AFTER, PROBLEM_JSON,
};

pub use readiness::Readiness;

/// The error type of a [`LockBody`]: the inner body's error, or a [`lockingkit::LockError`]
/// when the lock is lost while the body streams.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The crate README's example, compiled as a doc test so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
