//! One pair — a free key taken and released — the unit most rows time, through the engine or
//! through a backend alone.

use lockingkit::backend::LockBackend;
use lockingkit::{DistributedLock, LockMode};

/// A `DistributedLock` on `backend` with default lock options.
pub fn lock_on<B: LockBackend>(backend: B) -> DistributedLock {
    DistributedLock::builder(backend).build().expect("lock")
}

/// One `try_acquire` + `release` of the free `key` through `locks`.
pub async fn lock_pair(locks: &DistributedLock, key: &str) {
    locks
        .try_acquire(key)
        .await
        .expect("lockingkit acquire")
        .release()
        .await
        .expect("lockingkit release");
}

/// One exclusive `try_acquire` + `release` of the free `key` on `backend` alone, without the
/// engine: what the provider costs, next to what the engine adds.
pub async fn backend_pair<B: LockBackend>(backend: &B, key: &str) {
    let acquired = backend
        .try_acquire(key, LockMode::Exclusive)
        .await
        .expect("backend acquire")
        .expect("the backend's lock was busy");
    backend
        .release(&acquired.lease)
        .await
        .expect("backend release");
}
