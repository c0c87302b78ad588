//! `RequestLock`: what the handler sees of the lock held for its request.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use lockingkit::{CancellationToken, LockError, LockHandle};

use super::until_lost::UntilLost;

/// The lock a [`LockLayer`](crate::LockLayer) holds for the current request.
///
/// The layer keeps the [`LockHandle`] itself (a handle is the proof of holding and cannot be
/// cloned) and puts this cheap, cloneable view into the request extensions, where the inner
/// service finds it with `request.extensions().get::<RequestLock>()`.
///
/// The view tells the key, the fencing token to send with every write, and whether the lock is
/// still held. Its [`lost_token`](Self::lost_token) fires when the lock is lost, and also when
/// the layer releases the lock after the response, so work spawned from the handler and tied to
/// the token stops once the request no longer holds the lock.
#[derive(Clone)]
pub struct RequestLock {
    inner: Arc<Inner>,
}

struct Inner {
    key: String,
    fencing_token: u64,
    lost: CancellationToken,
}

impl RequestLock {
    /// The view of `handle`, which holds `key` (moved in rather than copied from the handle).
    pub(crate) fn new(handle: &LockHandle, key: String) -> Self {
        RequestLock {
            inner: Arc::new(Inner {
                key,
                fencing_token: handle.fencing_token(),
                lost: handle.lost_token(),
            }),
        }
    }

    /// The view's own loss signal (not a child), for the layer to race the inner service
    /// against: one token per request serves both.
    pub(crate) fn loss_signal(&self) -> CancellationToken {
        self.inner.lost.clone()
    }

    /// The key of the lock.
    pub fn key(&self) -> &str {
        &self.inner.key
    }

    /// The fencing token of this hold; strictly greater than every earlier token for the key.
    pub fn fencing_token(&self) -> u64 {
        self.inner.fencing_token
    }

    /// A token that is cancelled when the lock is lost or released.
    ///
    /// Each call returns a child token, so cancelling it affects only the caller's copy.
    pub fn lost_token(&self) -> CancellationToken {
        self.inner.lost.child_token()
    }

    /// Whether the lock is still held: neither lost nor released yet.
    pub fn is_held(&self) -> bool {
        !self.inner.lost.is_cancelled()
    }

    /// `Ok(())` while the lock is held, `Err` of kind [`ErrorKind::Lost`](lockingkit::ErrorKind::Lost)
    /// after.
    pub fn ensure_held(&self) -> Result<(), LockError> {
        if self.is_held() {
            Ok(())
        } else {
            Err(LockError::lost(None))
        }
    }

    /// Runs `work` while the lock is held, dropping it the moment the lock is lost or released.
    ///
    /// The layer already drops the whole handler on loss; use this for work that outlives the
    /// handler's own future, such as a spawned task.
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output, LockError> {
        self.ensure_held()?;
        UntilLost::new(self.inner.lost.clone(), work)
            .await
            .ok_or_else(|| LockError::lost(None))
    }
}

impl fmt::Debug for RequestLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is left out on purpose: keys routinely carry customer ids.
        f.debug_struct("RequestLock")
            .field("fencing_token", &self.fencing_token())
            .field("is_held", &self.is_held())
            .finish_non_exhaustive()
    }
}
