//! `RequestLocks`: what the handler sees of the keys held together for its request.

use std::fmt;

use lockingkit::{LockMode, MultiLockHandle, MultiLockView};

/// The keys a multi-key [`LockLayer`](crate::LockLayer) (made by
/// [`LockLayer::all`](crate::LockLayer::all)) holds together for the current request.
///
/// Found with `request.extensions().get::<RequestLocks>()`. It is the hold's
/// [`MultiLockView`] (through `Deref`: each member's key and fencing token, whether every key
/// is still held, [`run`](MultiLockView::run)) plus the [mode](Self::mode) every key is held
/// in. Its [`lost_token`](MultiLockView::lost_token) fires when any key is lost and when the
/// layer releases the hold after the response.
#[derive(Clone)]
pub struct RequestLocks {
    view: MultiLockView,
    mode: LockMode,
}

impl RequestLocks {
    pub(crate) fn new(handle: &MultiLockHandle, mode: LockMode) -> Self {
        RequestLocks {
            view: handle.view(),
            mode,
        }
    }

    /// How the layer holds every key ([`LockMode::Exclusive`] by default).
    pub fn mode(&self) -> LockMode {
        self.mode
    }
}

impl std::ops::Deref for RequestLocks {
    type Target = MultiLockView;

    fn deref(&self) -> &MultiLockView {
        &self.view
    }
}

impl fmt::Debug for RequestLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The keys are left out on purpose: keys routinely carry customer ids.
        f.debug_struct("RequestLocks")
            .field("mode", &self.mode)
            .field("lock", &self.view)
            .finish_non_exhaustive()
    }
}
