//! A bridge for providers whose waits are still told by hints: the wait makes a hint each time
//! the engine listens for a change, and attempts as a plain `try_acquire`.
//!
//! Temporary: each provider keeps its own [`Wait`](crate::backend::Wait) once its waiting is
//! written against the explicit seam.

use std::future::Future;
use std::sync::Arc;

use crate::backend::{Acquired, BackendError, LockBackend, LockMode, Wait, Woken};

/// A provider that can tell when a key may have been released.
pub(crate) trait Hints: LockBackend {
    /// Resolves when `key` may have become free for a caller in `mode`.
    fn hint(&self, key: &str, mode: LockMode) -> impl Future<Output = ()> + Send + 'static;
}

/// A wait told by [`Hints`].
pub(crate) struct HintedWait<B> {
    backend: Arc<B>,
    key: Arc<str>,
    mode: LockMode,
}

impl<B> HintedWait<B> {
    pub(crate) fn new(backend: Arc<B>, key: &str, mode: LockMode) -> Self {
        HintedWait {
            backend,
            key: Arc::from(key),
            mode,
        }
    }
}

impl<B: Hints> Wait for HintedWait<B> {
    type Lease = B::Lease;

    fn try_acquire(
        &mut self,
    ) -> impl Future<Output = Result<Option<Acquired<B::Lease>>, BackendError>> + Send + 'static
    {
        let (backend, key, mode) = (self.backend.clone(), self.key.clone(), self.mode);
        async move { backend.try_acquire(&key, mode).await }
    }

    fn changed(&mut self) -> impl Future<Output = Woken<B::Lease>> + Send + '_ {
        let hint = self.backend.hint(&self.key, self.mode);
        async move {
            hint.await;
            Woken::Retry
        }
    }
}
