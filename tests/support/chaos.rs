//! What the chaos suites (tests/chaos.rs, tests/redis_chaos.rs, tests/etcd_chaos.rs) share:
//! taking a lock through an outage, watching a hold for loss, and the assertions every faulted
//! case makes about it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockingkit::testing::{HeldInterval, IntervalChecker};
use lockingkit::{DistributedLock, ErrorKind, LockError, LockHandle, LossReason};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Long enough for any wait a case expects to finish; a hang fails the case instead of the run.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// Takes `key` within `within`, as a worker would through an outage: a call the outage ends
/// (`Unavailable`, at once while the engine still counts the backend as failing) is made again
/// 50 ms later. Returns the handle and how many calls an outage ended.
pub async fn acquire_through_outages(
    locks: &DistributedLock,
    key: &str,
    within: Duration,
) -> Result<(LockHandle, usize), LockError> {
    let give_up = Instant::now() + within;
    let mut outages = 0;
    loop {
        let left = give_up.saturating_duration_since(Instant::now());
        match locks.acquire(key, left).await {
            Ok(handle) => return Ok((handle, outages)),
            Err(error) if error.kind() == ErrorKind::Unavailable && Instant::now() < give_up => {
                outages += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => return Err(error),
        }
    }
}

/// A held lock whose `run` carries work that never finishes by itself, so `run` returns only
/// when the lock is lost.
pub struct Watched {
    /// The process (in the case's numbering) that holds it.
    pub process: usize,
    /// Its fencing token.
    pub token: u64,
    /// When it was acquired.
    pub acquired: Instant,
    /// The watching task: it ends with the loss.
    pub loss: JoinHandle<Loss>,
}

/// What a watched hold saw when it ended.
pub struct Loss {
    /// When `run` returned.
    pub at: Instant,
    /// What `run` returned.
    pub result: Result<(), LockError>,
    /// Whether the work future was dropped (not merely abandoned).
    pub work_dropped: bool,
    /// The lost handle.
    pub handle: LockHandle,
}

/// Sets its flag when dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Watched {
    pub fn new(process: usize, handle: LockHandle, acquired: Instant) -> Watched {
        let token = handle.fencing_token();
        let loss = tokio::spawn(async move {
            let dropped = Arc::new(AtomicBool::new(false));
            let flag = DropFlag(dropped.clone());
            let work = async move {
                let _flag = flag;
                std::future::pending::<()>().await
            };
            let result = handle.run(work).await;
            Loss {
                at: Instant::now(),
                result,
                work_dropped: dropped.load(Ordering::SeqCst),
                handle,
            }
        });
        Watched {
            process,
            token,
            acquired,
            loss,
        }
    }

    /// Waits for the loss, failing the case if none comes within `within`.
    pub async fn lost_within(self, within: Duration) -> (Loss, HeldInterval) {
        let loss = tokio::time::timeout(within, self.loss)
            .await
            .unwrap_or_else(|_| panic!("no loss declared within {within:?}"))
            .expect("the watching task");
        let hold = HeldInterval {
            key: loss.handle.key().to_owned(),
            process: self.process,
            fencing_token: self.token,
            start: self.acquired,
            end: loss.at,
        };
        (loss, hold)
    }

    /// Still held after `period`: no loss.
    pub async fn still_held_after(&mut self, period: Duration) {
        if let Ok(loss) = tokio::time::timeout(period, &mut self.loss).await {
            let loss = loss.expect("the watching task");
            panic!(
                "the lock was lost: {:?}, {:?}",
                loss.handle.loss_reason(),
                loss.result.err()
            );
        }
    }

    /// Ends a hold that was never lost (dropping the handle releases it).
    pub async fn end(self) {
        assert!(!self.loss.is_finished(), "the hold ended by itself");
        self.loss.abort();
        assert!(self.loss.await.is_err(), "the hold ended by itself");
    }
}

/// Asserts everything a lost handle must show.
#[track_caller]
pub fn assert_lost(loss: &Loss, reason: LossReason) {
    let error = loss
        .result
        .as_ref()
        .expect_err("`run` returned Ok on a lost lock");
    assert_eq!(error.kind(), ErrorKind::Lost, "{error}");
    assert!(loss.work_dropped, "`run` must drop its work on loss");
    assert!(loss.handle.lost_token().is_cancelled(), "lost token fired");
    assert!(!loss.handle.is_held());
    assert_eq!(
        loss.handle.ensure_held().map_err(|e| e.kind()),
        Err(ErrorKind::Lost)
    );
    assert_eq!(loss.handle.loss_reason(), Some(reason));
}

/// Asserts `at` falls within `[expected - early, expected + late]`.
#[track_caller]
pub fn assert_near(what: &str, at: Instant, expected: Instant, early: Duration, late: Duration) {
    // Shown with `--no-capture`: how much of each tolerance a run actually used.
    if at >= expected {
        eprintln!("{what}: {:?} after the expected instant", at - expected);
    } else {
        eprintln!("{what}: {:?} before the expected instant", expected - at);
    }
    assert!(
        at + early >= expected && at <= expected + late,
        "{what}: {} than expected (allowed {early:?} early, {late:?} late)",
        if at < expected {
            format!("{:?} earlier", expected - at)
        } else {
            format!("{:?} later", at - expected)
        }
    );
}

/// Records one hold.
pub fn record(checker: &IntervalChecker, key: &str, process: usize, token: u64, start: Instant) {
    checker.record(HeldInterval {
        key: key.to_owned(),
        process,
        fencing_token: token,
        start,
        end: Instant::now(),
    });
}

/// Waits for a background contender's lock.
pub async fn contender_lock(
    waiter: JoinHandle<Result<(LockHandle, Instant), LockError>>,
) -> (LockHandle, Instant) {
    tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("the contender got the lock in time")
        .expect("the contender task")
        .expect("the contender acquired")
}
