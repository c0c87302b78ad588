//! The handle a layer keeps for one request: one key's lock, or several keys held as one.

use std::future::Future;
use std::pin::Pin;

use http::Extensions;
use lockingkit::{CancellationToken, LockError, LockHandle, MultiLockHandle};

/// The handle of the hold a layer keeps while the inner service runs (and, if asked, while the
/// body streams). The layer owns it; the handler gets its view.
pub(crate) enum Handle {
    One(LockHandle),
    Many(MultiLockHandle),
}

impl Handle {
    /// Puts the handler's view of the hold into the request extensions: a
    /// [`LockView`](lockingkit::LockView) for one key, a
    /// [`MultiLockView`](lockingkit::MultiLockView) for several.
    pub(crate) fn insert_view(&self, extensions: &mut Extensions) {
        match self {
            Handle::One(handle) => {
                extensions.insert(handle.view());
            }
            Handle::Many(handle) => {
                extensions.insert(handle.view());
            }
        }
    }

    /// A token that fires when the hold is lost or released.
    pub(crate) fn loss_signal(&self) -> CancellationToken {
        match self {
            Handle::One(handle) => handle.lost_token(),
            Handle::Many(handle) => handle.lost_token(),
        }
    }

    /// Whether the hold is still held: not lost, not released, within its loss deadline.
    pub(crate) fn is_held(&self) -> bool {
        match self {
            Handle::One(handle) => handle.is_held(),
            Handle::Many(handle) => handle.is_held(),
        }
    }

    /// `Err` of kind `Lost` once the hold is lost.
    pub(crate) fn ensure_held(&self) -> Result<(), LockError> {
        match self {
            Handle::One(handle) => handle.ensure_held(),
            Handle::Many(handle) => handle.ensure_held(),
        }
    }

    /// The fencing token to log about a loss: the lock's, or the first member's.
    pub(crate) fn fencing_token(&self) -> Option<u64> {
        match self {
            Handle::One(handle) => Some(handle.fencing_token()),
            Handle::Many(handle) => handle.members().first().map(|m| m.fencing_token()),
        }
    }

    /// The key digest to log about a loss, if the provider records digests.
    pub(crate) fn key_digest(&self) -> Option<&str> {
        match self {
            Handle::One(handle) => handle.key_digest(),
            Handle::Many(handle) => handle.members().first().and_then(|m| m.key_digest()),
        }
    }

    /// Releases the hold (every member of a multi-key hold) and waits for the backend. On a
    /// lost hold it ends at once for one key, and for several once the members still held at
    /// the loss have been released.
    pub(crate) fn release(self) -> Pin<Box<dyn Future<Output = Result<(), LockError>> + Send>> {
        match self {
            Handle::One(handle) => Box::pin(handle.release()),
            Handle::Many(handle) => Box::pin(handle.release()),
        }
    }
}
