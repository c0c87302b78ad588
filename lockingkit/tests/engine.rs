//! The engine's timing and queueing rules, driven on paused tokio time through the public API.
//!
//! Timer note: tokio's timer wheel has millisecond resolution, so an instant computed from a
//! send time can fire up to 1 ms after it. Assertions on "exactly" allow that 1 ms and no more.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockingkit::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use lockingkit::providers::memory::{MemoryLease, RenewalFault};
use lockingkit::testing::{Call, Intercept};
use lockingkit::{
    CancellationToken, DistributedLock, ErrorKind, LockMode, LossReason, MemoryBackend, MemoryStore,
};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::support;
use crate::support::watched::{watched, Watch};

use support::queue::queued_waiter;

const TIMER_RESOLUTION: Duration = Duration::from_millis(1);

/// Waits for a lost token to fire, failing the test instead of hanging if it never does (on
/// paused time the limit passes at once when nothing else is pending).
#[track_caller]
fn fired(token: &CancellationToken) -> impl std::future::Future<Output = ()> + '_ {
    let caller = std::panic::Location::caller();
    async move {
        if tokio::time::timeout(Duration::from_secs(600), token.cancelled())
            .await
            .is_err()
        {
            panic!("the lost token never fired (waited at {caller})");
        }
    }
}

fn assert_at(actual: Duration, expected: Duration) {
    assert!(
        actual >= expected && actual <= expected + TIMER_RESOLUTION,
        "expected {expected:?}, got {actual:?}"
    );
}

/// What reaches the backend of [`Recording::backend`], for counting request streams.
#[derive(Clone)]
struct Recording {
    attempts: Arc<Mutex<Vec<Instant>>>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
    released: Arc<Notify>,
    /// Releases sent to the backend, counted when sent.
    releases: Arc<AtomicUsize>,
    /// Releases the backend answered.
    answered: tokio::sync::watch::Sender<usize>,
    /// While set, attempts wait for `gate` before reaching the inner backend.
    gate: Arc<Mutex<Option<Arc<Notify>>>>,
    /// While set, releases wait for `release_gate` before reaching the inner backend.
    release_gate: Arc<Mutex<Option<Arc<Notify>>>>,
}

impl Recording {
    fn new() -> Self {
        Recording {
            attempts: Arc::default(),
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
            released: Arc::new(Notify::new()),
            releases: Arc::default(),
            answered: tokio::sync::watch::channel(0).0,
            gate: Arc::default(),
            release_gate: Arc::default(),
        }
    }

    async fn attempt<T>(&self, attempt: Call<'_, T>) -> Result<T, BackendError> {
        self.attempts.lock().unwrap().push(Instant::now());
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let gate = self.gate.lock().unwrap().clone();
        if let Some(gate) = gate {
            gate.notified().await;
        }
        let result = attempt.await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }

    async fn release(&self, release: Call<'_, ()>) -> Result<(), BackendError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        let gate = self.release_gate.lock().unwrap().clone();
        if let Some(gate) = gate {
            gate.notified().await;
        }
        let result = release.await;
        self.released.notify_one();
        self.answered.send_modify(|n| *n += 1);
        result
    }

    fn releases(&self) -> usize {
        self.releases.load(Ordering::SeqCst)
    }

    /// Waits until the backend has answered `count` releases in all; fails the test if that
    /// takes any (virtual) time.
    async fn until_answered(&self, count: usize) {
        let mut answered = self.answered.subscribe();
        tokio::time::timeout(NO_TIME, answered.wait_for(|n| *n >= count))
            .await
            .unwrap_or_else(|_| panic!("release {count} never reached the backend"))
            .unwrap();
    }

    fn attempt_times(&self) -> Vec<Instant> {
        self.attempts.lock().unwrap().clone()
    }

    fn close_gate(&self) -> Arc<Notify> {
        let gate = Arc::new(Notify::new());
        *self.gate.lock().unwrap() = Some(gate.clone());
        gate
    }

    fn close_release_gate(&self) -> Arc<Notify> {
        let gate = Arc::new(Notify::new());
        *self.release_gate.lock().unwrap() = Some(gate.clone());
        gate
    }
}

impl Watch for Recording {
    /// The in-memory backend on `store`, its attempts and releases recorded here.
    fn backend(&self, store: &MemoryStore) -> Intercept<MemoryBackend> {
        let (attempts, releases) = (self.clone(), self.clone());
        Intercept::new(MemoryBackend::new(store.clone()))
            .on_try_acquire(move |attempt| {
                let recording = attempts.clone();
                Box::pin(async move { recording.attempt(attempt).await })
            })
            .on_release(move |release| {
                let recording = releases.clone();
                Box::pin(async move { recording.release(release).await })
            })
    }
}

/// A backend whose every attempt `answer` answers in place of the in-memory store (whose
/// 30 s leases it reports).
fn answering<F>(answer: impl Fn() -> F + Send + Sync + 'static) -> Intercept<MemoryBackend>
where
    F: std::future::Future<Output = Result<Option<Acquired<MemoryLease>>, BackendError>>
        + Send
        + 'static,
{
    Intercept::new(MemoryBackend::new(MemoryStore::new()))
        .on_try_acquire(move |_attempt| Box::pin(answer()))
}

/// How long a test waits for something the engine does without any time passing: on paused
/// time, a wait that would hang instead fails after this much virtual time.
const NO_TIME: Duration = Duration::from_secs(1);

fn memory_pair() -> (MemoryStore, DistributedLock) {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    (store, locks)
}

// ---------------------------------------------------------------------------------------------
// Renewal and loss

#[tokio::test(start_paused = true)]
async fn lease_is_lost_27s_after_last_renewal_sent_when_renewals_fail() {
    let (store, locks) = memory_pair();
    let start = Instant::now();
    let handle = locks.try_acquire("report").await.unwrap();
    let lost = handle.lost_token();

    // The first renewal, at 10 s, succeeds: the deadline moves to 10 s + 27 s.
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert_eq!(store.renewals(), 1);
    assert!(handle.is_held());
    store.set_renewal_fault(RenewalFault::Fail);

    tokio::time::sleep_until(start + Duration::from_secs(37) - TIMER_RESOLUTION).await;
    assert!(handle.is_held(), "still held just before the deadline");
    assert!(
        store.renewals() > 2,
        "failed renewals are retried until the deadline"
    );

    fired(&lost).await;
    assert_at(start.elapsed(), Duration::from_secs(37));
    assert!(!handle.is_held());
    assert_eq!(handle.loss_reason(), Some(LossReason::Deadline));
    assert_eq!(handle.ensure_held().unwrap_err().kind(), ErrorKind::Lost);
}

#[tokio::test(start_paused = true)]
async fn lease_is_lost_27s_after_last_renewal_sent_when_renewal_hangs() {
    let (store, locks) = memory_pair();
    let start = Instant::now();
    let handle = locks.try_acquire("report").await.unwrap();
    tokio::time::sleep(Duration::from_secs(15)).await;
    store.set_renewal_fault(RenewalFault::Hang);

    fired(&handle.lost_token()).await;
    assert_at(start.elapsed(), Duration::from_secs(37));
    assert_eq!(
        store.renewals(),
        2,
        "the hung renewal at 20 s was the last one sent"
    );
    assert_eq!(handle.loss_reason(), Some(LossReason::Deadline));
}

/// How long a renewal of [`loss_with_slow_renewals`] takes to answer, as a slow network's would.
const RENEWAL_LATENCY: Duration = Duration::from_secs(4);

/// Holds "report" with renewals that take 4 s to answer: the renewal sent at 10 s succeeds at
/// 14 s, then `fault` applies to the one sent at 20 s and every retry. Returns when the lock
/// was lost, counted from the acquire's send.
async fn loss_with_slow_renewals(fault: RenewalFault) -> Duration {
    let store = MemoryStore::new();
    let slow = Intercept::new(MemoryBackend::new(store.clone())).on_renew(|renewal| {
        Box::pin(async move {
            tokio::time::sleep(RENEWAL_LATENCY).await;
            renewal.await
        })
    });
    let locks = DistributedLock::builder(slow).build().unwrap();
    let start = Instant::now();
    let handle = locks.try_acquire("report").await.unwrap();
    let lost = handle.lost_token();
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert_eq!(
        store.renewals(),
        1,
        "the renewal sent at 10 s answered at 14 s"
    );
    assert!(handle.is_held());
    store.set_renewal_fault(fault);

    // The deadline is 27 s after the good renewal was sent (10 s), not after it answered (14 s).
    tokio::time::sleep_until(start + Duration::from_secs(37) - TIMER_RESOLUTION).await;
    assert!(handle.is_held(), "still held just before the deadline");
    fired(&lost).await;
    let lost_at = start.elapsed();
    assert!(!handle.is_held());
    assert_eq!(handle.loss_reason(), Some(LossReason::Deadline));
    assert_eq!(handle.ensure_held().unwrap_err().kind(), ErrorKind::Lost);
    lost_at
}

#[tokio::test(start_paused = true)]
async fn lease_is_lost_27s_after_last_renewal_sent_when_slow_renewals_then_fail() {
    let lost_at = loss_with_slow_renewals(RenewalFault::Fail).await;
    assert_at(lost_at, Duration::from_secs(37));
}

#[tokio::test(start_paused = true)]
async fn lease_is_lost_27s_after_last_renewal_sent_when_slow_renewals_then_hang() {
    let lost_at = loss_with_slow_renewals(RenewalFault::Hang).await;
    assert_at(lost_at, Duration::from_secs(37));
}

/// A holder whose runtime is starved past the loss deadline: its keeper task never got to run,
/// yet the handle says the lock is lost the moment the holder's own code runs again. Real time
/// on a current-thread runtime, blocked the way a CPU-bound step or a paused process blocks it.
#[tokio::test]
async fn a_stalled_holder_sees_its_lock_lost_before_the_keeper_runs() {
    let lease = Duration::from_millis(200);
    let locks = DistributedLock::builder(MemoryBackend::with_lease(MemoryStore::new(), lease))
        .build()
        .unwrap();
    let handle = locks.try_acquire("report").await.unwrap();
    let lost = handle.lost_token();
    // Past the deadline (180 ms after the acquire was sent) without yielding once.
    std::thread::sleep(lease);
    assert!(
        !lost.is_cancelled(),
        "the keeper cannot have run on the blocked runtime"
    );
    assert!(!handle.is_held(), "is_held checks the deadline itself");
    assert_eq!(handle.ensure_held().unwrap_err().kind(), ErrorKind::Lost);
    assert_eq!(handle.loss_reason(), Some(LossReason::Deadline));
    tokio::time::timeout(Duration::from_secs(5), lost.cancelled())
        .await
        .expect("the keeper declares the loss once it runs");
}

#[tokio::test(start_paused = true)]
async fn first_deadline_counts_from_when_the_acquire_was_sent() {
    let (store, locks) = memory_pair();
    store.set_renewal_fault(RenewalFault::Hang);
    let start = Instant::now();
    let handle = locks.try_acquire("report").await.unwrap();
    fired(&handle.lost_token()).await;
    assert_at(start.elapsed(), Duration::from_secs(27));
}

#[tokio::test(start_paused = true)]
async fn a_lease_gone_answer_is_loss_at_once() {
    let (store, locks) = memory_pair();
    let start = Instant::now();
    let handle = locks.try_acquire("report").await.unwrap();
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(
        handle.loss_reason(),
        None,
        "renewed in time: nothing lost yet"
    );
    assert!(store.break_lease("report"));

    fired(&handle.lost_token()).await;
    // The next renewal, at 20 s, is told the lease is gone: no waiting for the deadline.
    assert_at(start.elapsed(), Duration::from_secs(20));
    assert_eq!(handle.loss_reason(), Some(LossReason::LeaseGone));
    let err = handle.release().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Lost);
}

#[tokio::test(start_paused = true)]
async fn a_lost_token_asked_for_only_after_the_loss_is_already_cancelled() {
    let (store, locks) = memory_pair();
    let handle = locks.try_acquire("report").await.unwrap();
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert!(store.break_lease("report"));
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(!handle.is_held());
    let lost = handle.lost_token();
    assert!(
        lost.is_cancelled(),
        "a token made after the loss starts cancelled"
    );
    assert_eq!(handle.loss_reason(), Some(LossReason::LeaseGone));
}

#[tokio::test(start_paused = true)]
async fn renewal_keeps_the_lock_over_many_lease_periods() {
    let (store, locks) = memory_pair();
    let handle = locks.try_acquire("report").await.unwrap();
    // Four lease periods, stopping between renewals (the one at 120 s has been sent at 125 s).
    tokio::time::sleep(Duration::from_secs(125)).await;
    assert!(handle.is_held());
    assert!(store.is_locked("report"));
    assert_eq!(store.renewals(), 12, "one renewal every 10 s for 125 s");
    let other = DistributedLock::in_memory_shared(&store);
    assert_eq!(
        other.try_acquire("report").await.unwrap_err().kind(),
        ErrorKind::Busy
    );
    handle.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn run_drops_the_work_when_the_lock_is_lost() {
    struct Flag(Arc<AtomicUsize>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let (store, locks) = memory_pair();
    let handle = locks.try_acquire("report").await.unwrap();
    let dropped = Arc::new(AtomicUsize::new(0));
    let flag = Flag(dropped.clone());
    store.break_lease("report");
    let result = handle
        .run(async move {
            let _flag = flag;
            std::future::pending::<()>().await
        })
        .await;
    assert_eq!(result.unwrap_err().kind(), ErrorKind::Lost);
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "the work was dropped");
}

/// A connection-held backend whose checks can be made to hang, and which can see its
/// connection close without asking (as `LockBackend::lease_ended` allows).
#[derive(Clone)]
struct Connection {
    hang: Arc<std::sync::atomic::AtomicBool>,
    checks: Arc<AtomicUsize>,
    closed: tokio::sync::watch::Sender<bool>,
    attempts: Arc<AtomicUsize>,
}

impl Connection {
    fn new() -> Self {
        Connection {
            hang: Arc::default(),
            checks: Arc::default(),
            closed: tokio::sync::watch::channel(false).0,
            attempts: Arc::default(),
        }
    }
}

impl LockBackend for Connection {
    type Lease = ();

    fn provider(&self) -> &str {
        "connection"
    }

    fn timing(&self) -> LeaseTiming {
        LeaseTiming::ConnectionHeld(Duration::from_secs(5))
    }

    async fn try_acquire(
        &self,
        _key: &str,
        _mode: LockMode,
    ) -> Result<Option<Acquired<()>>, BackendError> {
        let attempt = self.attempts.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Some(Acquired {
            lease: (),
            fencing_token: attempt as u64,
        }))
    }

    async fn renew(&self, _lease: &()) -> Result<(), BackendError> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        if self.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    /// Hangs too while the connection hangs, as a release to a frozen server does.
    async fn release(&self, _lease: &()) -> Result<(), BackendError> {
        if self.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    fn lease_ended(&self, _lease: &()) -> impl std::future::Future<Output = ()> + Send {
        let mut closed = self.closed.subscribe();
        async move {
            let _ = closed.wait_for(|closed| *closed).await;
        }
    }
}

#[tokio::test(start_paused = true)]
async fn an_unanswered_connection_check_is_loss_after_one_interval() {
    let connection = Connection::new();
    let (hang, checks) = (connection.hang.clone(), connection.checks.clone());
    let locks = DistributedLock::builder(connection).build().unwrap();
    let start = Instant::now();
    let handle = locks.try_acquire("k").await.unwrap();
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(checks.load(Ordering::SeqCst), 2, "checks at 5 s and 10 s");
    hang.store(true, Ordering::SeqCst);
    fired(&handle.lost_token()).await;
    // The check sent at 15 s gets 5 s to answer.
    assert_at(start.elapsed(), Duration::from_secs(20));
    assert_eq!(handle.loss_reason(), Some(LossReason::ConnectionLost));
}

#[tokio::test(start_paused = true)]
async fn a_keeper_starts_only_for_a_hold_that_outlives_the_watch_delay() {
    let connection = Connection::new();
    let watchers = connection.closed.clone();
    let locks = DistributedLock::builder(connection).build().unwrap();
    let settle = || async {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    };
    // A hold released at once never costs a keeper (the keeper is what watches the connection).
    let short = locks.try_acquire("short").await.unwrap();
    settle().await;
    assert_eq!(
        watchers.receiver_count(),
        0,
        "no keeper before the watch delay"
    );
    short.release().await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        watchers.receiver_count(),
        0,
        "none after the release either"
    );
    // A hold kept a little longer is watched within the watch delay of 10 ms.
    let long = locks.try_acquire("long").await.unwrap();
    tokio::time::sleep(Duration::from_millis(11)).await;
    assert_eq!(
        watchers.receiver_count(),
        1,
        "its keeper watches the connection"
    );
    long.release().await.unwrap();
    settle().await;
    assert_eq!(watchers.receiver_count(), 0, "and stops at the release");
}

#[tokio::test(start_paused = true)]
async fn after_a_loss_local_callers_reach_the_backend_while_its_release_still_hangs() {
    let connection = Connection::new();
    let (hang, attempts) = (connection.hang.clone(), connection.attempts.clone());
    let locks = DistributedLock::builder(connection).build().unwrap();
    let lost = locks.try_acquire("k").await.unwrap();
    hang.store(true, Ordering::SeqCst);
    fired(&lost.lost_token()).await;
    let declared = Instant::now();
    // The best-effort release of the lost lock now hangs for up to `release_timeout` (10 s);
    // the key's turn must not wait for it, so the next caller's attempt goes to the backend.
    let next = locks
        .try_acquire("k")
        .await
        .expect("the backend, not the hanging release, decides");
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    assert_eq!(declared.elapsed(), Duration::ZERO);
    assert!(next.fencing_token() > lost.fencing_token());
    assert_eq!(lost.release().await.unwrap_err().kind(), ErrorKind::Lost);
    hang.store(false, Ordering::SeqCst);
    next.release().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Waiting

#[tokio::test(start_paused = true)]
async fn twenty_local_waiters_make_one_stream_of_attempts_and_are_served_fifo() {
    let store = MemoryStore::new();
    let recording = Recording::new();
    let min = Duration::from_millis(50);
    let locks = DistributedLock::builder(recording.backend(&store))
        .min_retry_delay(min)
        .max_retry_delay(Duration::from_millis(200))
        .build()
        .unwrap();
    // Another "process" holds the key, so the local waiters must poll the backend.
    let remote = DistributedLock::in_memory_shared(&store);
    let remote_handle = remote.try_acquire("job").await.unwrap();

    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for index in 0..20 {
        let locks = locks.clone();
        let served = served.clone();
        tasks.push(tokio::spawn(async move {
            let handle = locks
                .acquire("job", Duration::from_secs(120))
                .await
                .unwrap();
            served.lock().unwrap().push(index);
            handle.release().await.unwrap();
        }));
        // Let this waiter reach the queue before the next one arrives.
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    remote_handle.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }

    assert_eq!(*served.lock().unwrap(), (0..20).collect::<Vec<_>>());
    assert_eq!(recording.max_in_flight.load(Ordering::SeqCst), 1);
    let times = recording.attempt_times();
    let polling: Vec<_> = times
        .windows(2)
        .filter(|w| w[1] - w[0] > Duration::ZERO)
        .map(|w| w[1] - w[0])
        .collect();
    // One stream: while the remote held the key, consecutive attempts were at least the jitter
    // floor (half the minimum delay) apart. Twenty pollers would have produced bursts.
    let during_hold = times
        .iter()
        .filter(|t| **t < times[0] + Duration::from_secs(10))
        .count();
    assert!(
        during_hold <= 10_000 / 25 + 1,
        "{during_hold} attempts in 10 s is more than one stream"
    );
    assert!(
        polling.iter().all(|gap| *gap >= min / 2),
        "gaps {polling:?}"
    );
    // After the remote release, local hand-offs need no polling: one attempt per waiter.
    let after_release = times
        .iter()
        .filter(|t| **t >= times[0] + Duration::from_secs(10))
        .count();
    assert_eq!(
        after_release, 20,
        "each waiter was woken at once and attempted once"
    );
    assert_eq!(locks.local_callers(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_local_release_wakes_the_next_waiter_at_once() {
    let (_store, locks) = memory_pair();
    let first = locks.try_acquire("k").await.unwrap();
    let waiter = tokio::spawn({
        let locks = locks.clone();
        async move {
            let handle = locks.acquire("k", Duration::from_secs(60)).await.unwrap();
            (Instant::now(), handle.fencing_token())
        }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    let released_at = Instant::now();
    let first_token = first.fencing_token();
    first.release().await.unwrap();
    let (acquired_at, token) = waiter.await.unwrap();
    assert_eq!(
        acquired_at, released_at,
        "no backoff sleep after a local release"
    );
    assert!(token > first_token);
}

#[tokio::test(start_paused = true)]
async fn locks_are_not_reentrant_and_busy_needs_no_backend_call() {
    let (_store, recording, locks) = watched(Recording::new());
    let handle = locks.try_acquire("k").await.unwrap();
    let err = locks.try_acquire("k").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy);
    assert_eq!(err.code(), "locking.busy");
    assert_eq!(recording.attempt_times().len(), 1);
    let err = locks
        .acquire("k", Duration::from_secs(2))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout);
    drop(handle);
}

#[tokio::test(start_paused = true)]
async fn waiting_ends_in_timeout_when_busy_and_unavailable_when_unreachable() {
    let (store, locks) = memory_pair();
    let other = DistributedLock::in_memory_shared(&store);
    let held = other.try_acquire("k").await.unwrap();
    let start = Instant::now();
    let err = locks
        .acquire("k", Duration::from_secs(3))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout);
    assert_at(start.elapsed(), Duration::from_secs(3));
    drop(held);

    store.set_unavailable(true);
    let err = locks
        .acquire("k2", Duration::from_secs(3))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    let err = locks.try_acquire("k2").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    assert_eq!(locks.local_callers(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_outage_after_contention_ends_the_wait_unavailable_with_its_cause() {
    let (store, locks) = memory_pair();
    let other = DistributedLock::in_memory_shared(&store);
    let _held = other.try_acquire("k").await.unwrap();
    let waiting = tokio::spawn({
        let locks = locks.clone();
        async move { locks.acquire("k", Duration::from_secs(3)).await }
    });
    // The first attempts answer busy; then the backend goes down.
    tokio::time::sleep(Duration::from_millis(500)).await;
    store.set_unavailable(true);
    let err = waiting.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let cause = std::error::Error::source(&err).expect("the latest cause is kept");
    assert!(err.to_string().contains(&cause.to_string()), "{err}");
    assert!(!err.to_string().contains("\"k\""), "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_wait_that_starts_during_an_outage_is_refused_at_once_then_contention_is_busy() {
    let (store, locks) = memory_pair();
    let other = DistributedLock::in_memory_shared(&store);
    let _held = other.try_acquire("k").await.unwrap();
    store.set_unavailable(true);
    let start = Instant::now();
    let err = locks
        .acquire("k", Duration::from_secs(3))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert_eq!(start.elapsed(), Duration::ZERO, "refused at once");
    // The backend is back, and the key is still taken: contention, not an outage, once the
    // gate's probe (due within 50 ms) has been answered.
    store.set_unavailable(false);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let err = locks
        .acquire("k", Duration::from_secs(3))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_backend_that_stops_answering_after_a_busy_answer_is_unavailable_not_busy() {
    // Answers busy once, then never answers again: an outage that hangs requests.
    let calls = AtomicUsize::new(0);
    let busy_then_hanging = answering(move || {
        let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            if first {
                Ok(None)
            } else {
                std::future::pending().await
            }
        }
    });
    let locks = DistributedLock::builder(busy_then_hanging).build().unwrap();
    let err = locks
        .acquire("k", Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_waiter_stops_at_the_first_failure_no_retry_can_fix() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    // Refuses every request as misconfigured.
    let refusing = answering(move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Err(BackendError::misconfigured("credentials refused")) }
    });
    let locks = DistributedLock::builder(refusing).build().unwrap();
    let start = Instant::now();
    let err = locks
        .acquire("k", Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misconfigured);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(start.elapsed(), Duration::ZERO);
}

#[tokio::test]
async fn invalid_keys_are_refused_before_any_backend_call() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    for key in [String::new(), "k".repeat(513)] {
        let err = locks.try_acquire(&key).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidKey);
        let err = locks
            .acquire(&key, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidKey);
    }
    assert_eq!(store.attempts(), 0);
    assert!(locks.try_acquire(&"k".repeat(512)).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn builder_refuses_bad_options_with_every_problem_listed() {
    let err = DistributedLock::builder(MemoryBackend::new(MemoryStore::new()))
        .min_retry_delay(Duration::from_secs(5))
        .max_retry_delay(Duration::from_secs(1))
        .options(
            lockingkit::LockOptions::default()
                .with_min_retry_delay(Duration::from_secs(5))
                .with_max_retry_delay(Duration::from_secs(1))
                .with_release_timeout(Duration::ZERO),
        )
        .build()
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misconfigured);
    let text = err.to_string();
    assert!(text.contains("min_retry_delay"), "{text}");
    assert!(text.contains("release_timeout"), "{text}");
}

#[tokio::test(start_paused = true)]
async fn builder_refuses_a_retry_delay_a_writers_intent_would_lapse_in() {
    // A writer retrying 10 s apart would let new readers in between its attempts.
    let store = MemoryStore::new();
    // The in-memory backend, stating a writer's intent of its own (or none).
    let intent = |intent| Intercept::new(MemoryBackend::new(store.clone())).writer_intent(intent);
    let err = DistributedLock::builder(intent(Some(Duration::from_secs(10))))
        .max_retry_delay(Duration::from_secs(10))
        .build()
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misconfigured);
    assert!(
        err.to_string()
            .contains("writer_intent (10s) must be longer than max_retry_delay (10s)"),
        "{err}"
    );
    DistributedLock::builder(intent(Some(Duration::from_secs(10))))
        .max_retry_delay(Duration::from_millis(9999))
        .build()
        .expect("shorter than the intent");
    let slow = Duration::from_secs(30);
    DistributedLock::builder(intent(None))
        .max_retry_delay(slow)
        .build()
        .expect("no intent to lapse");
}

// ---------------------------------------------------------------------------------------------
// Cancellation and release

#[tokio::test(start_paused = true)]
async fn cancelling_a_queued_waiter_leaks_nothing() {
    let (store, locks) = memory_pair();
    let holder = locks.try_acquire("k").await.unwrap();
    let waiting = locks.acquire("k", Duration::from_secs(60));
    // Poll the waiter into the queue, then drop it.
    assert!(tokio::time::timeout(Duration::from_millis(10), waiting)
        .await
        .is_err());
    holder.release().await.unwrap();
    assert_eq!(locks.local_callers(), 0);
    assert!(!store.is_locked("k"));
    assert!(locks.try_acquire("k").await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn cancelling_during_an_attempt_releases_what_it_won() {
    let (store, recording, locks) = watched(Recording::new());
    let gate = recording.close_gate();
    let attempt = locks.try_acquire("k");
    // The attempt reaches the backend and waits at the gate; then its caller goes away.
    assert!(tokio::time::timeout(Duration::from_millis(10), attempt)
        .await
        .is_err());
    assert_eq!(recording.attempt_times().len(), 1);
    assert_eq!(
        locks.local_callers(),
        1,
        "the orphaned attempt still owns the turn"
    );
    *recording.gate.lock().unwrap() = None;
    let released = recording.released.notified();
    gate.notify_one();
    tokio::time::timeout(NO_TIME, released)
        .await
        .expect("the orphan released the lease it won");
    assert!(
        !store.is_locked("k"),
        "the lease the orphan won was released"
    );
    assert_eq!(recording.releases(), 1);
    tokio::task::yield_now().await;
    assert_eq!(locks.local_callers(), 0);
    assert!(locks.try_acquire("k").await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn cancelling_after_the_attempt_means_dropping_the_handle_which_releases_it() {
    let (store, recording, locks) = watched(Recording::new());
    let handle = locks.try_acquire("k").await.unwrap();
    let lost = handle.lost_token();
    let released = recording.released.notified();
    drop(handle);
    assert!(lost.is_cancelled(), "the lost token fires on drop");
    tokio::time::timeout(NO_TIME, released)
        .await
        .expect("the dropped handle was released in the background");
    assert!(!store.is_locked("k"));
    assert_eq!(recording.releases(), 1);
    tokio::task::yield_now().await;
    assert_eq!(locks.local_callers(), 0);
}

#[tokio::test(start_paused = true)]
async fn release_is_confirmed_fires_the_lost_token_and_happens_once() {
    let (store, locks) = memory_pair();
    let handle = locks.try_acquire("k").await.unwrap();
    let lost = handle.lost_token();
    assert!(!lost.is_cancelled());
    handle.release().await.unwrap();
    assert!(lost.is_cancelled());
    assert!(!store.is_locked("k"));
    // A token a caller cancels is their own copy, never the handle's.
    let handle = locks.try_acquire("k").await.unwrap();
    handle.lost_token().cancel();
    assert!(handle.is_held());
    assert!(!handle.lost_token().is_cancelled());
    handle.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn every_way_a_hold_ends_sends_exactly_one_release() {
    let (store, recording, locks) = watched(Recording::new());

    locks
        .try_acquire("k")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    assert_eq!(recording.releases(), 1, "release()");

    drop(locks.try_acquire("k").await.unwrap());
    recording.until_answered(2).await;
    assert_eq!(recording.releases(), 2, "drop");

    let gate = recording.close_gate();
    let attempt = locks.try_acquire("k");
    assert!(tokio::time::timeout(Duration::from_millis(10), attempt)
        .await
        .is_err());
    *recording.gate.lock().unwrap() = None;
    gate.notify_one();
    recording.until_answered(3).await;
    assert_eq!(recording.releases(), 3, "a cancelled attempt that won");

    let lost = locks.try_acquire("k").await.unwrap();
    assert!(store.break_lease("k"));
    fired(&lost.lost_token()).await;
    recording.until_answered(4).await;
    assert_eq!(lost.release().await.unwrap_err().kind(), ErrorKind::Lost);
    assert_eq!(recording.releases(), 4, "a loss, then release()");

    // Nothing is sent later either.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(recording.releases(), 4);
    assert_eq!(locks.local_callers(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_late_release_of_a_lost_lock_cannot_free_the_next_holder() {
    let (store, recording, locks) = watched(Recording::new());
    let start = Instant::now();
    let first = locks.try_acquire("k").await.unwrap();
    store.set_renewal_fault(RenewalFault::Hang);
    let release_gate = recording.close_release_gate();
    fired(&first.lost_token()).await;
    assert_at(start.elapsed(), Duration::from_secs(27));
    store.set_renewal_fault(RenewalFault::None);

    // The lost lock's best-effort release is held up; the lease expires at the store at 30 s
    // and another process takes the key.
    let other = DistributedLock::in_memory_shared(&store);
    let next = other.acquire("k", Duration::from_secs(5)).await.unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(37),
        "within the late release's timeout"
    );
    assert!(next.fencing_token() > first.fencing_token());

    release_gate.notify_one();
    recording.until_answered(1).await;
    assert_eq!(recording.releases(), 1, "one release for the lost lock");
    assert!(next.is_held());
    assert!(
        store.is_locked("k"),
        "the late release freed the next holder"
    );
    let third = DistributedLock::in_memory_shared(&store);
    assert_eq!(
        third.try_acquire("k").await.unwrap_err().kind(),
        ErrorKind::Busy
    );
    next.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_unconfirmed_release_is_reported_and_the_key_is_freed_locally() {
    let (store, locks) = memory_pair();
    let handle = locks.try_acquire("k").await.unwrap();
    store.set_unavailable(true);
    let err = handle.release().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    assert_eq!(locks.local_callers(), 0);
    store.set_unavailable(false);
    // The lease was not released, so it expires on its own after 30 s.
    assert!(store.is_locked("k"));
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(locks.try_acquire("k").await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_holder_that_vanishes_frees_the_key_after_the_lease() {
    let store = MemoryStore::new();
    let vanishing = DistributedLock::in_memory_shared(&store);
    // A runtime that goes away with its tasks stands for a process that dies.
    let handle = {
        let store = store.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            let locks = DistributedLock::in_memory_shared(&store);
            let handle = runtime.block_on(locks.try_acquire("k")).unwrap();
            std::mem::forget(handle);
        })
    };
    handle.join().unwrap();
    assert!(store.is_locked("k"));
    assert_eq!(
        vanishing.try_acquire("k").await.unwrap_err().kind(),
        ErrorKind::Busy
    );
    let got = vanishing
        .acquire("k", Duration::from_secs(40))
        .await
        .unwrap();
    assert!(got.fencing_token() > 1);
}

#[tokio::test(start_paused = true)]
async fn fencing_tokens_grow_across_processes() {
    let store = MemoryStore::new();
    let a = DistributedLock::in_memory_shared(&store);
    let b = DistributedLock::in_memory_shared(&store);
    let mut last = 0;
    for i in 0..10 {
        let locks = if i % 2 == 0 { &a } else { &b };
        let handle = locks.try_acquire("k").await.unwrap();
        assert!(handle.fencing_token() > last);
        last = handle.fencing_token();
        handle.release().await.unwrap();
    }
}

/// An in-memory backend whose releases wake the waits of every backend sharing `released`, as
/// a LISTEN/NOTIFY backend's would: plain attempts, woken by any release.
fn hinting(
    store: &MemoryStore,
    released: &tokio::sync::watch::Sender<()>,
) -> Intercept<MemoryBackend> {
    let signal = released.clone();
    Intercept::new(MemoryBackend::new(store.clone()))
        .on_release(move |release| {
            let signal = signal.clone();
            Box::pin(async move {
                let result = release.await;
                signal.send_replace(());
                result
            })
        })
        .wake_waits_on(released.clone())
}

#[tokio::test(start_paused = true)]
async fn a_wait_that_sees_a_release_wakes_the_front_waiter_before_its_backoff_ends() {
    let store = MemoryStore::new();
    let (released, _) = tokio::sync::watch::channel(());
    let remote = DistributedLock::builder(hinting(&store, &released))
        .build()
        .unwrap();
    let local = DistributedLock::builder(hinting(&store, &released))
        .min_retry_delay(Duration::from_secs(10))
        .max_retry_delay(Duration::from_secs(10))
        .build()
        .unwrap();
    let held = remote.try_acquire("k").await.unwrap();
    let start = Instant::now();
    let waiter = tokio::spawn(async move {
        let handle = local.acquire("k", Duration::from_secs(60)).await.unwrap();
        (Instant::now(), handle)
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    held.release().await.unwrap();
    let (acquired_at, _handle) = waiter.await.unwrap();
    // Without its wait the waiter would sleep at least 5 s (half its 10 s delay).
    assert_eq!(acquired_at - start, Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn a_connection_the_backend_sees_close_is_lost_at_once_not_at_the_next_check() {
    let connection = Connection::new();
    let closed = connection.closed.clone();
    let locks = DistributedLock::builder(connection).build().unwrap();
    let start = Instant::now();
    let handle = locks.try_acquire("k").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    closed.send_replace(true);
    fired(&handle.lost_token()).await;
    assert_eq!(start.elapsed(), Duration::from_millis(1500));
    assert_eq!(handle.loss_reason(), Some(LossReason::ConnectionLost));
}

/// When a 30 s lease is taken away 1.5 s after the acquire, and when the holder learns of it.
async fn expiring_lease_taken_away_at_1500ms(watches: bool) -> (Duration, Option<LossReason>) {
    // An in-memory backend that, like a backend watching its holders' records, can see a lease
    // taken away without renewing it (`LockBackend::lease_ended`), if it says it watches.
    let taken_away = tokio::sync::watch::channel(false).0;
    let signal = taken_away.clone();
    let watching = Intercept::new(MemoryBackend::new(MemoryStore::new())).lease_ended_when(
        watches,
        move || {
            let mut taken_away = signal.subscribe();
            async move {
                let _ = taken_away.wait_for(|gone| *gone).await;
            }
        },
    );
    let locks = DistributedLock::builder(watching).build().unwrap();
    let start = Instant::now();
    let handle = locks.try_acquire("k").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    taken_away.send_replace(true);
    fired(&handle.lost_token()).await;
    (start.elapsed(), handle.loss_reason())
}

#[tokio::test(start_paused = true)]
async fn an_expiring_lease_the_backend_sees_taken_away_is_lost_at_once() {
    let (lost_after, reason) = expiring_lease_taken_away_at_1500ms(true).await;
    assert_eq!(lost_after, Duration::from_millis(1500));
    assert_eq!(reason, Some(LossReason::LeaseGone));
    // A backend that does not say it watches is watched from its first renewal (10 s) on,
    // which spares a keeper task per short hold.
    let (lost_after, _) = expiring_lease_taken_away_at_1500ms(false).await;
    assert_eq!(lost_after, Duration::from_secs(10));
}

#[tokio::test(start_paused = true)]
async fn an_attempt_unanswered_for_the_patience_is_an_outage_while_it_still_runs() {
    let store = MemoryStore::new();
    let recording = Recording::new();
    // The engine's patience: its longest retry delay, and at least 2 s.
    let locks = DistributedLock::builder(recording.backend(&store))
        .options(
            lockingkit::LockOptions::default()
                .with_min_retry_delay(Duration::from_millis(100))
                .with_max_retry_delay(Duration::from_millis(100))
                .with_max_outage_retry_delay(Duration::from_millis(100)),
        )
        .build()
        .unwrap();
    // Attempts hang, as against a frozen server.
    let gate = recording.close_gate();
    let start = Instant::now();
    let err = locks
        .acquire("k", Duration::from_secs(10))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("did not answer"), "{err}");
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(2),
        "told after the patience"
    );
    assert_eq!(
        locks.local_callers(),
        1,
        "the hung attempt still owns the key's turn"
    );

    // A caller that meets it is refused at once with the outage's cause, and so is a caller of
    // another key until the gate's probe is due.
    for key in ["k", "other"] {
        let err = locks.try_acquire(key).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
        assert!(
            err.to_string().contains("did not answer"),
            "an outage, not a failure the backend reported: {err}"
        );
    }
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    *recording.gate.lock().unwrap() = None;
    gate.notify_one();
}

/// Answers every attempt with the same failure, after a round trip so that other callers can
/// meet the attempt in flight.
fn failing(error: fn() -> BackendError) -> Intercept<MemoryBackend> {
    answering(move || async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        Err(error())
    })
}

#[tokio::test(start_paused = true)]
async fn lease_gone_before_any_lease_exists_is_unavailable_not_lost() {
    let locks = DistributedLock::builder(failing(|| BackendError::lease_gone("connection reset")))
        .build()
        .unwrap();
    let err = locks.try_acquire("k").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_wait_whose_backend_answers_with_failures_ends_unavailable_with_the_cause() {
    // The backend answered every attempt, but with a failure it reported itself (a 5xx, a full
    // lock table): the lock service is out, not contended, and the caller learns why. A local
    // waiter queued behind the attempting caller reads the same evidence.
    let locks = DistributedLock::builder(failing(|| {
        BackendError::transient("out of shared memory; raise max_locks_per_transaction")
    }))
    .build()
    .unwrap();
    let start = Instant::now();
    let front = queued_waiter(&locks, "k", Duration::from_secs(3)).await;
    let queued = locks
        .acquire("k", Duration::from_secs(2))
        .await
        .unwrap_err();
    assert_eq!(queued.kind(), ErrorKind::Unavailable, "{queued}");
    assert!(queued.to_string().contains("with a failure"), "{queued}");
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(100),
        "told with the front's answer"
    );

    let err = front.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        err.to_string().contains("max_locks_per_transaction"),
        "the cause is kept: {err}"
    );
    assert!(
        err.to_string()
            .contains("answered the latest attempt with a failure"),
        "a failure the backend reported, not an outage: {err}"
    );
    assert!(std::error::Error::source(&err).is_some());
}

#[tokio::test(start_paused = true)]
async fn a_wait_ends_at_its_first_failure_and_is_not_held_until_its_timeout() {
    // A failure is an outage until the backend answers again: the waiter is told at once,
    // with the cause, rather than left to hang for its timeout.
    let store = MemoryStore::new();
    let (remote, failing) = over_network(&store, Duration::ZERO);
    failing.store(true, Ordering::SeqCst);
    let locks = DistributedLock::builder(remote).build().unwrap();
    let _remote = DistributedLock::in_memory_shared(&store)
        .try_acquire("k")
        .await
        .unwrap();
    let start = Instant::now();
    let err = locks
        .acquire("k", Duration::from_secs(3))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert_eq!(start.elapsed(), Duration::ZERO, "told at once");
    // Once the backend answers again (the gate's next probe), the key is busy again: contention.
    failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let err = locks.try_acquire("k").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_healthy_hold_reports_no_loss_reason_until_it_ends() {
    let (_store, locks) = memory_pair();
    let handle = locks.try_acquire("k").await.unwrap();
    for _ in 0..5 {
        assert_eq!(handle.loss_reason(), None);
        assert!(handle.is_held());
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    assert_eq!(handle.loss_reason(), None);
    handle.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn dropping_the_last_lock_of_an_engine_ends_its_schedule_driver() {
    let runtime = tokio::runtime::Handle::current();
    let locks = DistributedLock::in_memory();
    let handle = locks.try_acquire("k").await.unwrap();
    // A hold enters the renewal schedule, whose driver is a task of its own.
    tokio::task::yield_now().await;
    assert_eq!(runtime.metrics().num_alive_tasks(), 1, "the driver runs");
    handle.release().await.unwrap();
    drop(locks);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        runtime.metrics().num_alive_tasks(),
        0,
        "nothing is left running for an engine nobody can use"
    );
}

#[tokio::test(start_paused = true)]
async fn every_wait_is_opened_in_its_own_mode() {
    // The in-memory backend in every mode, noting the mode of each wait the engine opens.
    let hints = Arc::new(Mutex::new(Vec::new()));
    let noted = hints.clone();
    let hint_counting = Intercept::new(MemoryBackend::new(MemoryStore::new()))
        .on_wait(move |_key, mode| noted.lock().unwrap().push(mode));
    let locks = DistributedLock::builder(hint_counting).build().unwrap();
    let asked = |mode: LockMode| hints.lock().unwrap().iter().filter(|m| **m == mode).count();

    let semaphore = locks.semaphore("k", 1).unwrap();
    let _slot = semaphore.try_acquire().await.unwrap();
    let err = semaphore.acquire(Duration::from_secs(3)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(asked(LockMode::Semaphore { max_count: 1 }) > 0);
    let all = hints.lock().unwrap().len();
    assert_eq!(all, asked(LockMode::Semaphore { max_count: 1 }));

    // The lock `k` is unrelated to the semaphore `k`; a reader waiting for its writer asks
    // as a reader, and a writer waiting for that reader as a writer.
    let writer = locks.try_acquire("k").await.unwrap();
    let readers = locks.reader_writer("k").unwrap();
    let err = readers.read(Duration::from_secs(3)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(asked(LockMode::Shared) > 0);
    assert_eq!(asked(LockMode::Exclusive), 0);
    writer.release().await.unwrap();
    let _reader = readers.try_read().await.unwrap();
    let err = readers.write(Duration::from_secs(3)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(asked(LockMode::Exclusive) > 0);
}

#[tokio::test(start_paused = true)]
async fn callers_waiting_for_a_full_semaphore_make_one_stream_of_attempts() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    // Another "process" fills the semaphore for 10 s.
    let remote = DistributedLock::in_memory_shared(&store);
    let full = remote.semaphore("exports", 1).unwrap();
    let remote_slot = full.try_acquire().await.unwrap();

    let semaphore = locks.semaphore("exports", 1).unwrap();
    let before = store.attempts();
    let mut waiters = Vec::new();
    for _ in 0..20 {
        let semaphore = semaphore.clone();
        waiters.push(tokio::spawn(async move {
            semaphore.acquire(Duration::from_secs(60)).await
        }));
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    // One caller polls, backing off from 50 ms to 1 s: about 15 attempts in 10 s. Twenty
    // callers polling on their own would make about 300.
    let polled = store.attempts() - before;
    assert!(polled <= 25, "{polled} attempts in 10 s");
    assert_eq!(
        locks.local_callers(),
        20,
        "twenty waiters, each counted once, and nothing held here"
    );

    // A caller that only tries goes behind them, without asking the backend.
    let tried = store.attempts();
    let err = semaphore.try_acquire().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    assert_eq!(store.attempts(), tried);

    remote_slot.release().await.unwrap();
    // Each holder hands over as it leaves: the next local waiter is nudged at once.
    let start = Instant::now();
    let first = tokio::time::timeout(Duration::from_secs(2), waiters.remove(0))
        .await
        .expect("the front waiter takes the freed slot within its backoff")
        .unwrap()
        .unwrap();
    let handed_over = Instant::now();
    first.release().await.unwrap();
    let second = waiters.remove(0).await.unwrap().unwrap();
    assert_eq!(
        Instant::now(),
        handed_over,
        "a local release lets the next waiter in at once, not after its backoff"
    );
    assert!(handed_over - start <= Duration::from_secs(1));
    second.release().await.unwrap();
    for waiter in waiters {
        waiter.await.unwrap().unwrap().release().await.unwrap();
    }
    assert_eq!(locks.local_callers(), 0, "no queue or lane left behind");
}

/// An in-memory backend seen over a network: each attempt takes `latency` to answer, and
/// while the flag returned is set it answers with a failure the backend reports itself.
fn over_network(
    store: &MemoryStore,
    latency: Duration,
) -> (Intercept<MemoryBackend>, Arc<AtomicBool>) {
    let failing = Arc::new(AtomicBool::new(false));
    let down = failing.clone();
    let remote = Intercept::new(MemoryBackend::new(store.clone())).on_try_acquire(move |attempt| {
        let down = down.clone();
        Box::pin(async move {
            tokio::time::sleep(latency).await;
            if down.load(Ordering::SeqCst) {
                return Err(BackendError::transient("server error"));
            }
            attempt.await
        })
    });
    (remote, failing)
}

/// How long an [`over_network`] attempt takes in the tests that give it one.
const ATTEMPT_TIME: Duration = Duration::from_millis(10);

#[tokio::test(start_paused = true)]
async fn callers_of_a_semaphore_with_room_get_in_together() {
    let store = MemoryStore::new();
    let locks = DistributedLock::builder(over_network(&store, ATTEMPT_TIME).0)
        .build()
        .unwrap();
    let semaphore = locks.semaphore("exports", 5).unwrap();
    let before = store.attempts();
    let start = Instant::now();
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let semaphore = semaphore.clone();
            tokio::spawn(async move { semaphore.acquire(Duration::from_secs(60)).await })
        })
        .collect();
    let mut handles = Vec::new();
    for task in tasks {
        handles.push(task.await.unwrap().unwrap());
    }
    assert_eq!(
        start.elapsed(),
        ATTEMPT_TIME,
        "the five attempts ran at the same time, not one after another"
    );
    assert_eq!(store.attempts() - before, 5, "one attempt each");
    assert_eq!(store.semaphore_holders("exports"), 5);
}

#[tokio::test(start_paused = true)]
async fn semaphores_of_one_name_and_different_counts_share_no_queue() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let remote = DistributedLock::in_memory_shared(&store);
    let _remote_slot = remote
        .semaphore("k", 1)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let one = locks.semaphore("k", 1).unwrap();
        async move { one.acquire(Duration::from_secs(60)).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A semaphore of five has room although the semaphore of one is full.
    let five = locks.semaphore("k", 5).unwrap();
    let start = Instant::now();
    let slot = five.acquire(Duration::from_secs(60)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    let other = five.try_acquire().await.unwrap();
    slot.release().await.unwrap();
    other.release().await.unwrap();
    waiter.abort();
}

#[tokio::test(start_paused = true)]
async fn callers_queued_for_a_semaphore_during_an_outage_are_told_of_the_outage() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    store.set_unavailable(true);
    let semaphore = locks.semaphore("k", 1).unwrap();
    let start = Instant::now();
    let front = tokio::spawn({
        let semaphore = semaphore.clone();
        async move { semaphore.acquire(Duration::from_secs(60)).await }
    });
    tokio::task::yield_now().await;
    let err = semaphore
        .acquire(Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let err = semaphore.try_acquire().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let err = front.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "nobody waits out the outage"
    );
    store.set_unavailable(false);
    // The gate's first probe is due within 50 ms of the failure: the caller then let through
    // finds the backend back, and gets in.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let slot = semaphore
        .acquire(Duration::from_secs(2))
        .await
        .expect("a caller gets in once the backend is back");
    slot.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_slot_freed_here_at_a_semaphore_waiters_deadline_is_not_taken_late() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let semaphore = locks.semaphore("k", 1).unwrap();
    let holder = semaphore.try_acquire().await.unwrap();
    let waiter = tokio::spawn({
        let semaphore = semaphore.clone();
        async move { semaphore.acquire(Duration::from_secs(1)).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let attempts = store.attempts();
    // The release nudges the waiter exactly at its deadline: its time is up.
    holder.release().await.unwrap();
    let err = waiter.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert_eq!(store.attempts(), attempts, "no attempt after the deadline");
    assert_eq!(locks.local_callers(), 0);
}

#[tokio::test(start_paused = true)]
async fn when_the_front_semaphore_waiter_takes_a_slot_the_next_tries_at_once() {
    let store = MemoryStore::new();
    let locks = DistributedLock::builder(over_network(&store, ATTEMPT_TIME).0)
        .build()
        .unwrap();
    let remote = DistributedLock::in_memory_shared(&store)
        .semaphore("k", 2)
        .unwrap();
    let remote_slots = [
        remote.try_acquire().await.unwrap(),
        remote.try_acquire().await.unwrap(),
    ];
    let semaphore = locks.semaphore("k", 2).unwrap();
    // Both callers find nobody waiting and attempt at once; both are answered "full", and the
    // one answered second queues behind the other.
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let semaphore = semaphore.clone();
            tokio::spawn(async move {
                let slot = semaphore.acquire(Duration::from_secs(60)).await;
                (Instant::now(), slot)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    for slot in remote_slots {
        slot.release().await.unwrap();
    }
    let mut taken = Vec::new();
    for waiter in waiters {
        let (at, slot) = waiter.await.unwrap();
        taken.push((at, slot.unwrap()));
    }
    taken.sort_by_key(|(at, _)| *at);
    assert_eq!(
        taken[1].0 - taken[0].0,
        ATTEMPT_TIME,
        "the caller behind attempts as the front one takes its slot, without a backoff"
    );
}

#[tokio::test(start_paused = true)]
async fn a_semaphore_waiter_that_gives_up_passes_the_polling_on() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let remote = DistributedLock::in_memory_shared(&store);
    let remote_slot = remote
        .semaphore("k", 1)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    let semaphore = locks.semaphore("k", 1).unwrap();
    let front = tokio::spawn({
        let semaphore = semaphore.clone();
        async move { semaphore.acquire(Duration::from_secs(60)).await }
    });
    tokio::task::yield_now().await;
    let behind = tokio::spawn({
        let semaphore = semaphore.clone();
        async move { semaphore.acquire(Duration::from_secs(60)).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    front.abort();
    let _ = front.await;
    remote_slot.release().await.unwrap();
    let slot = tokio::time::timeout(Duration::from_secs(2), behind)
        .await
        .expect("the caller behind polls once the front one left")
        .unwrap()
        .unwrap();
    assert_eq!(store.semaphore_holders("k"), 1);
    slot.release().await.unwrap();
    assert_eq!(locks.local_callers(), 0);
}

#[tokio::test]
async fn a_backend_that_holds_only_exclusive_locks_refuses_readers_and_semaphores() {
    let exclusive_only = failing(|| BackendError::transient("unused"))
        .supporting(|mode| mode == LockMode::Exclusive);
    let locks = DistributedLock::builder(exclusive_only).build().unwrap();
    let err = locks.reader_writer("k").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    let err = locks.semaphore("k", 2).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");

    let locks = DistributedLock::in_memory();
    assert_eq!(
        locks.semaphore("k", 0).unwrap_err().kind(),
        ErrorKind::Misconfigured
    );
    assert_eq!(
        locks
            .semaphore("k", lockingkit::backend::MAX_SEMAPHORE_COUNT + 1)
            .unwrap_err()
            .kind(),
        ErrorKind::Misconfigured
    );
    assert_eq!(
        locks.semaphore("", 2).unwrap_err().kind(),
        ErrorKind::InvalidKey
    );
    assert!(locks
        .semaphore("k", lockingkit::backend::MAX_SEMAPHORE_COUNT)
        .is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_turn_that_reaches_a_waiter_at_its_deadline_is_used_for_one_attempt() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let holder = locks.try_acquire("k").await.unwrap();
    let waiter = queued_waiter(&locks, "k", Duration::from_secs(1)).await;
    let attempts = store.attempts();
    // The release lands at the waiter's deadline. The waiter learns nothing but "the holder
    // has gone" before its time is up, and the truth is one attempt away: it makes that one
    // attempt (as a zero wait makes one), and no more.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = Instant::now();
    holder.release().await.unwrap();
    let handle = waiter.await.unwrap().unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(
        store.attempts(),
        attempts + 1,
        "one attempt at the deadline"
    );
    handle.release().await.unwrap();
    assert_eq!(locks.local_callers(), 0);
}

#[tokio::test(start_paused = true)]
async fn readers_waiting_for_a_writer_elsewhere_make_one_stream_of_attempts_and_all_get_in() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    // Another "process" writes the key for 10 s.
    let remote = DistributedLock::in_memory_shared(&store);
    let remote_writer = remote.try_acquire("prices").await.unwrap();

    let readers = locks.reader_writer("prices").unwrap();
    let before = store.attempts();
    let mut waiting = Vec::new();
    for _ in 0..20 {
        let readers = readers.clone();
        waiting.push(tokio::spawn(async move {
            readers.read(Duration::from_secs(60)).await
        }));
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    // The first busy answer sends every reader into one queue, whose front polls, backing off
    // from 50 ms to 1 s: about 15 attempts in 10 s, not 20 streams of them.
    let polled = store.attempts() - before;
    assert!(polled <= 25, "{polled} attempts in 10 s");
    assert_eq!(locks.waiting("prices"), 20);

    // A reader that only tries goes behind them, without asking the backend.
    let tried = store.attempts();
    let err = readers.try_read().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    assert_eq!(store.attempts(), tried);

    remote_writer.release().await.unwrap();
    let start = Instant::now();
    let mut held = Vec::new();
    for waiter in waiting {
        held.push(waiter.await.unwrap().unwrap());
    }
    // Readers hold together: once the front one is in, each one in line follows at once.
    assert!(
        start.elapsed() <= Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert!(held.iter().all(|handle| handle.is_held()));
    for handle in held {
        handle.release().await.unwrap();
    }
    assert_eq!(locks.local_callers(), 0, "no queue or turn left behind");
}

#[tokio::test(start_paused = true)]
async fn a_local_writers_release_lets_the_waiting_reader_in_at_once() {
    let locks = DistributedLock::in_memory();
    let prices = locks.reader_writer("prices").unwrap();
    let writer = prices.try_write().await.unwrap();
    let reader = tokio::spawn({
        let prices = prices.clone();
        async move { prices.read(Duration::from_secs(60)).await }
    });
    // Long enough for the reader's backoff to grow to its 1 s cap.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let released = Instant::now();
    writer.release().await.unwrap();
    let read = reader.await.unwrap().unwrap();
    assert_eq!(
        Instant::now(),
        released,
        "woken by the local release, not after its backoff"
    );
    read.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_last_local_readers_release_lets_the_waiting_writer_in_at_once() {
    let locks = DistributedLock::in_memory();
    let prices = locks.reader_writer("prices").unwrap();
    let first = prices.try_read().await.unwrap();
    let second = prices.try_read().await.unwrap();
    let writer = tokio::spawn({
        let prices = prices.clone();
        async move { prices.write(Duration::from_secs(60)).await }
    });
    tokio::time::sleep(Duration::from_secs(10)).await;
    first.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(!writer.is_finished(), "one reader still holds the key");
    let released = Instant::now();
    second.release().await.unwrap();
    let written = writer.await.unwrap().unwrap();
    assert_eq!(
        Instant::now(),
        released,
        "woken by the last local release, not after its backoff"
    );
    written.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn short_waits_on_a_healthy_busy_backend_are_told_busy_or_timeout_never_unavailable() {
    // Every caller's wait ends with an answer from the backend: its own attempt's, or that of
    // the attempt in flight for its key, however short the wait and however many callers meet
    // one another mid-attempt.
    // A healthy backend whose key is always taken, answering "busy" after a round trip.
    let slow_busy = answering(|| async {
        tokio::time::sleep(Duration::from_millis(3)).await;
        Ok(None)
    });
    let locks = DistributedLock::builder(slow_busy).build().unwrap();
    let waits = [0, 1, 5, 20, 60].map(Duration::from_millis);
    let callers: Vec<_> = (0..200)
        .map(|caller| {
            let locks = locks.clone();
            let wait = waits[caller % waits.len()];
            tokio::spawn(async move {
                // Arrivals spread over a few round trips, so that callers meet attempts,
                // queues and backoffs at every stage.
                tokio::time::sleep(Duration::from_micros(137 * caller as u64)).await;
                let key = format!("k{}", caller % 3);
                let result = if caller % 7 == 0 {
                    locks.try_acquire(&key).await
                } else {
                    locks.acquire(&key, wait).await
                };
                (wait, result.map(drop).unwrap_err())
            })
        })
        .collect();
    let mut told = std::collections::BTreeMap::new();
    for caller in callers {
        let (wait, error) = caller.await.unwrap();
        assert!(
            matches!(error.kind(), ErrorKind::Busy | ErrorKind::Timeout),
            "a caller waiting {wait:?} was told {error}"
        );
        *told.entry(error.kind() as u8).or_insert(0) += 1;
    }
    assert_eq!(told.values().sum::<i32>(), 200);
    assert_eq!(locks.local_callers(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_release_unanswered_for_the_patience_is_an_outage_to_the_waiters_behind_it() {
    let (_store, recording, locks) = watched(Recording::new());
    let held = locks.try_acquire("k").await.unwrap();
    let waiter = queued_waiter(&locks, "k", Duration::from_secs(30)).await;
    // The release hangs, as against a server that froze while the lock was held.
    let gate = recording.close_release_gate();
    let start = Instant::now();
    let releasing = tokio::spawn(held.release());
    let err = waiter.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        err.to_string().contains("did not answer a release"),
        "{err}"
    );
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(2),
        "told at the patience, not at its deadline"
    );
    // The gate fails: a caller of another key is refused at once, nothing sent.
    let attempts = recording.attempt_times().len();
    let err = locks.try_acquire("other").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert_eq!(recording.attempt_times().len(), attempts);
    *recording.release_gate.lock().unwrap() = None;
    gate.notify_one();
    releasing.await.unwrap().unwrap();
}
