//! The renewal scheduler: starts a keeper task only for locks held long enough to need one.
//!
//! Most locks are released well before their first renewal is due (a third of the lease by
//! default). Spawning a task and arming timers for each of them would cost more than the rest
//! of the acquire path together. Instead every new hold is entered here with the instant its
//! first renewal or check is due; one driver task per engine sleeps until the earliest entry and
//! starts that lock's keeper. A hold that ends before then leaves the schedule again and never
//! costs a task.
//!
//! The keeper, once started, enforces the loss deadline from the acquire's send time, so a
//! driver that runs late (a starved runtime) can delay renewal but never postpone loss:
//! `LockHandle::is_held` checks the deadline itself, and a late keeper finds it passed at once.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::{sleep_until, Instant};

/// A held lock whose keeper can be started.
pub(crate) trait Keep: Send + Sync {
    /// Spawns the lock's keeper task on `runtime`.
    fn start_keeper(self: Arc<Self>, runtime: &Handle);
}

/// Where a hold sits in the schedule: when its keeper is due, and a tie-breaking id.
pub(crate) type ScheduleKey = (Instant, u64);

#[derive(Default)]
pub(crate) struct RenewalScheduler {
    state: Mutex<State>,
    next_id: AtomicU64,
    wake: Notify,
}

#[derive(Default)]
struct State {
    due: BTreeMap<ScheduleKey, Arc<dyn Keep>>,
    driver_running: bool,
    /// When the driver will wake on its own; `None` while it waits for a notification.
    driver_wakes_at: Option<Instant>,
    closed: bool,
}

impl RenewalScheduler {
    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the map consistent, so poisoning carries no meaning.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A key for a hold whose keeper is due at `at`.
    pub(crate) fn key(&self, at: Instant) -> ScheduleKey {
        (at, self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Enters a hold; its keeper starts at `key.0` unless [`cancel`](Self::cancel) comes first.
    pub(crate) fn schedule(
        self: &Arc<Self>,
        runtime: &Handle,
        key: ScheduleKey,
        held: Arc<dyn Keep>,
    ) {
        let mut state = self.state();
        if state.closed {
            return;
        }
        // The driver is woken only when it would otherwise oversleep this entry. It keeps its
        // wake-up time when the entries it slept for leave, so in a stream of short holds it
        // wakes about once per keeper delay, not once per hold.
        let oversleeps = state.driver_wakes_at.is_none_or(|at| key.0 < at);
        state.due.insert(key, held);
        let start_driver = !state.driver_running;
        state.driver_running = true;
        if oversleeps {
            state.driver_wakes_at = Some(key.0);
        }
        drop(state);
        if start_driver {
            runtime.spawn(drive(self.clone()));
        } else if oversleeps {
            self.wake.notify_one();
        }
    }

    /// Takes a hold out of the schedule; `true` if its keeper had not been started.
    pub(crate) fn cancel(&self, key: &ScheduleKey) -> bool {
        self.state().due.remove(key).is_some()
    }

    /// Stops the driver; used when the engine goes away.
    pub(crate) fn close(&self) {
        let mut state = self.state();
        state.closed = true;
        state.due.clear();
        drop(state);
        self.wake.notify_one();
    }

    /// How many holds wait for their keeper (for tests).
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.state().due.len()
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

async fn drive(scheduler: Arc<RenewalScheduler>) {
    let running = DriverRunning(scheduler);
    let scheduler = &running.0;
    let runtime = Handle::current();
    loop {
        let (ready, next) = {
            let mut state = scheduler.state();
            if state.closed {
                return;
            }
            let now = Instant::now();
            let mut ready = Vec::new();
            while let Some(entry) = state.due.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                ready.push(entry.remove());
            }
            // A wake-up planned for entries that have left since is kept: forgetting it would
            // make the next hold wake the driver again, once per hold.
            let first = state.due.first_key_value().map(|(key, _)| key.0);
            let planned = state.driver_wakes_at.filter(|at| *at > now);
            let next = match (first, planned) {
                (Some(first), Some(planned)) => Some(first.min(planned)),
                (first, planned) => first.or(planned),
            };
            state.driver_wakes_at = next;
            (ready, next)
        };
        for held in ready {
            held.start_keeper(&runtime);
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

    impl Keep for Counted {
        fn start_keeper(self: Arc<Self>, _runtime: &Handle) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn starts_keepers_when_due_and_never_for_cancelled_holds() {
        let scheduler = Arc::new(RenewalScheduler::default());
        let started = Arc::new(AtomicUsize::new(0));
        let runtime = Handle::current();
        let now = Instant::now();
        let kept = scheduler.key(now + Duration::from_secs(10));
        let released = scheduler.key(now + Duration::from_secs(5));
        scheduler.schedule(&runtime, kept, Arc::new(Counted(started.clone())));
        scheduler.schedule(&runtime, released, Arc::new(Counted(started.clone())));
        assert!(scheduler.cancel(&released));

        tokio::time::sleep(Duration::from_secs(9)).await;
        assert_eq!(started.load(Ordering::SeqCst), 0);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(started.load(Ordering::SeqCst), 1);
        assert_eq!(scheduler.pending(), 0);
        assert!(
            !scheduler.cancel(&kept),
            "a started keeper is no longer scheduled"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_earlier_entry_wakes_the_driver() {
        let scheduler = Arc::new(RenewalScheduler::default());
        let started = Arc::new(AtomicUsize::new(0));
        let runtime = Handle::current();
        let now = Instant::now();
        scheduler.schedule(
            &runtime,
            scheduler.key(now + Duration::from_secs(100)),
            Arc::new(Counted(started.clone())),
        );
        tokio::task::yield_now().await;
        scheduler.schedule(
            &runtime,
            scheduler.key(now + Duration::from_secs(1)),
            Arc::new(Counted(started.clone())),
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(started.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_entry_is_started_by_the_wake_up_the_driver_already_planned() {
        let scheduler = Arc::new(RenewalScheduler::default());
        let started = Arc::new(AtomicUsize::new(0));
        let runtime = Handle::current();
        let now = Instant::now();
        let first = scheduler.key(now + Duration::from_secs(10));
        scheduler.schedule(&runtime, first, Arc::new(Counted(started.clone())));
        tokio::task::yield_now().await;
        assert!(scheduler.cancel(&first));
        // Due after the driver's planned wake-up, so it is entered without waking the driver;
        // the planned wake-up must still lead to it.
        scheduler.schedule(
            &runtime,
            scheduler.key(now + Duration::from_secs(12)),
            Arc::new(Counted(started.clone())),
        );
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert_eq!(started.load(Ordering::SeqCst), 0);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(started.load(Ordering::SeqCst), 1);
        assert_eq!(scheduler.pending(), 0);
    }
}
