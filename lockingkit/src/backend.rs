//! The small trait a lock backend implements; the engine does everything else.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::error::{ErrorKind, LockError, SharedSource};

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
}

impl BackendError {
    /// A failure of the given kind with a message for humans.
    pub fn new(kind: BackendErrorKind, message: impl Into<String>) -> Self {
        BackendError {
            kind,
            message: message.into(),
            source: None,
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
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn with_message(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
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

    /// Optional: a future that resolves when `key` may have become free for a caller in `mode`
    /// (released by someone else), so a waiter can retry at once instead of sleeping out its
    /// backoff. For a semaphore, `key` names the semaphore, and free means a slot.
    ///
    /// The engine calls this *before* each attempt of the front waiter and, when the attempt
    /// answers busy, races the future against the backoff sleep, so subscribe eagerly (in the
    /// function body, not on first poll) to catch a release that lands between a busy answer
    /// and the sleep. A spurious wake-up only costs one attempt. The default never resolves:
    /// waiting is pure polling, which stays the fallback and the cap whatever a backend offers
    /// here.
    fn release_hint(&self, key: &str, mode: LockMode) -> impl Future<Output = ()> + Send + 'static {
        let _ = (key, mode);
        std::future::pending()
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
