//! What a lock backend implements: [`LockBackend`] (one attempt, renew, release, timing) and,
//! for a backend that can do better than polling, the [`Wait`] of one caller; the engine does
//! everything else.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{ErrorKind, LockError, SharedSource};

pub use crate::semaphore::MAX_SEMAPHORE_COUNT;

/// How a backend keeps a lease alive, which decides how the engine detects loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseTiming {
    /// The backend expires the lease after this long unless it is renewed (Azure, in-memory).
    ///
    /// The engine renews in the background and declares the lock lost at 90% of this duration
    /// after the last successful renewal was *sent*, so it gives up before the backend could
    /// hand the lock to anyone else.
    Expiring(Duration),
    /// The lock lives as long as a connection (PostgreSQL sessions).
    ///
    /// The engine checks the lease every interval through [`LockBackend::renew`]; a check that
    /// fails or does not answer within the interval is loss.
    ConnectionHeld(Duration),
}

/// How a lock is held: alone, together with other readers, or as one of at most N holders.
///
/// Exclusive and shared holds of one key exclude each other: a plain lock is the writer of the
/// key's reader-writer lock. Semaphores live in a namespace of their own: the semaphore `k` and
/// the lock `k` are unrelated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockMode {
    /// The only holder of the key: plain locks and writers.
    Exclusive,
    /// One of any number of readers of the key; no exclusive holder meanwhile.
    Shared,
    /// One of at most `max_count` holders of the semaphore named by the key.
    Semaphore {
        /// How many holders the semaphore admits at once (at least 1).
        max_count: u32,
    },
}

impl LockMode {
    /// The `lockingkit.lock.mode` telemetry attribute: `exclusive`, `shared` or `semaphore`.
    pub const fn as_str(self) -> &'static str {
        match self {
            LockMode::Exclusive => "exclusive",
            LockMode::Shared => "shared",
            LockMode::Semaphore { .. } => "semaphore",
        }
    }

    /// Whether a backend that takes exclusive and shared locks and semaphores of 1 to
    /// `max_count` holders takes this mode (PostgreSQL, Redis and etcd; Azure and the in-memory
    /// backend answer for themselves).
    #[cfg_attr(
        not(any(feature = "postgres", feature = "redis", feature = "etcd")),
        allow(dead_code)
    )]
    pub(crate) fn with_semaphores_up_to(self, max_count: u32) -> bool {
        match self {
            LockMode::Exclusive | LockMode::Shared => true,
            LockMode::Semaphore { max_count: asked } => (1..=max_count).contains(&asked),
        }
    }
}

impl fmt::Display for LockMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A lease granted by one successful attempt, with its fencing token.
#[derive(Debug)]
pub struct Acquired<L> {
    /// What the backend needs to renew and release this lease.
    pub lease: L,
    /// Strictly greater than every token handed out earlier for the same key.
    pub fencing_token: u64,
}

/// How a backend failure should be treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendErrorKind {
    /// The request may succeed if retried: a timeout, a reset connection, a 5xx answer.
    /// `reached` says whether the backend answered at all (it separates `Timeout` from
    /// `Unavailable` for waiters).
    Transient {
        /// Whether the backend answered before failing.
        reached: bool,
    },
    /// The backend says the lease is no longer ours (expired, broken, connection gone).
    LeaseGone,
    /// Bad options, credentials refused, missing container or permission.
    Misconfigured,
    /// An unexpected failure that retrying will not fix.
    Permanent,
}

/// A failure reported by a [`LockBackend`].
///
/// The message must not contain the lock key or secrets. Cloning is cheap: the cause is
/// shared, so one failure can answer every caller that meets it.
#[derive(Clone)]
pub struct BackendError {
    kind: BackendErrorKind,
    message: String,
    source: Option<SharedSource>,
    /// The provider's own outage gate paces retries of this failure (see
    /// [`paced_by_provider`](Self::paced_by_provider)).
    paced: bool,
}

impl BackendError {
    /// A failure of the given kind with a message for humans.
    pub fn new(kind: BackendErrorKind, message: impl Into<String>) -> Self {
        BackendError {
            kind,
            message: message.into(),
            source: None,
            paced: false,
        }
    }

    /// A transient failure where nothing answered (connection refused, timed out).
    pub fn unreachable(message: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::Transient { reached: false }, message)
    }

    /// A transient failure that the backend itself reported (a 5xx, a serialization failure).
    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::Transient { reached: true }, message)
    }

    /// The lease is gone.
    pub fn lease_gone(message: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::LeaseGone, message)
    }

    /// The backend is misconfigured.
    pub fn misconfigured(message: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::Misconfigured, message)
    }

    /// An unexpected failure no retry can fix.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::Permanent, message)
    }

    /// Attaches the underlying cause.
    pub fn with_source(
        mut self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        self.source = Some(SharedSource::from(source.into()));
        self
    }

    /// How to treat this failure.
    pub fn kind(&self) -> BackendErrorKind {
        self.kind
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same failure told with another message (kind and cause unchanged).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn with_message(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
    }

    /// The same failure, marked as paced by the provider's own outage gate: a connect that
    /// failed through the provider's reconnect backoff, or a request that gate refused without
    /// asking the server. The engine's outage gate then leaves its probe schedule to that gate
    /// instead of adding a backoff of its own on top: the next caller may probe at once (it
    /// costs the server nothing while the provider's gate refuses), and the server is asked as
    /// soon as, and no more often than, the provider's gate allows.
    #[cfg_attr(
        not(any(
            feature = "etcd",
            feature = "mysql",
            feature = "postgres",
            feature = "redis"
        )),
        allow(dead_code)
    )]
    pub(crate) fn paced_by_provider(mut self) -> Self {
        self.paced = true;
        self
    }

    /// Whether the provider's own gate paces this failure (see
    /// [`paced_by_provider`](Self::paced_by_provider)).
    pub(crate) fn is_paced_by_provider(&self) -> bool {
        self.paced
    }

    /// Whether the backend answered before failing.
    pub(crate) fn reached(&self) -> bool {
        !matches!(self.kind, BackendErrorKind::Transient { reached: false })
    }

    /// Whether retrying might help.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(
            self.kind,
            BackendErrorKind::Transient { .. } | BackendErrorKind::LeaseGone
        )
    }

    /// The caller-facing error for this failure.
    pub(crate) fn into_lock_error(self) -> LockError {
        let kind = match self.kind {
            BackendErrorKind::Transient { .. } => ErrorKind::Unavailable,
            BackendErrorKind::LeaseGone => ErrorKind::Lost,
            BackendErrorKind::Misconfigured => ErrorKind::Misconfigured,
            BackendErrorKind::Permanent => ErrorKind::Backend,
        };
        let err = LockError::new(kind, self.message);
        match self.source {
            Some(source) => err.with_shared_source(source),
            None => err,
        }
    }
}

impl fmt::Debug for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendError")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("source", &self.source.as_ref().map(|s| s.to_string()))
            .finish()
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

/// A lock backend: one attempt, renew, release, and its timing. Nothing else.
///
/// The engine owns waiting, backoff, the local queue, renewal scheduling, the loss deadline,
/// cancellation safety, release on drop and telemetry. A backend only talks to its server.
///
/// # What the engine promises a backend
/// - An exclusive attempt is never made for a key this engine already holds or is attempting
///   exclusively. It may be made while this engine holds the key shared, which the backend must
///   answer busy.
/// - Shared and semaphore attempts are made only if [`supports`](Self::supports) said yes, and
///   may be made while this engine already holds the key in the same mode: every local holder
///   gets a lease of its own. A semaphore attempt must take a slot nobody holds, this engine
///   included.
/// - `renew` and `release` get a lease this backend returned, and `release` is called at most
///   once per lease, after which the lease is dropped.
/// - If the caller of an attempt goes away while it runs, the attempt still runs to the end and
///   a lease it returns is released.
/// - A caller that waits has at most one [`Wait`] open for its key and mode, from its first busy
///   answer until it leaves, and every attempt it makes meanwhile goes through that wait. Within
///   one engine, at most one wait is open per key and mode at a time; a lease granted through a
///   wait is the caller's lease like any other (renewed, checked and released the same way).
///
/// # What a backend must do
/// - Answer `Ok(None)` when the lock is busy, and never block waiting for it.
/// - Classify failures with [`BackendErrorKind`]. Bound its own I/O with timeouts where a hung
///   server could stall a call forever; the engine also bounds renewals and releases.
pub trait LockBackend: Send + Sync + 'static {
    /// What a granted lease carries (a lease id, a held connection, …).
    type Lease: Send + Sync + 'static;

    /// The provider name used in telemetry: `azure_blob`, `postgres`, `in_memory` or your own.
    fn provider(&self) -> &str;

    /// How leases of this backend stay alive.
    fn timing(&self) -> LeaseTiming;

    /// Whether this backend can hold locks in `mode`. Only [`LockMode::Exclusive`] by default;
    /// the engine refuses the other modes with `Misconfigured` before any attempt, and
    /// [`DistributedLock::supports`](crate::DistributedLock::supports) tells callers.
    fn supports(&self, mode: LockMode) -> bool {
        matches!(mode, LockMode::Exclusive)
    }

    /// Optional: how long a writer that found readers holds new readers back after each of
    /// its attempts, for a backend whose writer's intent lapses unless the writer's next attempt
    /// sets it again (Redis's `writer_intent` setting). The engine then refuses a
    /// `max_retry_delay` that is not shorter, whichever way the lock is built: the intent would
    /// lapse between two attempts of a waiting writer and let new readers in. `None` by
    /// default: no such intent (a backend whose server queues writers, or without readers).
    fn writer_intent(&self) -> Option<Duration> {
        None
    }

    /// One attempt to take `key` in `mode`: `Ok(None)` when someone else holds it in a
    /// conflicting mode, or (for a semaphore) when every slot is taken. Called only with modes
    /// [`supports`](Self::supports) accepts, so a backend of exclusive locks may ignore `mode`.
    fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> impl Future<Output = Result<Option<Acquired<Self::Lease>>, BackendError>> + Send;

    /// Renews an expiring lease, or checks a connection-held one.
    fn renew(&self, lease: &Self::Lease) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Gives the lock up. `Ok` means the backend confirmed it.
    fn release(&self, lease: &Self::Lease)
        -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Opens the wait of one caller for `key` in `mode`: the engine calls this when the caller,
    /// the front waiter of its key and mode in this engine, is first answered busy, makes every
    /// further attempt of that caller through the wait ([`Wait::try_acquire`]), listens to it
    /// between attempts ([`Wait::changed`]), and drops it the moment the caller leaves: granted
    /// (by an attempt or through the wait), timed out, cancelled, failed or dropped. Dropping
    /// the wait *is* the end of the wait; nothing has to be inferred.
    ///
    /// What a backend keeps for a wait (a subscription, a place in a server-side queue, a
    /// request queued at the server) belongs to it and goes with it. The default waits by
    /// polling ([`PollingWait`]): attempts are plain [`try_acquire`](Self::try_acquire) calls
    /// and nothing wakes the waiter early. Polling stays the engine's fallback and cap whatever
    /// a wait offers: a waiter attempts again after its backoff even if the wait never speaks.
    fn wait(
        self: Arc<Self>,
        key: &str,
        mode: LockMode,
    ) -> impl Wait<Lease = Self::Lease> + use<Self>
    where
        Self: Sized,
    {
        PollingWait::new(self, key, mode)
    }

    /// Optional: a future that resolves as soon as the backend knows, without asking the
    /// server, that the lease is gone — because the connection holding it closed (the server
    /// then frees the lock at once), or because a watch showed the holder's record deleted or
    /// overwritten by someone else.
    ///
    /// The engine races it against the wait for the next renewal or check, so loss is declared
    /// within moments instead of at the next renewal or check. For a
    /// [`LeaseTiming::ConnectionHeld`] backend it is watched from shortly after the acquire;
    /// for an [`LeaseTiming::Expiring`] one only if [`watches_leases`](Self::watches_leases)
    /// says so (otherwise from the first renewal on). The default never resolves, leaving
    /// detection to renewals and checks.
    fn lease_ended(&self, lease: &Self::Lease) -> impl Future<Output = ()> + Send {
        let _ = lease;
        std::future::pending()
    }

    /// Optional: checks over the network what building the backend could not — that the
    /// server answers, accepts the credentials and has (or lets us create) what locks need —
    /// so that a deployment that cannot lock fails at startup.
    /// [`DistributedLock::verify`](crate::DistributedLock::verify) and
    /// [`Locking::verify`](crate::Locking::verify) call it. It must take no lock, cost a few
    /// round trips, and leave nothing open. Misconfiguration is
    /// [`BackendErrorKind::Misconfigured`], a server that does not answer
    /// [`BackendErrorKind::Transient`]. The default checks nothing.
    fn verify(&self) -> impl Future<Output = Result<(), BackendError>> + Send {
        std::future::ready(Ok(()))
    }

    /// Optional: closes what the backend keeps open (connections, background tasks).
    /// [`DistributedLock::shutdown`](crate::DistributedLock::shutdown) calls it last, once
    /// every lock of the engine is released. Locks taken on this backend afterwards may fail;
    /// the engine refuses new ones first. The default does nothing.
    fn shutdown(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }

    /// Optional, for [`LeaseTiming::Expiring`] backends: whether
    /// [`lease_ended`](Self::lease_ended) can resolve for their leases. When `true`, the
    /// engine starts watching each hold shortly (about 10 ms) after the acquire rather than
    /// at its first renewal, so a lease the backend sees taken away is loss at once. `false`
    /// by default: a watch per hold costs a task, which a backend that cannot tell has no
    /// use for.
    fn watches_leases(&self) -> bool {
        false
    }
}

/// What a [`Wait`] tells its waiter between attempts.
#[derive(Debug)]
#[non_exhaustive]
pub enum Woken<L> {
    /// The key may be free now (a release was seen, or the wait can no longer tell): the
    /// engine attempts again at once through [`Wait::try_acquire`].
    Retry,
    /// The backend granted the waiter the lock (a request the wait had queued at the server was
    /// granted): this is the caller's lease, with no further attempt.
    Granted {
        /// The lease and its fencing token.
        acquired: Acquired<L>,
        /// When the request that was granted was sent: the lease's loss deadline counts from
        /// it, as from an attempt's send.
        sent: Instant,
    },
}

/// One caller's wait for a key in a mode, as its backend keeps it (see [`LockBackend::wait`]).
///
/// The wait is opened at the caller's first busy answer and dropped when the caller leaves,
/// whatever the reason; dropping it ends it. A backend gives back at once what it kept for the
/// wait: a place in a queue is deleted, a request still queued at the server is withdrawn, a
/// lock granted to the wait that the caller did not take is unlocked. Until that is done, this
/// backend's next attempt for the key (in any mode) waits for it, so a caller that tries right
/// after a wait ended is never told "busy" by what the wait left behind.
///
/// # What the engine promises a wait
/// - [`try_acquire`](Self::try_acquire) and [`changed`](Self::changed) are never called at the
///   same time: the engine attempts, and only after a busy answer listens for a change.
/// - A future from `changed` may be dropped before it resolves (the backoff ran out first, the
///   caller left); that must lose nothing, in particular not a grant.
/// - An attempt's future may outlive the wait (its caller went away mid-request): it runs to
///   the end and a lease it returns is released.
pub trait Wait: Send + 'static {
    /// The lease type of the backend the wait belongs to.
    type Lease: Send + Sync + 'static;

    /// One attempt for the waiting caller: like [`LockBackend::try_acquire`] for the wait's key
    /// and mode, and answered from what the wait already knows where it knows better (a grant
    /// it holds for the caller, a request of its own still queued at the server).
    fn try_acquire(
        &mut self,
    ) -> impl Future<Output = Result<Option<Acquired<Self::Lease>>, BackendError>> + Send + 'static;

    /// Resolves when an attempt may succeed now ([`Woken::Retry`]) or the backend granted the
    /// caller the lock ([`Woken::Granted`]); never, if the wait cannot tell (polling). Called
    /// after a busy answer, and raced against the engine's backoff.
    fn changed(&mut self) -> impl Future<Output = Woken<Self::Lease>> + Send + '_;
}

/// The wait of a backend that only polls: every attempt is a plain
/// [`LockBackend::try_acquire`], and nothing wakes the waiter before its backoff ends. The
/// default of [`LockBackend::wait`]; a wrapping backend can use it too.
pub struct PollingWait<B> {
    backend: Arc<B>,
    key: Arc<str>,
    mode: LockMode,
}

impl<B> PollingWait<B> {
    /// The polling wait for `key` in `mode` on `backend`.
    pub fn new(backend: Arc<B>, key: &str, mode: LockMode) -> Self {
        PollingWait {
            backend,
            key: Arc::from(key),
            mode,
        }
    }
}

impl<B> fmt::Debug for PollingWait<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is the caller's data: never printed.
        f.debug_struct("PollingWait")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl<B: LockBackend> Wait for PollingWait<B> {
    type Lease = B::Lease;

    fn try_acquire(
        &mut self,
    ) -> impl Future<Output = Result<Option<Acquired<B::Lease>>, BackendError>> + Send + 'static
    {
        let (backend, key, mode) = (self.backend.clone(), self.key.clone(), self.mode);
        async move { backend.try_acquire(&key, mode).await }
    }

    fn changed(&mut self) -> impl Future<Output = Woken<B::Lease>> + Send + '_ {
        std::future::pending()
    }
}
