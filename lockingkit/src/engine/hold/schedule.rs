//! The renewal scheduler: starts a keeper task only for locks held long enough to need one.
//!
//! Most locks are released well before their first renewal is due (a third of the lease by
//! default). Spawning a task and arming timers for each of them would cost more than the rest
//! of the acquire path together. Instead every new hold is entered here with the instant its
//! first renewal or check is due; one driver task per engine sleeps until the earliest entry and
//! starts that lock's keeper. A hold that ends before then never costs a task, and ending it
//! does not touch the schedule: its entry is a weak reference that the driver drops when it
//! comes due (or a sweep drops earlier, if ended holds pile up). What this saves per short hold
//! is what the benchmark's rows 3 (in-memory pairs) and 7 (PostgreSQL pairs on distinct keys)
//! measure; docs/performance.md tells how each step of it was measured.
//!
//! The keeper, once started, enforces the loss deadline from the acquire's send time, so a
//! driver that runs late (a starved runtime) can delay renewal but never postpone loss:
//! `LockView::is_held` checks the deadline itself, and a late keeper finds it passed at once.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::{sleep_until, Instant};

/// Holds that left the schedule early are swept out once there are at least this many, and
/// they outnumber the rest: the memory they keep is bounded, and a sweep is rare.
const SWEEP_AFTER: usize = 1024;

/// A held lock whose keeper can be started.
pub(crate) trait StartKeeper: Send + Sync {
    /// Spawns the lock's keeper task on the runtime the lock was taken on, unless the hold
    /// has already ended.
    fn start_keeper(self: Arc<Self>);
}

#[derive(Default)]
pub(crate) struct RenewalScheduler {
    state: Mutex<State>,
    /// Holds that ended since the last sweep (see [`RenewalScheduler::left`]).
    left: AtomicUsize,
    wake: Notify,
    /// How many times the driver has looked at the queue (for tests of how rarely it wakes).
    #[cfg(test)]
    wakeups: AtomicUsize,
}

/// A hold waiting for its keeper. Weak, so a hold that ends is freed at once; its entry stays
/// until it is due or swept, which costs the hot path nothing.
struct Due {
    due: Instant,
    hold: Weak<dyn StartKeeper>,
}

#[derive(Default)]
struct State {
    /// In the order the keepers are due. An engine's keeper delay is fixed, so a new hold
    /// almost always goes at the back.
    due: VecDeque<Due>,
    driver_running: bool,
    /// When the driver will wake on its own; `None` while it waits for a notification.
    driver_wakes_at: Option<Instant>,
    closed: bool,
}

impl RenewalScheduler {
    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the queue consistent, so poisoning carries no meaning.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Enters a hold whose keeper is due at `due`. The keeper starts then, unless the hold has
    /// ended by that time.
    pub(crate) fn schedule(
        self: &Arc<Self>,
        runtime: &Handle,
        due: Instant,
        hold: Weak<dyn StartKeeper>,
    ) {
        let mut state = self.state();
        if state.closed {
            return;
        }
        // `left` counts ended holds, some of them already gone from the queue, so a sweep
        // can come early but never later than this. A hold that ended but is still being
        // released survives its sweep and leaves when it is due; a sweep walks the queue
        // under the lock, so its cost per hold stays constant only on average.
        let left = self.left.load(Ordering::Relaxed);
        if left >= SWEEP_AFTER && left * 2 >= state.due.len() {
            self.left.fetch_sub(left, Ordering::Relaxed);
            state.due.retain(|entry| entry.hold.strong_count() > 0);
        }
        let entry = Due { due, hold };
        if state.due.back().is_none_or(|last| last.due <= due) {
            state.due.push_back(entry);
        } else {
            // Holds taken at once can answer out of order; the few that do are sorted in.
            let at = state.due.partition_point(|entry| entry.due <= due);
            state.due.insert(at, entry);
        }
        // The driver is woken only when it would otherwise oversleep this entry. It keeps its
        // wake-up time when the entries it slept for leave, so in a stream of short holds it
        // wakes about once per keeper delay, not once per hold.
        let oversleeps = state.driver_wakes_at.is_none_or(|at| due < at);
        let start_driver = !state.driver_running;
        state.driver_running = true;
        if oversleeps {
            state.driver_wakes_at = Some(due);
        }
        drop(state);
        if start_driver {
            // The guard is made here, not in the task: a task dropped before it first runs
            // (its runtime shutting down) must still mark the driver gone, or no keeper would
            // ever start again.
            runtime.spawn(drive(DriverRunning(self.clone())));
        } else if oversleeps {
            self.wake.notify_one();
        }
    }

    /// Notes that a scheduled hold ended before its keeper was due. Its entry is not looked
    /// up: the keeper will not start for an ended hold, and the entry leaves when it is due or
    /// at the next sweep. This keeps a short hold's end free of the schedule's lock.
    pub(crate) fn left(&self) {
        self.left.fetch_add(1, Ordering::Relaxed);
    }

    /// Starts the keeper of every hold still waiting for one, now: at shutdown, each keeper
    /// gives its lock up.
    pub(crate) fn start_all(&self) {
        let due: Vec<Due> = self.state().due.drain(..).collect();
        for entry in due {
            if let Some(hold) = entry.hold.upgrade() {
                hold.start_keeper();
            }
        }
    }

    /// Stops the driver; used when the engine goes away.
    pub(crate) fn close(&self) {
        let mut state = self.state();
        state.closed = true;
        state.due.clear();
        drop(state);
        self.wake.notify_one();
    }

    /// How many entries wait in the schedule, ended holds included (for tests).
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.state().due.len()
    }

    /// How many times the driver has looked at the queue (for tests).
    #[cfg(test)]
    pub(crate) fn wakeups(&self) -> usize {
        self.wakeups.load(Ordering::Relaxed)
    }
}

/// Marks the driver as gone when its task ends or is dropped with its runtime, so the next
/// hold starts a new driver on a live runtime.
struct DriverRunning(Arc<RenewalScheduler>);

impl Drop for DriverRunning {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.driver_running = false;
        state.driver_wakes_at = None;
    }
}

async fn drive(running: DriverRunning) {
    let scheduler = &running.0;
    loop {
        #[cfg(test)]
        scheduler.wakeups.fetch_add(1, Ordering::Relaxed);
        let (ready, next) = {
            let mut state = scheduler.state();
            if state.closed {
                return;
            }
            let now = Instant::now();
            let mut ready = Vec::new();
            while let Some(entry) = state.due.front() {
                if entry.due <= now {
                    if let Some(hold) = entry.hold.upgrade() {
                        ready.push(hold);
                    }
                } else if entry.hold.strong_count() > 0 {
                    break;
                }
                // Due, or an ended hold at the front: either way it leaves now, so the driver
                // plans its next wake-up for a hold that still needs it.
                state.due.pop_front();
            }
            // A wake-up planned for entries that have left since is kept: forgetting it would
            // make the next hold wake the driver again, once per hold.
            let first = state.due.front().map(|entry| entry.due);
            let planned = state.driver_wakes_at.filter(|at| *at > now);
            let next = match (first, planned) {
                (Some(first), Some(planned)) => Some(first.min(planned)),
                (first, planned) => first.or(planned),
            };
            state.driver_wakes_at = next;
            (ready, next)
        };
        for held in ready {
            held.start_keeper();
        }
        match next {
            None => scheduler.wake.notified().await,
            Some(at) => {
                tokio::select! {
                    _ = sleep_until(at) => {}
                    _ = scheduler.wake.notified() => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    struct Counted(Arc<AtomicUsize>);

    impl StartKeeper for Counted {
        fn start_keeper(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A scheduler, and a count of the keepers it started.
    struct Fixture {
        scheduler: Arc<RenewalScheduler>,
        started: Arc<AtomicUsize>,
        start: Instant,
    }

    impl Fixture {
        fn new() -> Self {
            Fixture {
                scheduler: Arc::new(RenewalScheduler::default()),
                started: Arc::new(AtomicUsize::new(0)),
                start: Instant::now(),
            }
        }

        /// Enters a hold due `secs` after the fixture was made, on the current runtime. The
        /// hold lives as long as the returned value, as a `Held` lives with its handle.
        fn hold_due_in(&self, secs: u64) -> Arc<dyn StartKeeper> {
            let due = self.start + Duration::from_secs(secs);
            self.hold_on(&Handle::current(), due)
        }

        fn hold_on(&self, runtime: &Handle, due: Instant) -> Arc<dyn StartKeeper> {
            let hold: Arc<dyn StartKeeper> = Arc::new(Counted(self.started.clone()));
            self.scheduler.schedule(runtime, due, Arc::downgrade(&hold));
            hold
        }

        /// Ends a hold the way a released `Held` does: it leaves, and its last reference goes.
        fn end(&self, hold: Arc<dyn StartKeeper>) {
            drop(hold);
            self.scheduler.left();
        }

        fn started(&self) -> usize {
            self.started.load(Ordering::SeqCst)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn starts_keepers_when_due_and_never_for_ended_holds() {
        let f = Fixture::new();
        let _kept = f.hold_due_in(10);
        f.end(f.hold_due_in(5));

        tokio::time::sleep(Duration::from_secs(9)).await;
        assert_eq!(f.started(), 0);
        assert_eq!(
            f.scheduler.pending(),
            1,
            "the ended hold left when it came to the front"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(f.started(), 1);
        assert_eq!(f.scheduler.pending(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_earlier_entry_wakes_the_driver() {
        let f = Fixture::new();
        let _late = f.hold_due_in(100);
        tokio::task::yield_now().await;
        let _early = f.hold_due_in(1);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(f.started(), 1);
        assert_eq!(f.scheduler.pending(), 1, "the later hold still waits");
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_entry_is_started_by_the_wake_up_the_driver_already_planned() {
        let f = Fixture::new();
        let first = f.hold_due_in(10);
        tokio::task::yield_now().await;
        f.end(first);
        // Due after the driver's planned wake-up, so it is entered without waking the driver;
        // the planned wake-up must still lead to it.
        let _second = f.hold_due_in(12);
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert_eq!(f.started(), 0);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(f.started(), 1);
        assert_eq!(f.scheduler.pending(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn ended_holds_far_from_due_are_swept_so_memory_stays_bounded() {
        let f = Fixture::new();
        let _live = f.hold_due_in(3600);
        for _ in 0..3 * SWEEP_AFTER {
            f.end(f.hold_due_in(3600));
        }
        assert!(
            f.scheduler.pending() <= SWEEP_AFTER + 2,
            "{} entries kept for one live hold",
            f.scheduler.pending()
        );
        tokio::time::sleep(Duration::from_secs(3601)).await;
        assert_eq!(f.started(), 1, "the live hold's keeper starts");
        assert_eq!(f.scheduler.pending(), 0);
    }

    #[test]
    fn a_driver_dropped_before_it_ran_is_replaced_on_the_next_hold() {
        let f = Fixture::new();
        let gone = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let due = f.start + Duration::from_millis(50);
        let _first = f.hold_on(gone.handle(), due);
        // Shutting the runtime down drops its driver task before the task ever ran.
        drop(gone);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let _second = f.hold_on(&Handle::current(), due);
            tokio::time::sleep_until(due + Duration::from_millis(50)).await;
            assert_eq!(f.started(), 2, "a new driver starts both keepers");
        });
    }

    #[tokio::test(start_paused = true)]
    async fn holds_that_answer_out_of_order_start_in_due_order() {
        let f = Fixture::new();
        let _later = f.hold_due_in(20);
        let _sooner = f.hold_due_in(10);
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert_eq!(f.started(), 1);
        assert_eq!(f.scheduler.pending(), 1);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(f.started(), 2);
    }

    /// Lets the driver do all it can without time passing.
    async fn settle() {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_of_short_holds_wakes_the_driver_about_once_per_keeper_delay() {
        let f = Fixture::new();
        let keeper_delay = Duration::from_secs(10);
        let short_hold = || f.end(f.hold_on(&Handle::current(), Instant::now() + keeper_delay));
        // A hundred holds at one instant (all due together), then a thousand a millisecond
        // apart; each ends before its keeper is due, and the driver runs after each.
        for _ in 0..100 {
            short_hold();
            settle().await;
        }
        for _ in 0..1000 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            short_hold();
            settle().await;
        }
        tokio::time::sleep(keeper_delay * 2).await;
        assert_eq!(f.started(), 0);
        assert_eq!(f.scheduler.pending(), 0);
        // Started once, and woken once when the first hold's keeper was due: 1,100 holds over
        // 21 s, at most one wake-up per keeper delay.
        assert!(
            f.scheduler.wakeups() <= 3,
            "the driver woke {} times",
            f.scheduler.wakeups()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ended_holds_behind_a_due_one_leave_with_it() {
        let f = Fixture::new();
        let _first = f.hold_due_in(5);
        f.end(f.hold_due_in(10));
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(f.started(), 1);
        assert_eq!(
            f.scheduler.pending(),
            0,
            "the ended hold left when the driver passed it, not at its own due time"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_few_ended_holds_are_not_worth_a_sweep() {
        let f = Fixture::new();
        let _live = f.hold_due_in(3600);
        for _ in 0..10 {
            f.end(f.hold_due_in(3600));
        }
        let _last = f.hold_due_in(3600);
        assert_eq!(
            f.scheduler.pending(),
            12,
            "ten ended holds wait to be due; a sweep walks the whole queue"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ended_holds_are_swept_once_they_outnumber_the_live_ones() {
        let f = Fixture::new();
        let live: Vec<_> = (0..1500).map(|_| f.hold_due_in(3600)).collect();
        let mut most = 0;
        for _ in 0..4000 {
            f.end(f.hold_due_in(3600));
            most = most.max(f.scheduler.pending());
        }
        assert!(
            most <= 2 * live.len() + 1,
            "{most} entries kept for {} live holds",
            live.len()
        );
        tokio::time::sleep(Duration::from_secs(3601)).await;
        assert_eq!(f.started(), live.len(), "every live hold's keeper starts");
    }
}
