//! `RequestLock`: what the handler sees of the lock held for its request.

use std::fmt;
use std::future::Future;

use lockingkit::{CancellationToken, LockError, LockHandle, LockMode, LockView};

/// The lock a [`LockLayer`](crate::LockLayer) holds for the current request.
///
/// The layer keeps the [`LockHandle`] itself (a handle is the proof of holding and cannot be
/// cloned) and puts this cheap, cloneable view into the request extensions, where the inner
/// service finds it with `request.extensions().get::<RequestLock>()`.
///
/// The view tells the key, the [mode](Self::mode) it is held in (alone, shared with other
/// readers, or as one slot of a semaphore), the fencing token to send with every write, and
/// whether the lock is still held. Its [`lost_token`](Self::lost_token) fires when the lock is lost, and also when
/// the layer releases the lock after the response, so work spawned from the handler and tied to
/// the token stops once the request no longer holds the lock.
#[derive(Clone)]
pub struct RequestLock {
    view: LockView,
    mode: LockMode,
}

impl RequestLock {
    /// The view of `handle` the handler sees.
    pub(crate) fn new(handle: &LockHandle, mode: LockMode) -> Self {
        RequestLock {
            view: handle.view(),
            mode,
        }
    }

    /// A loss signal for the layer to race the inner service against.
    pub(crate) fn loss_signal(&self) -> CancellationToken {
        self.view.lost_token()
    }

    /// The key of the lock.
    pub fn key(&self) -> &str {
        self.view.key()
    }

    /// Whether the lock was taken through `locks` (the same provider).
    pub fn is_from(&self, locks: &lockingkit::DistributedLock) -> bool {
        self.view.is_from(locks)
    }

    /// How the layer holds the key: [`LockMode::Exclusive`] by default, [`LockMode::Shared`]
    /// after [`LockLayer::shared`](crate::LockLayer::shared), [`LockMode::Semaphore`] after
    /// [`LockLayer::semaphore`](crate::LockLayer::semaphore).
    pub fn mode(&self) -> LockMode {
        self.mode
    }

    /// The fencing token of this hold; strictly greater than every earlier token for the key.
    pub fn fencing_token(&self) -> u64 {
        self.view.fencing_token()
    }

    /// A token that is cancelled when the lock is lost or released.
    ///
    /// Each call returns a child token, so cancelling it affects only the caller's copy.
    pub fn lost_token(&self) -> CancellationToken {
        self.view.lost_token()
    }

    /// Whether the lock is still held: not lost, not released, and within its loss deadline.
    pub fn is_held(&self) -> bool {
        self.view.is_held()
    }

    /// `Ok(())` while the lock is held, `Err` of kind [`ErrorKind::Lost`](lockingkit::ErrorKind::Lost)
    /// (with the reason, when the lock was lost rather than released) after.
    pub fn ensure_held(&self) -> Result<(), LockError> {
        self.view.ensure_held()
    }

    /// Runs `work` while the lock is held, dropping it the moment the lock is lost or released.
    ///
    /// The layer already drops the whole handler on loss; use this for work that outlives the
    /// handler's own future, such as a spawned task. It is [`LockView::run`].
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output, LockError> {
        self.view.run(work).await
    }
}

impl fmt::Debug for RequestLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is left out on purpose: keys routinely carry customer ids.
        f.debug_struct("RequestLock")
            .field("mode", &self.mode)
            .field("fencing_token", &self.fencing_token())
            .field("is_held", &self.is_held())
            .finish_non_exhaustive()
    }
}
