//! `ReaderWriterLock`: readers of a key hold it together, a writer alone.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::LockMode;
use crate::error::LockError;
use crate::handle::LockHandle;
use crate::lock::DistributedLock;

/// Readers of a key hold it together; a writer holds it alone.
///
/// Made by [`DistributedLock::reader_writer`], bound to one key like
/// [`DistributedSemaphore`](crate::DistributedSemaphore). The writer's lock *is* the key's plain
/// lock: [`write`](Self::write) and [`DistributedLock::acquire`] take the same lock, so code
/// that already locks a key with `acquire` excludes readers of it unchanged.
///
/// # Fairness
/// - In one process, writers (and plain lockers) of a key wait in arrival order, as plain locks
///   do. Readers never wait for one another: each reader takes a shared lease of its own, and
///   readers attempt together until one is answered busy; then the readers here wait in
///   arrival order and only the front one asks the backend, so a key busy for readers costs one
///   stream of requests per process. A local writer's release wakes the front reader at once,
///   and the last local reader's release the front writer.
/// - A writer that waits for readers is not starved by new ones: while a writer waits, the
///   backend refuses new readers of the key (the writer's *intent*), in this process and in
///   others. How the intent is kept is the backend's: the in-memory provider keeps it for
///   [`WRITER_INTENT`](crate::providers::memory::WRITER_INTENT) after each of the writer's
///   attempts; PostgreSQL queues the writer in the server's lock queue (see the PostgreSQL
///   guide). Readers that already hold the key keep it; the writer gets in once they have all
///   released.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lockingkit::LockError> {
/// use lockingkit::{DistributedLock, ErrorKind};
///
/// let locks = DistributedLock::in_memory();
/// let prices = locks.reader_writer("catalog/prices")?;
/// let first = prices.try_read().await?;
/// let second = prices.try_read().await?; // readers hold together
/// let busy = prices.try_write().await.unwrap_err();
/// assert_eq!(busy.kind(), ErrorKind::Busy); // a writer waits for every reader
/// first.release().await?;
/// second.release().await?;
/// let writer = prices.try_write().await?;
/// # writer.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ReaderWriterLock {
    locks: DistributedLock,
    key: Arc<str>,
}

impl ReaderWriterLock {
    pub(crate) fn new(locks: DistributedLock, key: &str) -> Self {
        ReaderWriterLock {
            locks,
            key: Arc::from(key),
        }
    }

    /// Makes one attempt to read: `Busy` while a writer holds the key or waits for it.
    pub async fn try_read(&self) -> Result<LockHandle, LockError> {
        self.locks.try_acquire_in(&self.key, LockMode::Shared).await
    }

    /// Waits up to `timeout` to read, as [`DistributedLock::acquire`] waits.
    pub async fn read(&self, timeout: Duration) -> Result<LockHandle, LockError> {
        self.locks
            .acquire_in(&self.key, LockMode::Shared, timeout)
            .await
    }

    /// Makes one attempt to write: `Busy` while anyone reads or writes the key.
    pub async fn try_write(&self) -> Result<LockHandle, LockError> {
        self.locks.try_acquire(&self.key).await
    }

    /// Waits up to `timeout` to write; new readers are held back meanwhile.
    pub async fn write(&self, timeout: Duration) -> Result<LockHandle, LockError> {
        self.locks.acquire(&self.key, timeout).await
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The provider this lock runs on.
    pub fn locks(&self) -> &DistributedLock {
        &self.locks
    }
}

impl fmt::Debug for ReaderWriterLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is left out on purpose: keys routinely carry customer ids.
        f.debug_struct("ReaderWriterLock")
            .field("lock", &self.locks.name())
            .finish_non_exhaustive()
    }
}
