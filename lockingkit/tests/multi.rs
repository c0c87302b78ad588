//! Multi-key holds on paused tokio time through the public API: a lost member is the loss of
//! the whole hold, a fault between the first and the second key leaves nothing held, one
//! timeout covers every key. The cross-provider cases are in the contract kit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockingkit::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use lockingkit::{DistributedLock, ErrorKind, LockMode, MemoryBackend, MemoryStore};

const LEASE: Duration = Duration::from_secs(30);

fn locks(store: &MemoryStore) -> DistributedLock {
    DistributedLock::builder(MemoryBackend::with_lease(store.clone(), LEASE))
        .build()
        .expect("valid options")
}

#[tokio::test(start_paused = true)]
async fn a_lost_member_fires_the_whole_hold_and_gives_up_the_others() {
    let store = MemoryStore::new();
    let locks = locks(&store);
    let hold = locks
        .acquire_all(&["accounts/2", "accounts/1"], Duration::from_secs(1))
        .await
        .expect("both free");
    let lost = hold.lost_token();
    let work = hold.run(std::future::pending::<()>());
    assert!(store.break_lease("accounts/2"));
    let ran = tokio::time::timeout(LEASE, work)
        .await
        .expect("dropped on loss");
    assert_eq!(ran.expect_err("lost").kind(), ErrorKind::Lost);
    assert!(lost.is_cancelled());
    assert!(!hold.is_held());
    assert_eq!(
        hold.ensure_held().expect_err("lost").kind(),
        ErrorKind::Lost
    );
    // The member still held is released at once, not kept until the handle goes.
    tokio::time::timeout(Duration::from_secs(1), async {
        while store.is_locked("accounts/1") {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the other member was given up");
    assert_eq!(
        hold.release().await.expect_err("lost").kind(),
        ErrorKind::Lost
    );
    assert_eq!(locks.active_parties(), 0);
}

#[tokio::test(start_paused = true)]
async fn releasing_fires_the_hold_token_and_frees_every_key_before_it_returns() {
    let store = MemoryStore::new();
    let locks = locks(&store);
    let hold = locks
        .try_acquire_all(&["b", "a", "c"])
        .await
        .expect("all free");
    let tokens: Vec<u64> = hold.members().iter().map(|m| m.fencing_token()).collect();
    assert_eq!(hold.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(tokens.len(), 3);
    let lost = hold.lost_token();
    hold.release().await.expect("confirmed");
    assert!(lost.is_cancelled());
    for key in ["a", "b", "c"] {
        assert!(!store.is_locked(key), "{key} still locked");
    }
}

#[tokio::test(start_paused = true)]
async fn one_timeout_covers_every_key() {
    let store = MemoryStore::new();
    let (mine, other) = (locks(&store), locks(&store));
    let _a = other.try_acquire("a").await.expect("free");
    let _c = other.try_acquire("c").await.expect("free");
    let started = tokio::time::Instant::now();
    let waited = mine
        .acquire_all(&["c", "b", "a"], Duration::from_secs(2))
        .await;
    assert_eq!(waited.expect_err("busy").kind(), ErrorKind::Timeout);
    // `a` is first in order: the whole wait is spent there, and `c` is never waited for.
    let elapsed = started.elapsed();
    assert!(
        elapsed <= Duration::from_secs(2) + Duration::from_millis(1),
        "{elapsed:?}"
    );
    assert!(!store.is_locked("b"));
    assert_eq!(mine.active_parties(), 0);
}

/// The in-memory backend, with its `fail_at`-th attempt failing as an unreachable backend.
struct FaultAt {
    inner: MemoryBackend,
    attempts: Arc<AtomicUsize>,
    fail_at: usize,
}

impl LockBackend for FaultAt {
    type Lease = <MemoryBackend as LockBackend>::Lease;
    fn provider(&self) -> &str {
        self.inner.provider()
    }
    fn timing(&self) -> LeaseTiming {
        self.inner.timing()
    }
    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<Self::Lease>>, BackendError> {
        if self.attempts.fetch_add(1, Ordering::SeqCst) + 1 == self.fail_at {
            return Err(BackendError::unreachable("connection reset"));
        }
        self.inner.try_acquire(key, mode).await
    }
    async fn renew(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.inner.renew(lease).await
    }
    async fn release(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.inner.release(lease).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_fault_between_the_first_and_the_second_key_leaves_nothing_held() {
    let store = MemoryStore::new();
    let attempts = Arc::new(AtomicUsize::new(0));
    let locks = DistributedLock::builder(FaultAt {
        inner: MemoryBackend::with_lease(store.clone(), LEASE),
        attempts: attempts.clone(),
        fail_at: 2,
    })
    .build()
    .expect("valid options");
    let failed = locks.try_acquire_all(&["accounts/9", "accounts/10"]).await;
    assert_eq!(failed.expect_err("fault").kind(), ErrorKind::Unavailable);
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        2,
        "the first key was taken"
    );
    assert!(!store.is_locked("accounts/9") && !store.is_locked("accounts/10"));
    assert_eq!(locks.active_parties(), 0);
}

/// The in-memory backend, whose releases wait for the test to open `gate`.
struct GatedRelease {
    inner: MemoryBackend,
    gate: Arc<tokio::sync::Semaphore>,
}

impl LockBackend for GatedRelease {
    type Lease = <MemoryBackend as LockBackend>::Lease;
    fn provider(&self) -> &str {
        self.inner.provider()
    }
    fn timing(&self) -> LeaseTiming {
        self.inner.timing()
    }
    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<Self::Lease>>, BackendError> {
        self.inner.try_acquire(key, mode).await
    }
    async fn renew(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.inner.renew(lease).await
    }
    async fn release(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        let _open = self.gate.acquire().await;
        self.inner.release(lease).await
    }
}

#[tokio::test(start_paused = true)]
async fn releasing_a_lost_hold_returns_only_after_the_other_members_are_released() {
    let store = MemoryStore::new();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let locks = DistributedLock::builder(GatedRelease {
        inner: MemoryBackend::with_lease(store.clone(), LEASE),
        gate: gate.clone(),
    })
    .build()
    .expect("valid options");
    let hold = locks
        .try_acquire_all(&["accounts/1", "accounts/2"])
        .await
        .expect("both free");
    let lost = hold.lost_token();
    assert!(store.break_lease("accounts/2"));
    lost.cancelled().await;
    let release = tokio::spawn(hold.release());
    // On paused time this sleep returns only once every task is idle: whatever the release
    // could do without the backend's answer to `accounts/1`'s release, it has done.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !release.is_finished(),
        "answered before accounts/1 was given back"
    );
    assert!(store.is_locked("accounts/1"));
    gate.add_permits(8);
    let released = release.await.expect("release task");
    assert_eq!(released.expect_err("lost").kind(), ErrorKind::Lost);
    assert!(
        !store.is_locked("accounts/1"),
        "the loss is answered after accounts/1 is free"
    );
}
