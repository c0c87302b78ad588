//! Checks that many suites make, written once.

use lockingkit::{DistributedLock, ErrorKind, LockError, LockHandle};
use tokio::task::JoinHandle;

use crate::chaos::PATIENCE;

/// Asserts that `handle`, taken after `what`, carries a fencing token above `before` (a token
/// handed out before it), and releases it.
pub async fn assert_token_grew(handle: LockHandle, before: u64, what: &str) {
    assert!(
        handle.fencing_token() > before,
        "token {} after {before}: {what} handed out an old token",
        handle.fencing_token()
    );
    handle.release().await.expect("release");
}

/// Waits for a waiting task's lock (`what`: when it should come) and releases it; a wait that
/// has not ended within [`PATIENCE`] is taken for a hang.
pub async fn release_once_won(waiter: JoinHandle<Result<LockHandle, LockError>>, what: &str) {
    let handle = tokio::time::timeout(PATIENCE, waiter)
        .await
        .unwrap_or_else(|_| panic!("the waiter never won: {what}"))
        .expect("the waiter's task")
        .unwrap_or_else(|error| panic!("the waiter failed ({what}): {error}"));
    handle.release().await.expect("release");
}

/// Asserts that a semaphore of `permits` on `key` is full for `locks`: a try is told busy.
pub async fn assert_semaphore_full(locks: &DistributedLock, key: &str, permits: u32) {
    let busy = locks
        .semaphore(key, permits)
        .expect("a valid semaphore")
        .try_acquire()
        .await
        .expect_err("the semaphore is full");
    assert_eq!(busy.kind(), ErrorKind::Busy, "{busy}");
}

/// Asserts that `text` contains each of `parts`.
pub fn assert_mentions(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "`{part}` is missing from: {text}");
    }
}
