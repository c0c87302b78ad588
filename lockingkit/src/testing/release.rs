//! Contract cases about release at the backend, which need the backend itself rather than only
//! a [`DistributedLock`]: they count what reaches it, and they send releases directly.

use std::time::Duration;

use tokio::time::Instant;

use super::cases::{required, settles_within, until_idle};
use super::{abandon_after_polls, quick_polling, unique_prefix, CountingBackend};
use crate::backend::{LeaseTiming, LockBackend};
use crate::{DistributedLock, LockHandle};

fn process<B: LockBackend>(backend: B) -> DistributedLock {
    required(
        DistributedLock::builder(backend)
            .options(quick_polling())
            .build(),
        "contract options are valid",
    )
}

async fn acquire<B: LockBackend>(backend: &B, key: &str, what: &str) -> B::Lease {
    match backend.try_acquire(key, crate::LockMode::Exclusive).await {
        Ok(Some(acquired)) => acquired.lease,
        Ok(None) => panic!("contract broken: {what}: the free key was busy"),
        Err(error) => panic!("contract broken: {what}: {error}"),
    }
}

/// Fails the case unless `key` is busy for `observer`, a process that holds nothing.
async fn busy_for<B: LockBackend>(observer: &B, key: &str, what: &str) {
    match observer.try_acquire(key, crate::LockMode::Exclusive).await {
        Ok(None) => {}
        Ok(Some(acquired)) => {
            let _ = observer.release(&acquired.lease).await;
            panic!("contract broken: {what}: the next holder's lock was freed");
        }
        Err(error) => panic!("contract broken: {what}: {error}"),
    }
}

/// Every lease the engine wins is released at the backend exactly once — after `release`,
/// after a drop, after an attempt whose caller went away, and around a local hand-off — and
/// another process then gets the key at once.
///
/// `new_backend` makes one "process" (its own client or pool) on the shared backend;
/// `lease_period` is as for [`ContractBackend::lease_period`](super::ContractBackend::lease_period).
pub async fn each_lease_is_released_exactly_once<B: LockBackend>(
    new_backend: impl Fn() -> B,
    lease_period: Duration,
) {
    let counted = CountingBackend::new(new_backend());
    let local = process(counted.clone());
    let other = process(new_backend());
    let key = unique_prefix("release-once");
    // A leaked lease of a connection-held backend never frees the key, so there the bound
    // only catches a hang: the count of releases and the other process's try catch a leak.
    let held_by_connection = matches!(counted.timing(), LeaseTiming::ConnectionHeld(_));
    let settle = settles_within(held_by_connection, lease_period);

    let held = required(local.try_acquire(&key).await, "acquire");
    required(held.release().await, "release");

    let held = required(local.try_acquire(&key).await, "acquire");
    drop(held);
    until_idle(&local, settle, "a dropped handle's release").await;

    for round in 0..10u64 {
        let cut = Duration::from_micros(50 + round * 300);
        drop(tokio::time::timeout(cut, local.try_acquire(&key)).await);
        until_idle(&local, settle, "a cancelled attempt's release").await;
    }
    for polls in 1..=10 {
        drop(abandon_after_polls(local.try_acquire(&key), polls).await);
        until_idle(&local, settle, "an attempt abandoned in flight").await;
    }

    // A local waiter takes over from a holder that releases.
    let held = required(local.try_acquire(&key).await, "acquire");
    let waiter = {
        let lock = local.clone();
        let key = key.clone();
        tokio::spawn(async move { lock.acquire(&key, Duration::from_secs(30)).await })
    };
    let give_up = Instant::now() + Duration::from_secs(10);
    while local.waiting(&key) < 1 {
        assert!(Instant::now() < give_up, "the waiter never queued");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    required(held.release().await, "release");
    let next: LockHandle = match waiter.await {
        Ok(result) => required(result, "the local waiter"),
        Err(join) => panic!("waiter task failed: {join}"),
    };
    required(next.release().await, "release");
    until_idle(&local, settle, "the last release").await;

    let releases = counted.releases_per_lease();
    assert!(releases.len() >= 4, "too few leases won: {releases:?}");
    assert!(
        releases.iter().all(|count| *count == 1),
        "contract broken: each lease must be released exactly once, releases per lease: \
         {releases:?}"
    );
    let after = required(
        other.try_acquire(&key).await,
        "another process once every lease was released",
    );
    required(after.release().await, "release");
}

/// A release sent again for a lease already released — repeated at once, or arriving late after
/// the key changed hands — never frees the lock of the holder after it, whether that holder is
/// in the same process (on PostgreSQL, possibly the same session) or in another one.
///
/// The engine sends one release per lease, but a release can still land late (a retry, a
/// request that sat in a queue), so a backend must name the lease it releases.
pub async fn a_repeated_or_late_release_never_frees_the_next_holder<B: LockBackend>(
    new_backend: impl Fn() -> B,
) {
    let first = new_backend();
    let second = new_backend();
    let observer = new_backend();
    let key = unique_prefix("late-release");
    let a = acquire(&first, &key, "first acquire").await;
    if let Err(error) = first.release(&a).await {
        panic!("contract broken: release: {error}");
    }
    // Repeated at once, while the key is free.
    let _ = first.release(&a).await;

    // The next holder is in the same process; the old release arrives again.
    let b = acquire(&first, &key, "the same process again").await;
    let _ = first.release(&a).await;
    busy_for(
        &observer,
        &key,
        "a repeated release after the same process took the key again",
    )
    .await;

    // The next holder is in another process; both old releases arrive late.
    if let Err(error) = first.release(&b).await {
        panic!("contract broken: release: {error}");
    }
    let c = acquire(&second, &key, "another process").await;
    let _ = first.release(&b).await;
    let _ = first.release(&a).await;
    busy_for(
        &observer,
        &key,
        "late releases after another process took the key",
    )
    .await;

    if let Err(error) = second.release(&c).await {
        panic!("contract broken: release of the last holder: {error}");
    }
}
