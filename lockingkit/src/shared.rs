//! Reader-writer locks and semaphores: the same engine, holds in other modes.
//!
//! Both are views of a [`DistributedLock`], so they share its backend, options, telemetry and
//! waiting: a handle from either is a [`LockHandle`] with the same guarantees (renewal, loss
//! detection, fencing token, release on drop).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::LockMode;
use crate::error::{ErrorKind, LockError};
use crate::handle::LockHandle;
use crate::keys::validate_key;
use crate::lock::DistributedLock;

/// The most holders a semaphore may admit. A backend may refuse fewer (Azure tries one blob per
/// slot); see its documentation.
pub const MAX_SEMAPHORE_COUNT: u32 = 1024;

/// Readers of a key hold it together; a writer holds it alone.
///
/// Made by [`DistributedLock::reader_writer`]. The writer's lock *is* the key's plain lock:
/// [`write`](Self::write) and [`DistributedLock::acquire`] take the same lock, so code that
/// already locks a key with `acquire` excludes readers of it unchanged.
///
/// # Fairness
/// - In one process, writers (and plain lockers) of a key wait in arrival order, as plain locks
///   do. Readers never wait for one another: each reader takes a shared lease of its own.
/// - A writer that waits for readers is not starved by new ones: while a writer waits, the
///   backend refuses new readers of the key (the writer's *intent*), in this process and in
///   others. How the intent is kept is the backend's: the in-memory provider keeps it for
///   [`WRITER_INTENT`](crate::providers::memory::WRITER_INTENT) after each of the writer's
///   attempts; PostgreSQL queues the
///   writer in the server's lock queue (see the PostgreSQL guide). Readers that already hold
///   the key keep it; the writer gets in once they have all released.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lockingkit::LockError> {
/// use lockingkit::{DistributedLock, ErrorKind};
///
/// let locks = DistributedLock::in_memory();
/// let rw = locks.reader_writer()?;
/// let first = rw.try_read("catalog/prices").await?;
/// let second = rw.try_read("catalog/prices").await?; // readers hold together
/// let busy = rw.try_write("catalog/prices").await.unwrap_err();
/// assert_eq!(busy.kind(), ErrorKind::Busy); // a writer waits for every reader
/// first.release().await?;
/// second.release().await?;
/// let writer = rw.try_write("catalog/prices").await?;
/// # writer.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ReaderWriterLock {
    locks: DistributedLock,
}

impl ReaderWriterLock {
    /// Makes one attempt to read `key`: `Busy` while a writer holds it or waits for it.
    pub async fn try_read(&self, key: &str) -> Result<LockHandle, LockError> {
        self.locks.try_acquire_in(key, LockMode::Shared).await
    }

    /// Waits up to `timeout` to read `key`, as [`DistributedLock::acquire`] waits.
    pub async fn read(&self, key: &str, timeout: Duration) -> Result<LockHandle, LockError> {
        self.locks.acquire_in(key, LockMode::Shared, timeout).await
    }

    /// Makes one attempt to write `key`: `Busy` while anyone reads or writes it.
    pub async fn try_write(&self, key: &str) -> Result<LockHandle, LockError> {
        self.locks.try_acquire(key).await
    }

    /// Waits up to `timeout` to write `key`; new readers are held back meanwhile.
    pub async fn write(&self, key: &str, timeout: Duration) -> Result<LockHandle, LockError> {
        self.locks.acquire(key, timeout).await
    }

    /// The provider this lock runs on.
    pub fn locks(&self) -> &DistributedLock {
        &self.locks
    }
}

impl fmt::Debug for ReaderWriterLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReaderWriterLock")
            .field("lock", &self.locks.name())
            .finish()
    }
}

/// At most `max_count` holders of a key at once, across every process.
///
/// Made by [`DistributedLock::semaphore`]. Each holder gets a [`LockHandle`] for one slot, with
/// a fencing token that grows per slot. Semaphores are named in a namespace of their own: the
/// semaphore `exports/tenant-7` and the lock `exports/tenant-7` are unrelated.
///
/// How many fit is always the backend's answer. A caller attempts at once unless callers in
/// this process already wait for the semaphore (of the same count), so callers of a semaphore
/// with room get in together. Once one is answered "full", the callers here that wait queue in
/// arrival order and only the front one polls the backend (with backoff): a full semaphore
/// costs one stream of requests per process, not one per waiter. When the front caller takes a
/// slot the next one attempts at once, and a holder here that releases its slot has the front
/// caller attempt at once. `try_acquire` while callers here wait is `Busy`, without a request.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lockingkit::LockError> {
/// use lockingkit::{DistributedLock, ErrorKind};
///
/// let locks = DistributedLock::in_memory();
/// let exports = locks.semaphore("exports/tenant-7", 2)?;
/// let a = exports.try_acquire().await?;
/// let b = exports.try_acquire().await?;
/// assert_eq!(exports.try_acquire().await.unwrap_err().kind(), ErrorKind::Busy);
/// a.release().await?;
/// let c = exports.try_acquire().await?; // a slot is free again
/// # b.release().await?; c.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct DistributedSemaphore {
    locks: DistributedLock,
    key: Arc<str>,
    max_count: u32,
}

impl DistributedSemaphore {
    /// Makes one attempt to take a slot: `Busy` when all `max_count` are taken.
    pub async fn try_acquire(&self) -> Result<LockHandle, LockError> {
        self.locks.try_acquire_in(&self.key, self.mode()).await
    }

    /// Waits up to `timeout` for a free slot, as [`DistributedLock::acquire`] waits.
    pub async fn acquire(&self, timeout: Duration) -> Result<LockHandle, LockError> {
        self.locks.acquire_in(&self.key, self.mode(), timeout).await
    }

    /// The semaphore's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// How many holders it admits at once.
    pub fn max_count(&self) -> u32 {
        self.max_count
    }

    fn mode(&self) -> LockMode {
        LockMode::Semaphore {
            max_count: self.max_count,
        }
    }
}

impl fmt::Debug for DistributedSemaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is left out on purpose: keys routinely carry customer ids.
        f.debug_struct("DistributedSemaphore")
            .field("lock", &self.locks.name())
            .field("max_count", &self.max_count)
            .finish_non_exhaustive()
    }
}

impl DistributedLock {
    /// A reader-writer lock on this provider.
    ///
    /// Fails with [`ErrorKind::Misconfigured`] if the provider cannot hold shared locks: Azure
    /// Blob leases are exclusive only, so the Azure provider refuses rather than hand out an
    /// exclusive lock that pretends to be shared.
    pub fn reader_writer(&self) -> Result<ReaderWriterLock, LockError> {
        if !self.supports(LockMode::Shared) {
            return Err(unsupported(self, LockMode::Shared));
        }
        Ok(ReaderWriterLock {
            locks: self.clone(),
        })
    }

    /// A semaphore named `key` that admits at most `max_count` holders at once.
    ///
    /// Fails with [`ErrorKind::InvalidKey`] for a key outside 1–512 characters, and with
    /// [`ErrorKind::Misconfigured`] if `max_count` is 0 or above [`MAX_SEMAPHORE_COUNT`], or the
    /// provider cannot hold semaphores of that size.
    pub fn semaphore(&self, key: &str, max_count: u32) -> Result<DistributedSemaphore, LockError> {
        validate_key(key)?;
        if max_count == 0 || max_count > MAX_SEMAPHORE_COUNT {
            return Err(LockError::new(
                ErrorKind::Misconfigured,
                format!(
                    "a semaphore admits between 1 and {MAX_SEMAPHORE_COUNT} holders, not \
                     {max_count}"
                ),
            ));
        }
        let mode = LockMode::Semaphore { max_count };
        if !self.supports(mode) {
            return Err(unsupported(self, mode));
        }
        Ok(DistributedSemaphore {
            locks: self.clone(),
            key: Arc::from(key),
            max_count,
        })
    }
}

fn unsupported(locks: &DistributedLock, mode: LockMode) -> LockError {
    let what = match mode {
        LockMode::Semaphore { max_count } => format!("semaphores of {max_count}"),
        _ => format!("{mode} locks"),
    };
    LockError::new(
        ErrorKind::Misconfigured,
        format!(
            "the {} provider of lock `{}` cannot hold {what}",
            locks.provider(),
            locks.name()
        ),
    )
}
