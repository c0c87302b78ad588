//! `DistributedLock::shutdown` and `Locking::shutdown`, on paused tokio time: new acquires are
//! refused, waits end, every lock still held is given up (released at the backend, so nothing
//! outlives the process), attempts whose callers left finish first, and a release that hangs
//! makes the shutdown report what was left rather than wait forever.

use crate::support;
use crate::support::watched::{watched, Watch};

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockingkit::testing::Intercept;
use lockingkit::{DistributedLock, ErrorKind, MemoryBackend, MemoryStore};
use support::queue::queued_waiter;
use tokio::time::Instant;

/// What the backends of [`Counting::backend`] saw: the releases sent, whether releases hang,
/// and whether the backend was shut down.
#[derive(Clone, Default)]
struct Counting {
    releases: Arc<AtomicUsize>,
    hang_releases: Arc<AtomicBool>,
    closed: Arc<AtomicBool>,
}

impl Watch for Counting {
    /// An in-memory backend that counts releases and can make them hang, and notes its own
    /// shutdown.
    fn backend(&self, store: &MemoryStore) -> Intercept<MemoryBackend> {
        let (seen, closed) = (self.clone(), self.closed.clone());
        Intercept::new(MemoryBackend::new(store.clone()))
            .on_release(move |release| {
                let seen = seen.clone();
                Box::pin(async move {
                    if seen.hang_releases.load(Ordering::SeqCst) {
                        std::future::pending::<()>().await;
                    }
                    seen.releases.fetch_add(1, Ordering::SeqCst);
                    release.await
                })
            })
            .on_shutdown(move || closed.store(true, Ordering::SeqCst))
    }
}

#[tokio::test(start_paused = true)]
async fn shutdown_gives_up_every_lock_ends_waits_and_refuses_new_acquires() {
    let (store, counting, locks) = watched(Counting::default());
    // One hold whose keeper has started (held past its first renewal), one whose has not.
    let long = locks.try_acquire("jobs/long").await.unwrap();
    tokio::time::sleep(Duration::from_secs(11)).await;
    let short = locks.try_acquire("jobs/short").await.unwrap();
    let waiter = queued_waiter(&locks, "jobs/short", Duration::from_secs(60)).await;
    let lost = (long.lost_token(), short.lost_token());

    let started = Instant::now();
    locks
        .shutdown(Duration::from_secs(5))
        .await
        .expect("shut down");
    assert!(
        started.elapsed() <= Duration::from_millis(10),
        "the releases answer at once: {:?}",
        started.elapsed()
    );
    assert!(
        lost.0.is_cancelled() && lost.1.is_cancelled(),
        "work tied to the locks stops"
    );
    assert!(!long.is_held() && !short.is_held());
    assert_eq!(
        counting.releases.load(Ordering::SeqCst),
        2,
        "both released at the backend"
    );
    assert!(
        counting.closed.load(Ordering::SeqCst),
        "the backend closed last"
    );
    assert_eq!(locks.local_callers(), 0);
    let ended = waiter.await.unwrap().unwrap_err();
    assert_eq!(ended.kind(), ErrorKind::Unavailable, "{ended}");
    let refused = locks.try_acquire("jobs/new").await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unavailable);
    assert!(refused.to_string().contains("shut down"), "{refused}");
    // The handles were given up; releasing them again says so and sends nothing.
    assert_eq!(long.release().await.unwrap_err().kind(), ErrorKind::Lost);
    drop(short);
    tokio::task::yield_now().await;
    assert_eq!(counting.releases.load(Ordering::SeqCst), 2);
    // Other processes may take the keys at once, not after a lease.
    let other = DistributedLock::in_memory_shared(&store);
    other.try_acquire("jobs/long").await.expect("free at once");
}

#[tokio::test(start_paused = true)]
async fn a_release_that_hangs_is_reported_when_the_shutdown_times_out() {
    let (_store, counting, locks) = watched(Counting::default());
    let held = locks.try_acquire("k").await.unwrap();
    counting.hang_releases.store(true, Ordering::SeqCst);
    let started = Instant::now();
    let error = locks.shutdown(Duration::from_secs(2)).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable);
    assert!(error.to_string().contains("outstanding"), "{error}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_millis(2100),
        "{waited:?}"
    );
    assert!(!held.is_held());
}

#[tokio::test(start_paused = true)]
async fn a_dropped_handle_is_released_before_the_shutdown_returns() {
    // The handle dropped just before the process exits: its background release must finish
    // before shutdown returns, or the lease outlives the process.
    let (store, counting, locks) = watched(Counting::default());
    drop(locks.try_acquire("k").await.unwrap());
    locks.shutdown(Duration::from_secs(1)).await.unwrap();
    assert_eq!(counting.releases.load(Ordering::SeqCst), 1);
    assert!(!store.is_locked("k"), "nothing left at the backend");
}

#[tokio::test(start_paused = true)]
async fn a_registry_shuts_down_every_provider() {
    let locking = lockingkit::Locking::builder()
        .backend(
            "Default",
            MemoryBackend::new(MemoryStore::new()),
            lockingkit::LockOptions::default(),
        )
        .backend(
            "Jobs",
            MemoryBackend::new(MemoryStore::new()),
            lockingkit::LockOptions::default(),
        )
        .build()
        .unwrap();
    let jobs = locking.require("Jobs").unwrap().clone();
    let held = (
        locking.default_lock().try_acquire("k").await.unwrap(),
        jobs.try_acquire("k").await.unwrap(),
    );
    locking.shutdown(Duration::from_secs(1)).await.unwrap();
    assert!(!held.0.is_held() && !held.1.is_held());
    assert_eq!(
        jobs.try_acquire("k").await.unwrap_err().kind(),
        ErrorKind::Unavailable
    );
}
