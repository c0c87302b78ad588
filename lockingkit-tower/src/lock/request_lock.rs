//! `RequestLock`: what the handler sees of the lock held for its request.

use std::fmt;

use lockingkit::{LockHandle, LockMode, LockView};

/// The lock a [`LockLayer`](crate::LockLayer) holds for the current request.
///
/// The layer keeps the [`LockHandle`] itself (a handle is the proof of holding and cannot be
/// cloned) and puts this cheap, cloneable view into the request extensions, where the inner
/// service finds it with `request.extensions().get::<RequestLock>()`.
///
/// It is the handle's [`LockView`] (through `Deref`: the key, the fencing token to send with
/// every write, whether the lock is still held, [`run`](LockView::run)) plus the
/// [mode](Self::mode) the layer holds it in (alone, shared with other readers, or as one slot
/// of a semaphore). Its [`lost_token`](LockView::lost_token) fires when the lock is lost, and
/// also when the layer releases the lock after the response, so work spawned from the handler
/// and tied to the token stops once the request no longer holds the lock. The layer already
/// drops the whole handler on loss; `run` and the token are for work that outlives the
/// handler's own future, such as a spawned task.
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

    /// How the layer holds the key: [`LockMode::Exclusive`] by default, [`LockMode::Shared`]
    /// after [`LockLayer::shared`](crate::LockLayer::shared), [`LockMode::Semaphore`] after
    /// [`LockLayer::semaphore`](crate::LockLayer::semaphore).
    pub fn mode(&self) -> LockMode {
        self.mode
    }
}

impl std::ops::Deref for RequestLock {
    type Target = LockView;

    fn deref(&self) -> &LockView {
        &self.view
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
