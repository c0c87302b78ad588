//! `LockLayer`: the configuration of a locked service.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use lockingkit::DistributedLock;
use tower_layer::Layer;

use super::key::{AcquireForRequest, LockKey};
use super::rejection::{
    LockRejection, ProblemDetails, DEFAULT_BUSY_RETRY_AFTER, DEFAULT_UNAVAILABLE_RETRY_AFTER,
};
use super::LockService;

/// Holds a distributed lock for each request.
///
/// For every request the layer derives a key with its [`LockKey`] (a closure over the request
/// head), takes the lock — one attempt by default, or waiting up to a timeout after
/// [`wait`](Self::wait) — puts a [`RequestLock`](crate::RequestLock) into the request
/// extensions and calls the inner service. The inner service's future is raced against the
/// lock's loss signal: if the lock is lost, that future is dropped at its current `.await`
/// point and the client gets `503`. Once the inner service has produced its response the layer
/// releases the lock and waits for the backend to confirm before handing the response on, so a
/// client that has the response can take the lock at once; with
/// [`hold_until_body_ends`](Self::hold_until_body_ends) it holds the lock until the response
/// body has been streamed instead.
///
/// Refusals are [`LockRejection`]s, sent as RFC 9457 problem documents by default
/// ([`ProblemDetails`]); [`map_rejection`](Self::map_rejection) replaces them.
///
/// The layer is cheap to clone. Keys never appear in responses or logs.
///
/// Costs and edge cases worth knowing:
/// - The release is one backend round trip added to each response's latency. If the backend
///   does not answer, the response waits for the provider's release timeout (10 s by default)
///   and is then sent anyway; the lease runs out on its own.
/// - If the lock is lost after the inner service has produced its response but before the
///   release, the response is sent as is and a warning is logged: the work is done, and the
///   fencing token is what protects its writes.
/// - The inner service is asked for readiness before the lock is taken, and the instance that
///   was polled ready is kept while waiting for the lock (in wait mode), so a concurrency
///   limit inside the layer counts waiting requests too. Put such limits outside the layer to
///   count only requests that hold their lock.
/// - If the client goes away, the response future is dropped: a pending acquisition is
///   cancelled and a held lock is released in the background.
///
/// ```
/// use http::{request::Parts, Request, Response};
/// use lockingkit::DistributedLock;
/// use lockingkit_tower::{LockLayer, RequestLock};
/// use tower::{service_fn, ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let locks = DistributedLock::in_memory();
/// let service = ServiceBuilder::new()
///     // One lock per path: "/orders/42" locks "orders/42".
///     .layer(LockLayer::new(locks, |parts: &Parts| {
///         Some(parts.uri.path().trim_start_matches('/').to_owned())
///     }))
///     .service(service_fn(|request: Request<String>| async move {
///         let lock = request.extensions().get::<RequestLock>().cloned();
///         let token = lock.map_or(0, |lock| lock.fencing_token());
///         Ok::<_, std::convert::Infallible>(Response::new(format!("token {token}")))
///     }));
///
/// let request = Request::builder().uri("/orders/42").body(String::new())?;
/// let response = service.oneshot(request).await?;
/// assert_eq!(response.status(), 200);
///
/// // "/" yields the empty key, which no lock accepts: 400 with code `locking.invalid_key`.
/// # let service = ServiceBuilder::new()
/// #     .layer(LockLayer::new(DistributedLock::in_memory(), |parts: &Parts| {
/// #         Some(parts.uri.path().trim_start_matches('/').to_owned())
/// #     }))
/// #     .service(service_fn(|_: Request<String>| async {
/// #         Ok::<_, std::convert::Infallible>(Response::new(String::new()))
/// #     }));
/// let response = service.oneshot(Request::new(String::new())).await?;
/// assert_eq!(response.status(), 400);
/// # Ok(()) }
/// ```
pub struct LockLayer<M = ProblemDetails> {
    pub(crate) config: Arc<LockConfig>,
    pub(crate) mapper: Arc<M>,
}

#[derive(Clone)]
pub(crate) struct LockConfig {
    pub(crate) locks: DistributedLock,
    pub(crate) key: Arc<dyn AcquireForRequest>,
    /// `None` tries once; `Some` waits up to the timeout.
    pub(crate) wait: Option<Duration>,
    pub(crate) pass_through_without_key: bool,
    pub(crate) hold_until_body_ends: bool,
    pub(crate) busy_retry_after: Duration,
    pub(crate) unavailable_retry_after: Duration,
}

impl LockLayer {
    /// A layer that locks the key `key` derives from each request's head, on `locks`.
    pub fn new<F>(locks: DistributedLock, key: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        Self::with_key(locks, key)
    }

    /// A layer that locks the key a custom [`LockKey`] derives from each request.
    pub fn with_key(locks: DistributedLock, key: impl LockKey) -> Self {
        LockLayer {
            config: Arc::new(LockConfig {
                locks,
                key: Arc::new(key),
                wait: None,
                pass_through_without_key: false,
                hold_until_body_ends: false,
                busy_retry_after: DEFAULT_BUSY_RETRY_AFTER,
                unavailable_retry_after: DEFAULT_UNAVAILABLE_RETRY_AFTER,
            }),
            mapper: Arc::new(ProblemDetails),
        }
    }
}

impl<M> LockLayer<M> {
    fn configure(mut self, change: impl FnOnce(&mut LockConfig)) -> Self {
        change(Arc::make_mut(&mut self.config));
        self
    }

    /// Waits up to `timeout` for a busy lock instead of refusing at once.
    ///
    /// Waiters queue first come, first served within one `DistributedLock`. A wait that ends
    /// busy is a `409` with code `locking.timeout`.
    pub fn wait(self, timeout: Duration) -> Self {
        self.configure(|config| config.wait = Some(timeout))
    }

    /// Makes one attempt and refuses a busy lock at once (the default).
    pub fn try_once(self) -> Self {
        self.configure(|config| config.wait = None)
    }

    /// Calls the inner service without a lock when no key can be derived from the request,
    /// instead of answering `400`. Use it when only some requests need the lock, such as
    /// writes.
    pub fn pass_through_without_key(self) -> Self {
        self.configure(|config| config.pass_through_without_key = true)
    }

    /// Holds the lock until the response body has been streamed, not just until the response
    /// head is produced.
    ///
    /// Use it when the body is produced lazily by work the lock protects. A body that is
    /// already complete when the response is produced is released at once either way.
    pub fn hold_until_body_ends(self) -> Self {
        self.configure(|config| config.hold_until_body_ends = true)
    }

    /// The `Retry-After` sent with busy and timeout rejections (1 s by default; whole seconds,
    /// rounded up).
    pub fn busy_retry_after(self, after: Duration) -> Self {
        self.configure(|config| config.busy_retry_after = after)
    }

    /// The `Retry-After` sent when the lock backend is unavailable (5 s by default; whole
    /// seconds, rounded up).
    pub fn unavailable_retry_after(self, after: Duration) -> Self {
        self.configure(|config| config.unavailable_retry_after = after)
    }

    /// Replaces the problem documents with responses of your own.
    ///
    /// `mapper` receives every [`LockRejection`] and returns a response with the inner
    /// service's body type. [`LockRejection::problem_response`] is the default, for the cases
    /// a mapper does not want to handle itself. Under axum the body type is axum's `Body`, so
    /// each arm ends in `.into_response()`, and `rejection.into_response()` is the default
    /// (with the `axum` feature).
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{request::Parts, Response, StatusCode};
    /// use http_body_util::Full;
    /// use lockingkit::{DistributedLock, ErrorKind};
    /// use lockingkit_tower::{LockLayer, LockRejection};
    ///
    /// let layer = LockLayer::new(DistributedLock::in_memory(), |parts: &Parts| {
    ///     Some(parts.uri.path().to_owned())
    /// })
    /// .map_rejection(|rejection: LockRejection| match rejection.kind() {
    ///     ErrorKind::Busy => Response::builder()
    ///         .status(StatusCode::TOO_MANY_REQUESTS)
    ///         .body(Full::new(Bytes::from("try again")))
    ///         .unwrap_or_default(),
    ///     _ => rejection.problem_response(),
    /// });
    /// # let _ = layer;
    /// ```
    pub fn map_rejection<F, R>(self, mapper: F) -> LockLayer<F>
    where
        F: Fn(LockRejection) -> R + Send + Sync + 'static,
    {
        LockLayer {
            config: self.config,
            mapper: Arc::new(mapper),
        }
    }

    /// The lock provider this layer takes locks on.
    pub fn locks(&self) -> &DistributedLock {
        &self.config.locks
    }
}

impl<M> Clone for LockLayer<M> {
    fn clone(&self) -> Self {
        LockLayer {
            config: self.config.clone(),
            mapper: self.mapper.clone(),
        }
    }
}

impl<S, M> Layer<S> for LockLayer<M> {
    type Service = LockService<S, M>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService {
            inner,
            config: self.config.clone(),
            mapper: self.mapper.clone(),
        }
    }
}

impl<M> fmt::Debug for LockLayer<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt_fields(f.debug_struct("LockLayer"))
    }
}

impl LockConfig {
    pub(crate) fn fmt_fields(&self, mut s: fmt::DebugStruct<'_, '_>) -> fmt::Result {
        s.field("locks", &self.locks)
            .field("wait", &self.wait)
            .field("pass_through_without_key", &self.pass_through_without_key)
            .field("hold_until_body_ends", &self.hold_until_body_ends)
            .finish_non_exhaustive()
    }
}
