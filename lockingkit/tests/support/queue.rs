//! A caller queued for a key, for tests that act while someone waits.

use std::time::Duration;

use lockingkit::{DistributedLock, LockError, LockHandle};
use tokio::task::JoinHandle;

/// Starts a task that acquires `key` on `locks`, waiting up to `timeout`, and returns once that
/// caller waits for the key (`locks.waiting(key)` counts it).
pub async fn queued_waiter(
    locks: &DistributedLock,
    key: &str,
    timeout: Duration,
) -> JoinHandle<Result<LockHandle, LockError>> {
    let waiter = tokio::spawn({
        let (locks, key) = (locks.clone(), key.to_owned());
        async move { locks.acquire(&key, timeout).await }
    });
    while locks.waiting(key) == 0 {
        tokio::task::yield_now().await;
    }
    waiter
}
