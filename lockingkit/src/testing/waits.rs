//! The contract cases about how a wait ends: whatever a backend kept for a wait (a place in a
//! queue, a request queued at the server, a lock granted to the wait) goes with it, so that a
//! key nobody holds is free for the very next try, in every mode, in the waiter's process and
//! in others.

use std::time::Duration;

use super::cases::{expect_kind, processes, release_settles_within, required, until_idle};
use super::{quick_polling, unique_prefix, ContractBackend};
use crate::{DistributedLock, ErrorKind, LockMode};

/// How long a waiter is left waiting before its wait is ended: long enough for a backend to
/// have queued it at the server (a request in the server's lock queue, a place in line). The
/// cases hold whether or not it has; they only exercise more of the backend when it has.
const QUEUED_FOR: Duration = Duration::from_millis(300);

/// How a wait ends in [`wait_ends_then_the_key_is_free`].
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// The caller drops its `acquire` future while it waits.
    Dropped,
    /// The wait runs out of time.
    TimedOut,
    /// The holder releases, and at that very moment the caller drops its `acquire` future:
    /// the backend may be granting the lock to the wait as it ends.
    DroppedAsGranted,
}

const ENDINGS: [Ending; 3] = [Ending::Dropped, Ending::TimedOut, Ending::DroppedAsGranted];

/// The modes to try once a wait ended: every mode the provider supports (a semaphore of one
/// lives in a namespace of its own, so it is tried only after a semaphore's wait).
fn tries_after(lock: &DistributedLock, waited: LockMode) -> Vec<LockMode> {
    match waited {
        LockMode::Semaphore { .. } => vec![waited],
        _ => [LockMode::Exclusive, LockMode::Shared]
            .into_iter()
            .filter(|mode| lock.supports(*mode))
            .collect(),
    }
}

/// A process holds `key` in `held`; another waits for it in `waited` and the wait ends as
/// `ending` says; the holder releases. Then a try in every mode, first in the waiter's process
/// and then in a third one, finds the key free at once: nothing the ended wait left behind
/// (its place, its queued request, a grant nobody took) refuses anyone.
async fn wait_ends_then_the_key_is_free<B: ContractBackend>(
    backend: &B,
    held: LockMode,
    waited: LockMode,
    ending: Ending,
) {
    let procs = processes(backend, 3, quick_polling()).await;
    let key = unique_prefix("wait-ends");
    let what = format!("a {held} hold, a {waited} wait {ending:?}");
    let holder = required(procs[0].try_acquire_in(&key, held).await, &what);
    let waiter = tokio::spawn({
        let (lock, key) = (procs[1].clone(), key.clone());
        let timeout = match ending {
            Ending::TimedOut => QUEUED_FOR,
            Ending::Dropped | Ending::DroppedAsGranted => Duration::from_secs(30),
        };
        async move { lock.acquire_in(&key, waited, timeout).await }
    });
    tokio::time::sleep(QUEUED_FOR).await;
    match ending {
        Ending::Dropped => {
            waiter.abort();
            let _ = waiter.await;
            required(holder.release().await, &what);
        }
        Ending::TimedOut => {
            let waited = waiter.await.expect("the waiter's task");
            expect_kind(waited, ErrorKind::Timeout, &what);
            required(holder.release().await, &what);
        }
        Ending::DroppedAsGranted => {
            // The release's answer and the abort race the grant; whether the waiter got the
            // lock first (its handle is then dropped, which releases it) or not, the key must
            // be free once the waiter's process is idle.
            required(holder.release().await, &what);
            waiter.abort();
            let _ = waiter.await;
            until_idle(&procs[1], release_settles_within(backend), &what).await;
        }
    }
    for (process, lock) in procs.iter().enumerate().skip(1) {
        for mode in tries_after(lock, waited) {
            let tried = format!("{what}: a {mode} try in process {process} right after");
            let handle = required(lock.try_acquire_in(&key, mode).await, &tried);
            required(handle.release().await, &tried);
        }
    }
}

/// After an exclusive wait is dropped, times out, or is dropped as the lock is granted to it,
/// the key is free for the next try at once, in the waiter's process and in another.
pub async fn a_try_right_after_a_wait_ends_finds_the_key_free<B: ContractBackend>(backend: &B) {
    for ending in ENDINGS {
        wait_ends_then_the_key_is_free(backend, LockMode::Exclusive, LockMode::Exclusive, ending)
            .await;
    }
}

/// The same for readers waiting behind a writer and writers waiting behind a reader: after the
/// wait ends, tries as a writer and as a reader find the key free at once.
pub async fn a_try_right_after_a_reader_or_writer_wait_ends_finds_the_key_free<
    B: ContractBackend,
>(
    backend: &B,
) {
    for ending in ENDINGS {
        wait_ends_then_the_key_is_free(backend, LockMode::Exclusive, LockMode::Shared, ending)
            .await;
        wait_ends_then_the_key_is_free(backend, LockMode::Shared, LockMode::Exclusive, ending)
            .await;
    }
}

/// The same for a semaphore of one: after a wait for its slot ends, the slot is free at once.
pub async fn a_try_right_after_a_semaphore_wait_ends_finds_a_slot_free<B: ContractBackend>(
    backend: &B,
) {
    let semaphore = LockMode::Semaphore { max_count: 1 };
    for ending in ENDINGS {
        wait_ends_then_the_key_is_free(backend, semaphore, semaphore, ending).await;
    }
}

/// Rounds of hand-offs between two processes, each followed at once by tries from a third:
/// a writer holds and a reader elsewhere waits, or a reader holds and a writer waits; the
/// holder releases, the waiter gets the key, and releases too (confirmed). Right then an
/// exclusive and a shared try from a third process must both get in: no session, place or
/// grant of the waiter's process holds the key for nobody.
pub async fn hand_offs_to_readers_and_writers_leave_the_key_free_for_others<B: ContractBackend>(
    backend: &B,
) {
    const ROUNDS: usize = 30;
    let procs = processes(backend, 3, quick_polling()).await;
    let key = unique_prefix("hand-offs");
    let mut refused = Vec::new();
    for round in 0..ROUNDS {
        let (held, waited) = if round % 2 == 0 {
            (LockMode::Exclusive, LockMode::Shared)
        } else {
            (LockMode::Shared, LockMode::Exclusive)
        };
        let what = format!("round {round}: a {waited} waiter behind a {held} holder");
        let holder = required(procs[0].try_acquire_in(&key, held).await, &what);
        let waiter = tokio::spawn({
            let (lock, key) = (procs[1].clone(), key.clone());
            async move { lock.acquire_in(&key, waited, Duration::from_secs(30)).await }
        });
        // Some rounds hand over before the wait has queued at the server, most after.
        tokio::time::sleep(Duration::from_millis(10 * (round % 4) as u64)).await;
        required(holder.release().await, &what);
        let taken = required(waiter.await.expect("the waiter's task"), &what);
        required(taken.release().await, &what);
        for mode in [LockMode::Exclusive, LockMode::Shared] {
            match procs[2].try_acquire_in(&key, mode).await {
                Ok(handle) => required(handle.release().await, &what),
                Err(error) if error.kind() == ErrorKind::Busy => {
                    refused.push(format!("{what}: a {mode} try elsewhere was told busy"))
                }
                Err(error) => panic!("contract broken: {what}: {error}"),
            }
        }
    }
    assert!(
        refused.is_empty(),
        "contract broken: {} of {} tries found the key held by nobody: {refused:#?}",
        refused.len(),
        ROUNDS * 2
    );
}
