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

use crate::proxy::FaultProxy;

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

/// One "process" of a case: its own engine and connections, reaching the server through a
/// proxy of its own, so that a network fault hits this process alone.
pub struct Process {
    /// The process's number in the case (the interval checker's `process`).
    pub id: usize,
    /// The proxy between this process and the server.
    pub proxy: FaultProxy,
    /// The process's engine.
    pub locks: DistributedLock,
}

/// What a background contender's wait ends with: the lock and when it was taken.
pub type Contender = JoinHandle<Result<(LockHandle, Instant), LockError>>;

impl Process {
    /// Takes `key`, failing the case if this process cannot within [`PATIENCE`].
    pub async fn acquire(&self, key: &str) -> (LockHandle, Instant) {
        let handle = self
            .locks
            .acquire(key, PATIENCE)
            .await
            .unwrap_or_else(|e| panic!("process {} could not acquire: {e}", self.id));
        (handle, Instant::now())
    }

    /// Acquires, then watches the hold for loss.
    pub async fn hold_watched(&self, key: &str) -> Watched {
        let (handle, acquired) = self.acquire(key).await;
        Watched::new(self.id, handle, acquired)
    }

    /// Holds `key` once an outage this process saw has ended ([`acquire_through_outages`]),
    /// then watches the hold for loss.
    pub async fn hold_watched_after_outage(&self, key: &str) -> Watched {
        match acquire_through_outages(&self.locks, key, PATIENCE).await {
            Ok((handle, _)) => Watched::new(self.id, handle, Instant::now()),
            Err(e) => panic!("process {} could not acquire: {e}", self.id),
        }
    }

    /// Waits for `key` in the background, as a contender would; an outage ends the wait.
    pub fn wait_for(&self, key: &str) -> Contender {
        let locks = self.locks.clone();
        let key = key.to_owned();
        tokio::spawn(async move {
            let handle = locks.acquire(&key, PATIENCE).await?;
            Ok((handle, Instant::now()))
        })
    }

    /// Waits for `key` in the background through outages ([`acquire_through_outages`]), as a
    /// worker would.
    pub fn wait_through_outages_for(&self, key: &str) -> Contender {
        let locks = self.locks.clone();
        let key = key.to_owned();
        tokio::spawn(async move {
            let (handle, _) = acquire_through_outages(&locks, &key, PATIENCE).await?;
            Ok((handle, Instant::now()))
        })
    }

    /// Waits until a request this process sent after `after` (a renewal or a check) was
    /// answered.
    pub async fn answered_after(&self, after: Instant) {
        tokio::time::timeout(PATIENCE, self.proxy.exchange_after(after))
            .await
            .expect("a renewal or check answered");
    }

    /// The process takes the lock again once the fault is gone, with a token above `previous`.
    pub async fn usable_again(&self, key: &str, checker: &IntervalChecker, previous: u64) {
        let (handle, start) = self.acquire(key).await;
        assert!(
            handle.fencing_token() > previous,
            "tokens keep growing after the fault"
        );
        record(checker, key, self.id, handle.fencing_token(), start);
        handle.release().await.expect("a confirmed release");
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
pub async fn contender_lock(waiter: Contender) -> (LockHandle, Instant) {
    tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("the contender got the lock in time")
        .expect("the contender task")
        .expect("the contender acquired")
}
