//! The lock-per-request middleware: `LockService` here, `LockLayer` and its constructors in
//! `layer.rs`, the response future in `future.rs`. How a request names its key or keys is in
//! `key.rs`; the one per-request path that derives them and takes the lock is `acquire.rs`, with
//! the refusal of a layer nested in another that locks the same key in `nesting.rs`. The mode
//! each key is held in (exclusive, shared, semaphore slot) is `mode.rs`, and the handle the
//! layer keeps of the hold (one key or several held as one) `handle.rs`, which puts the hold's
//! view — a `lockingkit::LockView` or `MultiLockView` — into the request extensions for the
//! handler. Refusals: `rejection.rs` (why, and the mapper),
//! `answers.rs` (the one table of status, `Retry-After`, code and detail), `problem.rs` (the
//! problem document).

mod acquire;
mod answers;
mod body;
mod future;
mod handle;
mod key;
mod layer;
mod mode;
mod nesting;
mod problem;
mod rejection;
mod until_lost;

pub use self::answers::{DEFAULT_BUSY_RETRY_AFTER, DEFAULT_UNAVAILABLE_RETRY_AFTER};
pub use self::body::LockBody;
pub use self::future::ResponseFuture;
pub use self::key::{LockKey, LockKeys};
pub use self::layer::{LockLayer, OnLoss};
pub use self::problem::{ProblemDocument, PROBLEM_JSON};
pub use self::rejection::{LockRejection, ProblemDetails, RejectionResponse};

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use self::layer::LockConfig;

/// A service that holds a distributed lock while its inner service handles each request.
///
/// Built by [`LockLayer`], which documents the behaviour. `poll_ready` is the inner service's:
/// the lock is taken in the response future, after the inner service has said it is ready, and
/// the service that was polled ready is the one called.
pub struct LockService<S, M = ProblemDetails> {
    inner: S,
    config: Arc<LockConfig>,
    mapper: Arc<M>,
}

impl<S, M> LockService<S, M> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the layer's service, returning the inner one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, M, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S, M>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: http_body::Body,
    M: RejectionResponse<ResBody>,
{
    type Response = Response<LockBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, M>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The instance polled ready goes into the future; a fresh clone stays for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(inner, request, self.config.clone(), self.mapper.clone())
    }
}

impl<S: Clone, M> Clone for LockService<S, M> {
    fn clone(&self) -> Self {
        LockService {
            inner: self.inner.clone(),
            config: self.config.clone(),
            mapper: self.mapper.clone(),
        }
    }
}

impl<S: fmt::Debug, M> fmt::Debug for LockService<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("LockService");
        s.field("inner", &self.inner);
        self.config.fmt_fields(s)
    }
}
