//! Contract cases for multi-key holds (`DistributedLock::acquire_all`), on any backend.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::cases::{
    expect_kind, next_process_gets_it_at_once, processes, release_settles_within, required,
    until_idle,
};
use super::{
    abandon_after_polls, quick_polling, unique_prefix, ContractBackend, HeldInterval,
    IntervalChecker,
};
use crate::{DistributedLock, ErrorKind, MultiLockHandle};

fn record(checker: &IntervalChecker, process: usize, hold: &MultiLockHandle, start: Instant) {
    let end = Instant::now();
    for member in hold.members() {
        checker.record(HeldInterval {
            key: member.key().to_owned(),
            process,
            fencing_token: member.fencing_token(),
            start,
            end,
        });
    }
}

/// Two processes, two callers each, repeatedly take `{a, b}` and `{b, a}`: every call takes
/// both keys within its timeout (no deadlock), and no two holds of a key overlap.
pub async fn multi_key_holds_in_opposite_orders_never_deadlock<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let prefix = unique_prefix("multi-order");
    let (a, b) = (format!("{prefix}/a"), format!("{prefix}/b"));
    let checker = Arc::new(IntervalChecker::new());
    let mut callers = Vec::new();
    for caller in 0..4usize {
        let lock: DistributedLock = procs[caller % 2].clone();
        let keys = if caller < 2 {
            [a.clone(), b.clone()]
        } else {
            [b.clone(), a.clone()]
        };
        let checker = checker.clone();
        callers.push(tokio::spawn(async move {
            for _ in 0..10 {
                let hold = required(
                    lock.acquire_all(&keys, Duration::from_secs(30)).await,
                    "acquire_all in either order",
                );
                let start = Instant::now();
                tokio::time::sleep(Duration::from_millis(2)).await;
                required(hold.ensure_held(), "held while working");
                record(&checker, caller % 2, &hold, start);
                required(hold.release().await, "release both");
            }
        }));
    }
    for caller in callers {
        let finished = tokio::time::timeout(Duration::from_secs(120), caller).await;
        assert!(
            matches!(finished, Ok(Ok(()))),
            "contract broken: a caller of acquire_all never finished (deadlock?) or failed"
        );
    }
    assert_eq!(checker.holds().len(), 80, "every hold recorded both keys");
    checker.assert_consistent();
}

/// A multi-key hold is all or nothing: when one key is busy, the keys taken before it are
/// released before the error returns, for try and for a wait that times out; duplicates are
/// folded; bad lists are refused before anything is sent.
pub async fn multi_key_holds_are_all_or_nothing<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let prefix = unique_prefix("multi-all");
    let (a, b) = (format!("{prefix}/a"), format!("{prefix}/b"));
    // `b` sorts after `a`, so `a` is taken first and must be given back.
    let blocker = required(procs[1].try_acquire(&b).await, "take b elsewhere");
    expect_kind(
        procs[0].try_acquire_all(&[&b, &a]).await,
        ErrorKind::Busy,
        "try_acquire_all with one key busy",
    );
    let a_free = required(
        procs[1].try_acquire(&a).await,
        "a is free at once after a busy try",
    );
    required(a_free.release().await, "release a");
    expect_kind(
        procs[0]
            .acquire_all(&[&a, &b], Duration::from_millis(300))
            .await,
        ErrorKind::Timeout,
        "acquire_all with one key busy throughout",
    );
    let a_free = required(
        procs[1].try_acquire(&a).await,
        "a is free at once after a timeout",
    );
    required(a_free.release().await, "release a");
    required(blocker.release().await, "release b");

    // Waiting, not trying: a provider may keep watching `b` for a moment after the wait that
    // timed out (PostgreSQL's watcher session, queued for the key for up to half a second).
    let folded = required(
        procs[0]
            .acquire_all(&[&a, &b, &a], Duration::from_secs(5))
            .await,
        "duplicates fold",
    );
    assert_eq!(folded.members().len(), 2, "one member per distinct key");
    assert_eq!(
        folded.keys().collect::<Vec<_>>(),
        vec![a.as_str(), b.as_str()]
    );
    assert!(folded.fencing_token(&a).is_some() && folded.fencing_token(&b).is_some());
    expect_kind(
        procs[1].try_acquire(&a).await,
        ErrorKind::Busy,
        "a member is held",
    );
    required(folded.release().await, "release the hold");
    let taken = required(
        procs[1].try_acquire_all(&[&a, &b]).await,
        "free after release",
    );
    required(taken.release().await, "release");

    let none: [&str; 0] = [];
    expect_kind(
        procs[0].try_acquire_all(&none).await,
        ErrorKind::InvalidKey,
        "no keys",
    );
    expect_kind(
        procs[0].try_acquire_all(&[a.as_str(), ""]).await,
        ErrorKind::InvalidKey,
        "a bad key",
    );
    assert_eq!(procs[0].local_callers(), 0, "a refused list takes nothing");
}

/// Dropping an `acquire_all` future at any point — during the first key's attempt, between
/// keys, while waiting for a busy key — never leaks a key.
pub async fn multi_key_cancellation_leaks_nothing<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let prefix = unique_prefix("multi-cancel");
    let keys = [
        format!("{prefix}/a"),
        format!("{prefix}/b"),
        format!("{prefix}/c"),
    ];
    // One whole hold first, so the process has its connections before the abandoned
    // attempts' clean-up is timed: opening a connection is not giving a key back.
    let warm = required(procs[0].try_acquire_all(&keys).await, "the keys, once");
    required(warm.release().await, "release");
    for polls in 1..=16 {
        drop(abandon_after_polls(procs[0].try_acquire_all(&keys), polls).await);
        until_idle(
            &procs[0],
            release_settles_within(backend),
            "an abandoned acquire_all gives every key back",
        )
        .await;
        let next = required(
            procs[1].try_acquire_all(&keys).await,
            "another process takes them all at once",
        );
        required(next.release().await, "release");
    }
    // Waiting for the last key, held elsewhere, when the caller goes away.
    let blocker = required(procs[1].try_acquire(&keys[2]).await, "take c elsewhere");
    let waited = tokio::time::timeout(
        Duration::from_millis(200),
        procs[0].acquire_all(&keys, Duration::from_secs(30)),
    )
    .await;
    assert!(waited.is_err(), "the wait should still be waiting");
    required(blocker.release().await, "release c");
    let next = next_process_gets_it_at_once(
        backend,
        &procs[0],
        &procs[1],
        &keys[0],
        "a key taken before a dropped wait is released",
    )
    .await;
    required(next.release().await, "release");
    // Dropped as soon as it was won. Taken with a wait: the last key's dropped wait above may
    // still have a request at the backend for a moment (a PostgreSQL waiting session granted
    // the key just as the blocker left, giving it back at once), which is not what this step
    // checks; the hand-over after the dropped wait is checked above.
    drop(required(
        procs[0].acquire_all(&keys, Duration::from_secs(10)).await,
        "take all",
    ));
    until_idle(
        &procs[0],
        release_settles_within(backend),
        "a dropped hold gives every key back",
    )
    .await;
    let next = required(
        procs[1].try_acquire_all(&keys).await,
        "taken at once after a drop",
    );
    required(next.release().await, "release");
}
