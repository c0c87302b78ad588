//! How a layer holds each request's key — alone, together with other readers, or as one slot of
//! a semaphore — checked against the provider when the layer is built.

use std::time::Duration;

use lockingkit::{DistributedLock, LockError, LockHandle, LockMode, MultiLockHandle};

/// The mode a [`LockLayer`](crate::LockLayer) takes each request's key in, known to be one its
/// provider can hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RequestMode(LockMode);

impl RequestMode {
    /// The key's plain lock: the only holder (the default; also a reader-writer lock's writer).
    pub(crate) const EXCLUSIVE: RequestMode = RequestMode(LockMode::Exclusive);

    /// `mode`, if `locks` can hold it; `Misconfigured` (why not) otherwise, when the layer is
    /// built rather than on every request. Asking sends nothing.
    pub(crate) fn checked(locks: &DistributedLock, mode: LockMode) -> Result<Self, LockError> {
        locks.ensure_supports(mode)?;
        Ok(RequestMode(mode))
    }

    /// The mode this hold takes keys in.
    pub(crate) fn mode(self) -> LockMode {
        self.0
    }

    /// Takes `key` in this mode: one attempt, or waiting up to `wait`.
    pub(crate) async fn take(
        self,
        locks: &DistributedLock,
        key: &str,
        wait: Option<Duration>,
    ) -> Result<LockHandle, LockError> {
        match wait {
            None => locks.try_acquire_in(key, self.0).await,
            Some(timeout) => locks.acquire_in(key, self.0, timeout).await,
        }
    }

    /// Takes every one of `keys` in this mode, as one hold: one attempt, or waiting up to
    /// `wait` (one timeout for all of them).
    pub(crate) async fn take_all(
        self,
        locks: &DistributedLock,
        keys: &[String],
        wait: Option<Duration>,
    ) -> Result<MultiLockHandle, LockError> {
        match wait {
            None => locks.try_acquire_all_in(keys, self.0).await,
            Some(timeout) => locks.acquire_all_in(keys, self.0, timeout).await,
        }
    }
}

/// Whether holds in modes `a` and `b` of one key name the same thing: locks (exclusive or
/// shared) and semaphores live in separate namespaces.
pub(crate) fn same_namespace(a: LockMode, b: LockMode) -> bool {
    let is_semaphore = |mode| matches!(mode, LockMode::Semaphore { .. });
    is_semaphore(a) == is_semaphore(b)
}
