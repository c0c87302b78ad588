//! Multi-key holds on paused tokio time through the public API: a lost member is the loss of
//! the whole hold, a fault between the first and the second key leaves nothing held, one
//! timeout covers every key. The cross-provider cases are in the contract kit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockingkit::backend::BackendError;
use lockingkit::testing::Intercept;
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
    assert_eq!(locks.local_callers(), 0);
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
async fn the_hold_its_view_and_every_member_tell_the_mode_and_debug_hides_the_keys() {
    let locks = locks(&MemoryStore::new());
    let hold = locks
        .try_acquire_all_in(
            &["accounts/secret-2", "accounts/secret-1"],
            LockMode::Shared,
        )
        .await
        .expect("both free");
    let view = hold.view();
    assert_eq!(hold.mode(), LockMode::Shared);
    assert_eq!(view.mode(), LockMode::Shared);
    assert!(view.members().iter().all(|m| m.mode() == LockMode::Shared));
    for shown in [format!("{hold:?}"), format!("{view:?}")] {
        assert!(shown.contains("Shared"), "{shown}");
        assert!(
            !shown.contains("secret"),
            "Debug must not show the keys: {shown}"
        );
    }
    hold.release().await.expect("released");
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
    assert_eq!(mine.local_callers(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_fault_between_the_first_and_the_second_key_leaves_nothing_held() {
    let store = MemoryStore::new();
    let attempts = Arc::new(AtomicUsize::new(0));
    let counted = attempts.clone();
    // The second attempt fails as an unreachable backend.
    let backend = Intercept::new(MemoryBackend::with_lease(store.clone(), LEASE)).on_try_acquire(
        move |attempt| {
            if counted.fetch_add(1, Ordering::SeqCst) + 1 == 2 {
                return Box::pin(async { Err(BackendError::unreachable("connection reset")) });
            }
            attempt
        },
    );
    let locks = DistributedLock::builder(backend)
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
    assert_eq!(locks.local_callers(), 0);
}

#[tokio::test(start_paused = true)]
async fn releasing_a_lost_hold_returns_only_after_the_other_members_are_released() {
    let store = MemoryStore::new();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let opened = gate.clone();
    // Releases wait for the test to open `gate`.
    let backend = Intercept::new(MemoryBackend::with_lease(store.clone(), LEASE)).on_release(
        move |release| {
            let gate = opened.clone();
            Box::pin(async move {
                let _open = gate.acquire().await;
                release.await
            })
        },
    );
    let locks = DistributedLock::builder(backend)
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
