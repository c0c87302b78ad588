//! `Readiness`: a readiness endpoint for the lock providers a service depends on.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Request, Response, StatusCode};
use lockingkit::{DistributedLock, ErrorKind, LockError, Locking};
use tokio::sync::Mutex;
use tokio::time::Instant;
use tower_service::Service;

use crate::{LockBody, ProblemDocument};

/// How long a failed startup check is reported before it is tried again.
const RECHECK_AFTER: Duration = Duration::from_secs(5);

/// A readiness endpoint (a tower [`Service`] answering any request) for the lock providers a
/// service depends on: `200` while every provider can lock, `503` with a problem document
/// (code `locking.unavailable` or `locking.misconfigured`) while one cannot, so an orchestrator
/// stops sending traffic to an instance that would refuse it anyway.
///
/// What it checks, and what that costs the backends:
/// - Until it has succeeded once, each provider's startup check
///   ([`DistributedLock::verify`]: for PostgreSQL a connection and two or three statements,
///   for Azure one request). A failed check is reported for 5 s before it is tried again, so
///   probes every second cost a failing backend one check per 5 s; callers share one check.
/// - After that, nothing over the network: whether a provider's backend is failing now
///   ([`DistributedLock::current_failure`]), which the provider learns from its own attempts and
///   reports from the first failed attempt until one is answered again.
///
/// With axum, mount it with `Router::route_service("/ready", Readiness::new(&locking))`
/// (`lockingkit-axum` re-exports it); any tower server can call it:
///
/// ```
/// use http::Request;
/// use lockingkit::DistributedLock;
/// use lockingkit_tower::Readiness;
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let readiness = Readiness::of([DistributedLock::in_memory()]);
/// let response = readiness.oneshot(Request::new(())).await.unwrap_or_else(|never| match never {});
/// assert_eq!(response.status(), 200);
/// # }
/// ```
#[derive(Clone)]
pub struct Readiness {
    inner: Arc<Inner>,
}

struct Inner {
    providers: Vec<DistributedLock>,
    /// The latest startup check and when it ran; `Ok` once is enough.
    verified: Mutex<Option<(Instant, Result<(), LockError>)>>,
}

impl Readiness {
    /// The readiness of every provider of `locking`.
    pub fn new(locking: &Locking) -> Self {
        Self::of(locking.iter().cloned())
    }

    /// The readiness of `providers`.
    pub fn of(providers: impl IntoIterator<Item = DistributedLock>) -> Self {
        Readiness {
            inner: Arc::new(Inner {
                providers: providers.into_iter().collect(),
                verified: Mutex::new(None),
            }),
        }
    }

    /// What the endpoint answers: `Ok` while every provider can lock, or why one cannot.
    pub async fn check(&self) -> Result<(), LockError> {
        if let Some(failure) = self
            .inner
            .providers
            .iter()
            .find_map(DistributedLock::current_failure)
        {
            return Err(failure);
        }
        let mut verified = self.inner.verified.lock().await;
        match &*verified {
            Some((_, Ok(()))) => return Ok(()),
            Some((at, Err(error))) if at.elapsed() < RECHECK_AFTER => return Err(error.clone()),
            _ => {}
        }
        let mut result = Ok(());
        for provider in &self.inner.providers {
            if let Err(error) = provider.verify().await {
                let message = format!("Locking.{}: {}", provider.name(), error.message());
                result = Err(LockError::new(error.kind(), message));
                break;
            }
        }
        *verified = Some((Instant::now(), result.clone()));
        result
    }
}

/// The response for a check's result.
fn answer(result: Result<(), LockError>) -> Response<LockBody<String>> {
    let error = match result {
        Ok(()) => {
            let mut response = Response::new(LockBody::full(Bytes::from_static(
                b"{\"status\":\"ready\"}",
            )));
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            return response;
        }
        Err(error) => error,
    };
    let document = ProblemDocument::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "A lock provider this service depends on cannot lock now.",
        error.code(),
    );
    let mut response = document.response::<Bytes>().map(LockBody::full);
    if error.kind() == ErrorKind::Unavailable {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from_static("5"));
    }
    response
}

impl<B> Service<Request<B>> for Readiness {
    type Response = Response<LockBody<String>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<B>) -> Self::Future {
        let readiness = self.clone();
        Box::pin(async move { Ok(answer(readiness.check().await)) })
    }
}

impl fmt::Debug for Readiness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Readiness")
            .field("providers", &self.inner.providers)
            .finish_non_exhaustive()
    }
}
