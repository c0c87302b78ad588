//! The wait of one caller for a Redis key (see [`LockBackend::wait`]): Redis keeps nothing for
//! a waiter, so its attempts are plain attempts, and what it adds is being woken by the release
//! watch (see `watch`) the moment a release of its key is heard.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use super::keys::RedisLockKeys;
use super::watch::Interest;
use super::{RedisBackend, RedisLease};
use crate::backend::{Acquired, BackendError, LockBackend, LockMode, Wait, Woken};

/// One caller's wait, from its first busy answer until it leaves; dropping it gives up its
/// interest in the key's release channel at once.
pub(super) struct RedisWait {
    backend: Arc<RedisBackend>,
    key: Arc<str>,
    mode: LockMode,
    /// The key's `released` channel, for plain locks and readers. A semaphore has none: its
    /// releases publish nothing, so its wait polls.
    released: Option<Interest>,
}

impl RedisWait {
    /// Opens the wait: for a lock or a reader, its interest is registered and the subscription
    /// asked for now.
    pub(super) fn open(backend: Arc<RedisBackend>, key: &str, mode: LockMode) -> Self {
        let released = match mode {
            LockMode::Semaphore { .. } => None,
            _ => {
                let channel = RedisLockKeys::lock(&backend.inner.prefix, key).released;
                Some(backend.inner.releases.listen(channel))
            }
        };
        RedisWait {
            backend,
            key: Arc::from(key),
            mode,
            released,
        }
    }
}

impl fmt::Debug for RedisWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is the caller's data: never printed.
        f.debug_struct("RedisWait")
            .field("mode", &self.mode)
            .field("woken_by_releases", &self.released.is_some())
            .finish_non_exhaustive()
    }
}

impl Wait for RedisWait {
    type Lease = RedisLease;

    fn try_acquire(
        &mut self,
    ) -> impl Future<Output = Result<Option<Acquired<RedisLease>>, BackendError>> + Send + 'static
    {
        let (backend, key, mode) = (self.backend.clone(), self.key.clone(), self.mode);
        async move { backend.try_acquire(&key, mode).await }
    }

    async fn changed(&mut self) -> Woken<RedisLease> {
        match self.released.as_mut() {
            Some(released) => released.changed().await,
            None => std::future::pending().await,
        }
        Woken::Retry
    }
}
