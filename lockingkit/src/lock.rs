//! `DistributedLock`: the one lock type, whatever the backend.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::metrics::Meter;

use crate::backend::{LockBackend, LockMode};
use crate::engine::{AnyEngine, Engine, LockOptions};
use crate::error::LockError;
use crate::handle::LockHandle;
use crate::keys::validate_key;
use crate::providers::memory::{MemoryBackend, MemoryStore};
use crate::reader_writer::ReaderWriterLock;
use crate::semaphore::DistributedSemaphore;
use crate::telemetry::KeyDigest;

/// The name of the provider a plain `DistributedLock` stands for.
pub(crate) const DEFAULT_NAME: &str = "Default";

/// A distributed lock provider: one configured backend and the engine around it.
///
/// `DistributedLock` is a cheap handle (an `Arc`) to clone into every task and service. Code
/// written against it runs unchanged on Azure Blob leases, PostgreSQL advisory locks and the
/// in-memory provider.
///
/// Locks are **not reentrant**: a key held through this `DistributedLock` is busy for every
/// other caller of it, including the holder's own task. Within one `DistributedLock`, waiters
/// for a key queue first come, first served, and only the front one talks to the backend.
///
/// ```
/// use std::time::Duration;
/// use lockingkit::{DistributedLock, ErrorKind};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lockingkit::LockError> {
/// let locks = DistributedLock::in_memory();
/// let held = locks.try_acquire("jobs/nightly-export").await?;
///
/// // A second caller is told the lock is busy instead of getting an exception-like surprise.
/// let busy = locks.try_acquire("jobs/nightly-export").await.unwrap_err();
/// assert_eq!(busy.kind(), ErrorKind::Busy);
///
/// held.release().await?;
/// let again = locks.acquire("jobs/nightly-export", Duration::from_secs(5)).await?;
/// # drop(again); Ok(()) }
/// ```
#[derive(Clone)]
pub struct DistributedLock {
    engine: Arc<dyn AnyEngine>,
}

impl DistributedLock {
    /// A new in-memory provider named `Default`, with its own private store and 30 s leases.
    ///
    /// It behaves like a lease backend (expiry, renewal, fencing), so tests of your code meet
    /// the same situations they would in production.
    pub fn in_memory() -> Self {
        Self::in_memory_shared(&MemoryStore::new())
    }

    /// An in-memory provider on a shared store: several of these act as separate processes.
    pub fn in_memory_shared(store: &MemoryStore) -> Self {
        Self::builder(MemoryBackend::new(store.clone())).build_infallible_default()
    }

    /// Starts configuring a provider on `backend`.
    pub fn builder<B: LockBackend>(backend: B) -> DistributedLockBuilder<B> {
        DistributedLockBuilder {
            backend,
            name: DEFAULT_NAME.to_owned(),
            options: LockOptions::default(),
            meter: None,
            key_digest: None,
        }
    }

    /// The registration name: `Default`, `Jobs`, …
    pub fn name(&self) -> &str {
        self.engine.name()
    }

    /// The provider: `azure_blob`, `postgres`, `in_memory` or a custom backend's name.
    pub fn provider(&self) -> &str {
        self.engine.provider()
    }

    /// Makes one attempt to take `key`.
    ///
    /// Fails with [`ErrorKind::Busy`](crate::ErrorKind::Busy) if anyone holds it, including
    /// another caller of this `DistributedLock`, and with
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable) if the backend could not be
    /// asked. Dropping the returned future at any point never leaks the lock.
    pub async fn try_acquire(&self, key: &str) -> Result<LockHandle, LockError> {
        self.engine
            .clone()
            .try_acquire(key, LockMode::Exclusive)
            .await
    }

    /// Waits up to `timeout` for `key`.
    ///
    /// Retries with capped exponential backoff and equal jitter. Stops at the first failure no
    /// retry can fix. Dropping the future cancels the wait and never leaks the lock. Any
    /// `timeout` is accepted: `Duration::MAX` waits as long as it takes.
    ///
    /// Every wait ends with an answer from the backend, however short (a zero `timeout` makes
    /// one attempt): an attempt in flight at the deadline is awaited.
    /// - [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) when the time ran out and the
    ///   backend's latest answer was "busy".
    /// - [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable) at once when an attempt
    ///   failed (the backend answered with a failure, a 5xx or a full lock table, or could not
    ///   be reached), went unanswered for the engine's patience (`max_retry_delay`, and at
    ///   least 2 s), or was refused because the backend is failing — including while this
    ///   caller waited behind others or slept between attempts. The cause is in the message
    ///   and is the error's `source()`; try again after a pause to ride out an outage.
    ///
    /// So an outage is never mistaken for contention, nor contention for an outage.
    pub async fn acquire(&self, key: &str, timeout: Duration) -> Result<LockHandle, LockError> {
        self.engine
            .clone()
            .acquire(key, LockMode::Exclusive, timeout)
            .await
    }

    /// Makes one attempt to take `key` in `mode`: the form of
    /// [`try_acquire`](Self::try_acquire) for every lock mode, for code that picks the mode at
    /// run time (an HTTP layer configured per route). [`reader_writer`](Self::reader_writer)
    /// and [`semaphore`](Self::semaphore) are the friendlier faces of the same calls.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured) before any
    /// request if the provider cannot hold locks in `mode` (see [`supports`](Self::supports)),
    /// and for a semaphore of 0 or more than [`MAX_SEMAPHORE_COUNT`](crate::backend::MAX_SEMAPHORE_COUNT)
    /// holders.
    pub async fn try_acquire_in(&self, key: &str, mode: LockMode) -> Result<LockHandle, LockError> {
        self.ensure_supports(mode)?;
        self.engine.clone().try_acquire(key, mode).await
    }

    /// Waits up to `timeout` for `key` in `mode`, as [`acquire`](Self::acquire) waits; see
    /// [`try_acquire_in`](Self::try_acquire_in).
    pub async fn acquire_in(
        &self,
        key: &str,
        mode: LockMode,
        timeout: Duration,
    ) -> Result<LockHandle, LockError> {
        self.ensure_supports(mode)?;
        self.engine.clone().acquire(key, mode, timeout).await
    }

    /// Whether this provider can hold locks in `mode`: every provider holds exclusive locks;
    /// in-memory and PostgreSQL also readers and semaphores, Azure semaphores of up to 32
    /// holders but no readers. Asking sends nothing.
    pub fn supports(&self, mode: LockMode) -> bool {
        self.ensure_supports(mode).is_ok()
    }

    /// `Ok` if this provider can hold locks in `mode`, else the
    /// [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured) error that says why (for
    /// refusing a configuration at startup rather than on every request).
    pub fn ensure_supports(&self, mode: LockMode) -> Result<(), LockError> {
        if let LockMode::Semaphore { max_count } = mode {
            if !(1..=crate::backend::MAX_SEMAPHORE_COUNT).contains(&max_count) {
                return Err(LockError::new(
                    crate::ErrorKind::Misconfigured,
                    format!(
                        "a semaphore admits between 1 and {} holders, not {max_count}",
                        crate::backend::MAX_SEMAPHORE_COUNT
                    ),
                ));
            }
        }
        if self.engine.supports(mode) {
            return Ok(());
        }
        let what = match mode {
            LockMode::Shared => "shared (reader-writer) locks".to_owned(),
            LockMode::Semaphore { max_count } => format!("semaphores of {max_count} holders"),
            _ => format!("{mode} locks"),
        };
        Err(LockError::new(
            crate::ErrorKind::Misconfigured,
            format!(
                "the {} provider of lock `{}` cannot hold {what}",
                self.provider(),
                self.name()
            ),
        ))
    }

    /// A reader-writer lock on `key`: readers hold it together, a writer alone (the writer's
    /// lock is the key's plain lock).
    ///
    /// Fails with [`ErrorKind::InvalidKey`](crate::ErrorKind::InvalidKey) for a key outside
    /// 1–512 characters, and with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured)
    /// if the provider cannot hold shared locks: Azure Blob leases are exclusive only, so the
    /// Azure provider refuses rather than hand out an exclusive lock that pretends to be
    /// shared. Nothing is sent to the backend.
    pub fn reader_writer(&self, key: &str) -> Result<ReaderWriterLock, LockError> {
        validate_key(key)?;
        self.ensure_supports(LockMode::Shared)?;
        Ok(ReaderWriterLock::new(self.clone(), key))
    }

    /// A semaphore named `key` that admits at most `max_count` holders at once.
    ///
    /// Fails with [`ErrorKind::InvalidKey`](crate::ErrorKind::InvalidKey) for a key outside
    /// 1–512 characters, and with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured)
    /// if `max_count` is 0 or above [`MAX_SEMAPHORE_COUNT`](crate::backend::MAX_SEMAPHORE_COUNT), or the
    /// provider cannot hold semaphores of that size. Nothing is sent to the backend.
    pub fn semaphore(&self, key: &str, max_count: u32) -> Result<DistributedSemaphore, LockError> {
        validate_key(key)?;
        self.ensure_supports(LockMode::Semaphore { max_count })?;
        Ok(DistributedSemaphore::new(self.clone(), key, max_count))
    }

    /// The failure this provider's callers are refused with right now, if its backend is
    /// failing: from the first attempt that fails (the backend could not be reached, refused
    /// our credentials, answered with a failure of its own) until one is answered again.
    /// Meanwhile callers are refused at once with this error and one attempt at a time is
    /// sent, ever less often (see [`LockOptions::max_outage_retry_delay`]).
    ///
    /// It costs nothing: no request is made. A readiness check can report it.
    ///
    /// [`LockOptions::max_outage_retry_delay`]: crate::LockOptions::max_outage_retry_delay
    pub fn current_failure(&self) -> Option<LockError> {
        self.engine.current_failure()
    }

    /// Checks over the network, once at startup, what building could not: that the backend
    /// answers, accepts the credentials and has what locks need (see each provider's guide for
    /// what its check sends and costs). Takes no lock and leaves nothing open.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured) naming what is
    /// wrong, or [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable) when the backend does
    /// not answer. [`Locking::verify`](crate::Locking::verify) checks every provider of a
    /// registry.
    pub async fn verify(&self) -> Result<(), LockError> {
        self.engine.verify().await
    }

    /// Shuts the provider down within `timeout`: refuses new acquires (callers get
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable)), ends waits, gives up every
    /// lock still held (their lost tokens fire first, so work tied to them stops), waits for
    /// those releases and for attempts whose callers went away, then closes what the backend
    /// keeps open (PostgreSQL's sessions). Call it as the process stops, after your server has
    /// drained its requests, so that no lease outlives the process and no session lingers.
    ///
    /// Every clone of this `DistributedLock` is shut down with it; a PostgreSQL backend shared
    /// by several providers (clones of one `PostgresBackend`) closes its sessions for all of
    /// them. `Err` of kind `Unavailable` if something was still outstanding at the timeout:
    /// the backend then frees it when the lease expires or the connection closes.
    ///
    /// ```
    /// use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lockingkit::LockError> {
    /// let locks = lockingkit::DistributedLock::in_memory();
    /// let job = locks.try_acquire("jobs/nightly").await?;
    /// locks.shutdown(Duration::from_secs(5)).await?;
    /// assert!(!job.is_held(), "given up at shutdown");
    /// # Ok(()) }
    /// ```
    pub async fn shutdown(&self, timeout: Duration) -> Result<(), LockError> {
        self.engine.clone().shutdown(timeout).await
    }

    /// How many local callers of this provider (this value and its clones) are holding,
    /// attempting or waiting for a lock right now, each counted once (a holder, an attempt in
    /// flight, a caller queued): zero when nothing is held or going on. Meant for diagnostics
    /// and leak checks.
    ///
    /// It counts every caller, not only each queue's *active party* (the one caller of a key
    /// that talks to the backend): twenty callers waiting for one key count twenty.
    pub fn local_callers(&self) -> usize {
        self.engine.local_callers()
    }

    /// How many local callers are waiting for `key` through this provider (not counting the
    /// holder). Meant for diagnostics and tests.
    pub fn waiting(&self, key: &str) -> usize {
        self.engine.waiting(key)
    }

    /// The address of the engine, which identifies this provider (see `LockView::is_from`).
    pub(crate) fn engine_address(&self) -> usize {
        Arc::as_ptr(&self.engine).cast::<()>() as usize
    }

    /// The backend, if it is of type `B` (for provider-specific controls).
    pub fn backend<B: LockBackend>(&self) -> Option<&B> {
        self.engine.backend_any().downcast_ref::<B>()
    }
}

impl Default for DistributedLock {
    fn default() -> Self {
        Self::in_memory()
    }
}

impl fmt::Debug for DistributedLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistributedLock")
            .field("name", &self.name())
            .field("provider", &self.provider())
            .finish()
    }
}

/// Configures a [`DistributedLock`] on a backend.
#[must_use]
pub struct DistributedLockBuilder<B> {
    backend: B,
    name: String,
    options: LockOptions,
    meter: Option<Meter>,
    key_digest: Option<KeyDigest>,
}

impl<B: LockBackend> DistributedLockBuilder<B> {
    /// The registration name, used in telemetry (`Default` unless set).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Engine options: retry delays, renewal cadence, release timeout.
    pub fn options(mut self, options: LockOptions) -> Self {
        self.options = options;
        self
    }

    /// The first retry delay of a waiter (50 ms by default).
    pub fn min_retry_delay(mut self, delay: Duration) -> Self {
        self.options.min_retry_delay = delay;
        self
    }

    /// The cap of a waiter's retry delay (1 s by default).
    pub fn max_retry_delay(mut self, delay: Duration) -> Self {
        self.options.max_retry_delay = delay;
        self
    }

    /// The meter to record on, instead of the global provider's `lockingkit` meter.
    pub fn meter(mut self, meter: Meter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// Records a keyed digest of each lock's key as `lockingkit.key.digest` on the acquire and
    /// release spans and on the loss log line, so that what happened to one key can be found
    /// across spans, logs and instances without recording the key (keys routinely carry
    /// customer ids). The digest is the first 8 bytes of HMAC-SHA256 of the key under
    /// `secret`, as 16 hex digits: give every instance the same secret to correlate across
    /// them, and keep it as secret as the keys, since with it a guessed key can be checked.
    /// Off unless set.
    pub fn key_digests(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.key_digest = Some(KeyDigest::new(secret.as_ref()));
        self
    }

    /// The digests a registry's host asked for (see [`key_digests`](Self::key_digests)).
    pub(crate) fn with_key_digest(mut self, key_digest: Option<KeyDigest>) -> Self {
        self.key_digest = key_digest;
        self
    }

    /// Validates the options and builds the provider.
    pub fn build(self) -> Result<DistributedLock, LockError> {
        let meter = self.meter.unwrap_or_else(crate::telemetry::global_meter);
        let engine = Engine::new(
            &self.name,
            self.backend,
            self.options,
            &meter,
            self.key_digest,
        )?;
        Ok(DistributedLock {
            engine: Arc::new(engine),
        })
    }
}

impl DistributedLockBuilder<MemoryBackend> {
    /// Default options and a valid lease cannot fail validation; this keeps `in_memory()`
    /// infallible without a panic path.
    fn build_infallible_default(self) -> DistributedLock {
        let meter = crate::telemetry::global_meter();
        let engine = Engine::new_unchecked(&self.name, self.backend, self.options, &meter, None);
        DistributedLock {
            engine: Arc::new(engine),
        }
    }
}
