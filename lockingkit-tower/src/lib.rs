//! A Tower layer that holds a [LockingKit](lockingkit) distributed lock for each request.
//!
//! [`LockLayer`] derives a key from each request, takes the lock before calling the inner
//! service, hands the inner service a [`RequestLock`] (key, fencing token, loss signal) in the
//! request extensions, and drops the inner service's future if the lock is lost mid-request.
//! It releases the lock once the response is produced (or, optionally, once a streamed body
//! ends). By default each request holds its key alone; [`LockLayer::shared`] lets reading
//! requests hold it together (writers still alone), and [`LockLayer::semaphore`] turns the
//! layer into a fleet-wide concurrency limit of N requests per key. Requests it cannot serve
//! get RFC 9457 `application/problem+json` responses with a stable error code:
//!
//! | situation | status | `code` |
//! |---|---|---|
//! | someone else holds the lock | 409 + `Retry-After` | `locking.busy` |
//! | waited the whole timeout (wait mode) | 409 + `Retry-After` | `locking.timeout` |
//! | every slot of a semaphore layer taken (or for the whole wait) | 429 + `Retry-After` | `locking.busy` (`locking.timeout`) |
//! | lock backend down | 503 + `Retry-After` | `locking.unavailable` |
//! | no key / invalid key | 400 | `locking.invalid_key` |
//! | lock lost while handling: the outcome is unknown | 500 | `locking.lost` |
//! | misconfigured or failing backend, or the layer wired wrong | 500 | `locking.misconfigured`, `locking.backend` |
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
    ProblemDocument, RejectionResponse, RequestLock, RequestLocks, ResponseFuture,
    DEFAULT_BUSY_RETRY_AFTER, DEFAULT_UNAVAILABLE_RETRY_AFTER, PROBLEM_JSON,
};

pub use readiness::Readiness;

/// The error type of a [`LockBody`]: the inner body's error, or a [`lockingkit::LockError`]
/// when the lock is lost while the body streams.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The crate README's example, compiled as a doc test so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
