//! `DistributedSemaphore`: at most N holders of a key at once, across every process.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::LockMode;
use crate::error::LockError;
use crate::handle::LockHandle;
use crate::lock::DistributedLock;

/// The most holders a semaphore may admit. A backend may refuse fewer (Azure tries one blob per
/// slot); see its documentation.
pub const MAX_SEMAPHORE_COUNT: u32 = 1024;

/// At most `max_count` holders of a key at once, across every process.
///
/// Made by [`DistributedLock::semaphore`], bound to one key like
/// [`ReaderWriterLock`](crate::ReaderWriterLock). Each holder gets a [`LockHandle`] for one slot, with
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
    pub(crate) fn new(locks: DistributedLock, key: &str, max_count: u32) -> Self {
        DistributedSemaphore {
            locks,
            key: Arc::from(key),
            max_count,
        }
    }

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
