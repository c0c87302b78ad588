//! `LockLayer`: the configuration of a locked service.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::request::Parts;
use lockingkit::{DistributedLock, LockError, LockMode};
use tower_layer::Layer;

use super::acquire::{AcquireForRequest, AllKeys, OneKey};
use super::answers::RetryAfters;
use super::key::{LockKey, LockKeys};
use super::mode::RequestMode;
use super::rejection::{LockRejection, ProblemDetails};
use super::LockService;

/// Holds a distributed lock for each request.
///
/// For every request the layer derives a key with its [`LockKey`] (a closure over the request
/// head), takes the lock — one attempt by default, or waiting up to a timeout after
/// [`wait`](Self::wait) — puts the lock's [`LockView`](lockingkit::LockView) into the request
/// extensions and calls the inner service. The inner service's future is raced against the
/// lock's loss signal: if the lock is lost, that future is dropped at its current `.await`
/// point and the client gets `500` with code `locking.lost`, saying the outcome is unknown
/// (see [`on_loss`](Self::on_loss) for letting the handler finish instead). Once the inner
/// service has produced its response the layer
/// releases the lock and waits for the backend to confirm before handing the response on, so a
/// client that has the response can take the lock at once; with
/// [`hold_until_body_ends`](Self::hold_until_body_ends) it holds the lock until the response
/// body has been streamed instead.
///
/// The layer keeps the lock's [`LockHandle`](lockingkit::LockHandle) itself (a handle owns the
/// hold and cannot be cloned); the inner service finds the view with
/// `request.extensions().get::<LockView>()`: the key, the [mode](lockingkit::LockView::mode)
/// the layer holds it in, the fencing token to send with every write, whether the lock is still
/// held. Its [`lost_token`](lockingkit::LockView::lost_token) fires when the lock is lost, and
/// also when the layer releases the lock after the response, so work spawned from the handler
/// and tied to the token (or run through [`run`](lockingkit::LockView::run)) stops once the
/// request no longer holds the lock.
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
/// - A request the service is wired so that it cannot lock — two layers of one provider locking
///   the same key on one request, or a [`LockKey`] that reports a mistake through
///   [`LockKey::miswired`] — is answered `500` and the mistake is logged once, naming it.
/// - The inner service is asked for readiness before the lock is taken, and the instance that
///   was polled ready is kept while waiting for the lock (in wait mode), so a concurrency
///   limit inside the layer counts waiting requests too. Put such limits outside the layer to
///   count only requests that hold their lock.
/// - If the client goes away, the response future is dropped: a pending acquisition is
///   cancelled and a held lock is released in the background.
///
/// ```
/// use http::{request::Parts, Request, Response};
/// use lockingkit::{DistributedLock, LockView};
/// use lockingkit_tower::LockLayer;
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
///         let lock = request.extensions().get::<LockView>().cloned();
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
    pub(crate) mode: RequestMode,
    /// `None` tries once; `Some` waits up to the timeout.
    pub(crate) wait: Option<Duration>,
    pub(crate) pass_through_without_key: bool,
    pub(crate) hold_until_body_ends: bool,
    pub(crate) on_loss: OnLoss,
    pub(crate) retry_after: RetryAfters,
    /// The wiring mistakes already logged, so each is logged once, not on every request.
    pub(crate) miswirings: Arc<Mutex<HashSet<String>>>,
}

/// What a [`LockLayer`] does when the lock of a request is lost while the inner service
/// handles it.
///
/// Either way the handler's work may have been applied in part or whole by then (a database
/// commits a statement whose future is dropped): fence every write with the request's fencing
/// token, or make the handler's effects one transaction (see docs/http.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLoss {
    /// Drop the inner service's future at its current `.await` point and answer `500` with
    /// code `locking.lost` and no `Retry-After`, saying the outcome is unknown. The default:
    /// nothing the handler does after the loss happens.
    #[default]
    Cancel,
    /// Let the inner service run to its end and send its response. Its
    /// [`LockView`](lockingkit::LockView) tells it of the loss (the lost token fires,
    /// `ensure_held` fails), so it can finish, roll back or answer as it sees fit — for work
    /// that must not stop half-way. The layer logs the loss and adds nothing to the response.
    Signal,
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
        Self::deriving(locks, Arc::new(OneKey(key)))
    }

    /// A layer that locks every key `keys` derives from each request's head, together, on
    /// `locks` — for a route that touches several resources, such as a transfer between two
    /// accounts.
    ///
    /// The keys are held as one (see
    /// [`DistributedLock::acquire_all`](lockingkit::DistributedLock::acquire_all)): taken in
    /// their canonical order, so requests that name them in opposite orders never deadlock, and
    /// all or nothing. Everything else is as for a single key: one attempt per request unless
    /// [`wait`](Self::wait) (one timeout for all the keys), `409` while any key is busy, `503`
    /// when the backend is unavailable, the handler dropped and `500` with `locking.lost` if
    /// any key is lost mid-request, every key released when the response is produced. The
    /// handler finds the hold's [`MultiLockView`](lockingkit::MultiLockView) in the request
    /// extensions: each member's key and fencing token, the mode, whether every key is still
    /// held; its lost token fires when any key is lost and when the layer releases the hold.
    ///
    /// ```
    /// use http::{request::Parts, Request, Response};
    /// use lockingkit::{DistributedLock, MultiLockView};
    /// use lockingkit_tower::LockLayer;
    /// use tower::{service_fn, ServiceBuilder, ServiceExt};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// // "/transfers/7/3" locks "accounts/7" and "accounts/3".
    /// let accounts = |parts: &Parts| {
    ///     let mut ids = parts.uri.path().strip_prefix("/transfers/")?.split('/');
    ///     let (from, to) = (ids.next()?, ids.next()?);
    ///     Some(vec![format!("accounts/{from}"), format!("accounts/{to}")])
    /// };
    /// let service = ServiceBuilder::new()
    ///     .layer(LockLayer::all(DistributedLock::in_memory(), accounts))
    ///     .service(service_fn(|request: Request<String>| async move {
    ///         let locks = request.extensions().get::<MultiLockView>().cloned();
    ///         let held = locks.map_or(0, |locks| locks.members().len());
    ///         Ok::<_, std::convert::Infallible>(Response::new(format!("{held} accounts")))
    ///     }));
    /// let request = Request::builder().uri("/transfers/7/3").body(String::new())?;
    /// assert_eq!(service.oneshot(request).await?.status(), 200);
    /// # Ok(()) }
    /// ```
    pub fn all<F>(locks: DistributedLock, keys: F) -> Self
    where
        F: Fn(&Parts) -> Option<Vec<String>> + Send + Sync + 'static,
    {
        Self::with_keys(locks, keys)
    }

    /// A layer that locks the keys a custom [`LockKeys`] derives from each request, together
    /// (see [`all`](Self::all)).
    pub fn with_keys(locks: DistributedLock, keys: impl LockKeys) -> Self {
        Self::deriving(locks, Arc::new(AllKeys(keys)))
    }

    /// A layer whose per-request work (derive the key or keys, take the locks) is `key`.
    pub(crate) fn deriving(locks: DistributedLock, key: Arc<dyn AcquireForRequest>) -> Self {
        LockLayer {
            config: Arc::new(LockConfig {
                locks,
                key,
                mode: RequestMode::EXCLUSIVE,
                wait: None,
                pass_through_without_key: false,
                hold_until_body_ends: false,
                on_loss: OnLoss::Cancel,
                retry_after: RetryAfters::DEFAULT,
                miswirings: Arc::default(),
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

    /// Takes each request's key *shared*, as a reader: requests for one key run together,
    /// while a request that locks the key exclusively (a layer without `shared`, or
    /// [`DistributedLock::acquire`] anywhere in the fleet) runs alone.
    ///
    /// Use it on reading routes and leave writing routes on the default exclusive mode. The
    /// exclusive lock is the key's plain lock, the writer of
    /// [`DistributedLock::reader_writer`]: a writer that waits (with [`wait`](Self::wait))
    /// holds new readers back, so a stream of reads cannot starve it. A reader that finds the
    /// key written (or a writer waiting) is refused like any busy lock: `409`, code
    /// `locking.busy`, or waits with [`wait`](Self::wait).
    ///
    /// # Errors
    /// [`ErrorKind::Misconfigured`](lockingkit::ErrorKind::Misconfigured) if the provider cannot
    /// hold shared locks (Azure Blob leases are exclusive only). The layer is refused when it
    /// is built rather than locking exclusively behind your back or answering `500` to every
    /// request.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http::request::Parts;
    /// use lockingkit::DistributedLock;
    /// use lockingkit_tower::LockLayer;
    ///
    /// # fn main() -> Result<(), lockingkit::LockError> {
    /// let locks = DistributedLock::in_memory();
    /// let order = |parts: &Parts| Some(parts.uri.path().trim_start_matches('/').to_owned());
    /// // Put reading routes behind `reads`: reads of one order run together …
    /// let reads = LockLayer::new(locks.clone(), order).shared()?;
    /// // … and writing routes behind `writes`: a write waits for the reads, then runs alone.
    /// let writes = LockLayer::new(locks, order).wait(Duration::from_secs(5));
    /// # let _ = (reads, writes);
    /// # Ok(()) }
    /// ```
    pub fn shared(self) -> Result<Self, LockError> {
        let mode = RequestMode::checked(&self.config.locks, LockMode::Shared)?;
        Ok(self.configure(|config| config.mode = mode))
    }

    /// Turns the layer into a distributed concurrency limit: each request takes one of at most
    /// `max_count` slots of the semaphore named by its key, so at most `max_count` requests per
    /// key run at once across every instance sharing the provider.
    ///
    /// The handler sees its slot as a [`LockView`](lockingkit::LockView) whose
    /// [`mode`](lockingkit::LockView::mode) is [`LockMode::Semaphore`]; the slot is freed when
    /// the response is produced (or when the body ends, with
    /// [`hold_until_body_ends`](Self::hold_until_body_ends)), and the handler is dropped if
    /// the slot is lost. When every slot is taken the request is refused with `429 Too Many
    /// Requests`, `Retry-After` and code `locking.busy` (`locking.timeout` after
    /// [`wait`](Self::wait)): a full semaphore is a capacity limit, not a conflict with the
    /// resource's state, so clients and proxies should treat it like rate limiting.
    ///
    /// Semaphores have a namespace of their own: the semaphore `exports/7` and the lock
    /// `exports/7` are unrelated, so a route can take both.
    ///
    /// # Errors
    /// [`ErrorKind::Misconfigured`](lockingkit::ErrorKind::Misconfigured) if `max_count` is 0
    /// or above [`MAX_SEMAPHORE_COUNT`](lockingkit::backend::MAX_SEMAPHORE_COUNT), or if the provider
    /// cannot hold a semaphore of that size — when the layer is built, not on every request.
    ///
    /// ```
    /// use http::request::Parts;
    /// use lockingkit::DistributedLock;
    /// use lockingkit_tower::LockLayer;
    ///
    /// # fn main() -> Result<(), lockingkit::LockError> {
    /// // At most 3 exports per tenant at once, fleet-wide.
    /// let tenant = |parts: &Parts| {
    ///     let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
    ///     Some(format!("exports/{tenant}"))
    /// };
    /// let limit = LockLayer::new(DistributedLock::in_memory(), tenant).semaphore(3)?;
    /// # let _ = limit;
    /// # Ok(()) }
    /// ```
    pub fn semaphore(self, max_count: u32) -> Result<Self, LockError> {
        let mode = RequestMode::checked(&self.config.locks, LockMode::Semaphore { max_count })?;
        Ok(self.configure(|config| config.mode = mode))
    }

    /// The mode the layer takes keys in: [`LockMode::Exclusive`] unless built with
    /// [`shared`](Self::shared) or [`semaphore`](Self::semaphore).
    pub fn mode(&self) -> LockMode {
        self.config.mode.mode()
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

    /// What to do when a request's lock is lost while the inner service handles it:
    /// [`OnLoss::Cancel`] (the default) drops the handler and answers `500` "outcome unknown";
    /// [`OnLoss::Signal`] lets the handler run to its end, telling it through its
    /// [`LockView`](lockingkit::LockView).
    ///
    /// ```
    /// use http::request::Parts;
    /// use lockingkit::DistributedLock;
    /// use lockingkit_tower::{LockLayer, OnLoss};
    ///
    /// // A handler that commits in one transaction checks `ensure_held()` before COMMIT and
    /// // rolls back otherwise: it must not be dropped between the two.
    /// let layer = LockLayer::new(DistributedLock::in_memory(), |parts: &Parts| {
    ///     Some(parts.uri.path().to_owned())
    /// })
    /// .on_loss(OnLoss::Signal);
    /// # let _ = layer;
    /// ```
    pub fn on_loss(self, on_loss: OnLoss) -> Self {
        self.configure(|config| config.on_loss = on_loss)
    }

    /// The `Retry-After` sent with busy and timeout rejections (1 s by default; whole seconds,
    /// rounded up).
    pub fn busy_retry_after(self, after: Duration) -> Self {
        self.configure(|config| config.retry_after.busy = after)
    }

    /// The `Retry-After` sent when the lock backend is unavailable (5 s by default; whole
    /// seconds, rounded up).
    pub fn unavailable_retry_after(self, after: Duration) -> Self {
        self.configure(|config| config.retry_after.unavailable = after)
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
            .field("mode", &self.mode.mode())
            .field("wait", &self.wait)
            .field("pass_through_without_key", &self.pass_through_without_key)
            .field("hold_until_body_ends", &self.hold_until_body_ends)
            .field("on_loss", &self.on_loss)
            .finish_non_exhaustive()
    }
}
