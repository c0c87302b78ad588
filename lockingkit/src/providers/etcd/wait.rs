//! The wait of one caller for an etcd lock: its queue place in line (see `line`), attempts
//! through that place, and the watch of the key ahead waking it.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;

use super::line::{Side, WaitId};
use super::{EtcdBackend, EtcdLease};
use crate::backend::{Acquired, BackendError, LockMode, Wait, Woken};

/// One caller's wait at an [`EtcdBackend`]: for a lock, a place in its line; for a semaphore,
/// polling.
pub(super) struct EtcdWait {
    backend: Arc<EtcdBackend>,
    key: Arc<str>,
    mode: LockMode,
    /// The wait's serial in its clone's line and what wakes it; `None` for a semaphore.
    queued: Option<(u64, watch::Receiver<()>)>,
}

impl EtcdWait {
    /// Opens the wait for `key` in `mode` on `backend`.
    pub(super) fn open(backend: Arc<EtcdBackend>, key: &str, mode: LockMode) -> Self {
        let queued = Side::of(mode).map(|side| backend.line.open(WaitId::new(key, side)));
        EtcdWait {
            backend,
            key: Arc::from(key),
            mode,
            queued,
        }
    }
}

impl Wait for EtcdWait {
    type Lease = EtcdLease;

    fn try_acquire(
        &mut self,
    ) -> impl Future<Output = Result<Option<Acquired<EtcdLease>>, BackendError>> + Send + 'static
    {
        let serial = self.queued.as_mut().map(|(serial, wake)| {
            // A wake-up from before this attempt is answered by it.
            wake.borrow_and_update();
            *serial
        });
        let (backend, key, mode) = (self.backend.clone(), self.key.clone(), self.mode);
        async move { backend.attempt(&key, mode, serial).await }
    }

    fn changed(&mut self) -> impl Future<Output = Woken<EtcdLease>> + Send + '_ {
        if let Some((serial, _)) = &self.queued {
            self.backend
                .inner
                .make_wanted_place(&self.backend.line, *serial);
        }
        async move {
            if let Some((_, wake)) = &mut self.queued {
                if wake.changed().await.is_ok() {
                    return Woken::Retry;
                }
            }
            // A semaphore's waiters poll; a wait whose line was emptied (its clone shut down)
            // is woken by nothing.
            std::future::pending().await
        }
    }
}

impl Drop for EtcdWait {
    fn drop(&mut self) {
        if let Some((serial, _)) = &self.queued {
            self.backend.inner.close_wait(&self.backend.line, *serial);
        }
    }
}
