//! The keeper task of a held lock: renews or checks it, and enforces the loss deadline. A hold
//! is entered in the renewal schedule when it is made; its keeper starts from there when the
//! first renewal is due, unless the hold ended before.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep_until, Instant};

use crate::clock::after;

use super::schedule::StartKeeper;
use super::{deadline_after, loss_deadline, Hold, HELD};
use crate::backend::{BackendErrorKind, LeaseTiming, LockBackend};
use crate::backoff::Backoff;
use crate::telemetry::LossReason;

impl<B: LockBackend> Hold<B> {
    /// Enters the hold in the renewal schedule; its keeper starts when the first renewal is due.
    pub(in crate::engine) fn schedule(self: &Arc<Self>) {
        let hold: std::sync::Weak<dyn StartKeeper> = Arc::downgrade(self) as _;
        self.engine.scheduler.schedule(
            &self.runtime,
            after(self.origin, self.engine.keeper_starts_after()),
            hold,
        );
    }
}

impl<B: LockBackend> StartKeeper for Hold<B> {
    fn start_keeper(self: Arc<Self>) {
        if self.state.load(Ordering::Acquire) != HELD {
            return;
        }
        let sent = self.origin;
        let runtime = self.runtime.clone();
        runtime.spawn(run_keeper(self, sent));
    }
}

enum Exit {
    /// Released or dropped: the lost token fired, and whoever did it releases.
    Stopped,
    Lost(LossReason),
    /// The engine is shutting down: the keeper gives the lock up.
    Shutdown,
}

/// Keeps `held` alive until it is released, dropped or lost. `sent` is when the acquiring
/// request was sent.
async fn run_keeper<B: LockBackend>(held: Arc<Hold<B>>, sent: Instant) {
    let exit = match held.engine.timing {
        LeaseTiming::Expiring(lease) => renew_expiring(&held, lease, sent).await,
        LeaseTiming::ConnectionHeld(interval) => check_connection(&held, interval, sent).await,
    };
    match exit {
        // A stopped keeper has nothing left to do: release() or drop released the lock.
        Exit::Stopped => {}
        Exit::Lost(reason) => held.declare_lost(reason).await,
        Exit::Shutdown => held.release_at_shutdown().await,
    }
}

/// Renews every `renew_every` (a third of the lease by default). The deadline timer is raced
/// against every wait *and* every renewal, so a renewal that never answers cannot postpone it.
async fn renew_expiring<B: LockBackend>(held: &Hold<B>, lease: Duration, sent: Instant) -> Exit {
    let engine = &held.engine;
    let every = engine.options.renew_every.unwrap_or(lease / 3);
    let mut deadline = loss_deadline(sent, lease);
    let mut next = after(sent, every);
    let mut retry = Backoff::new(
        engine.options.min_retry_delay,
        engine.options.max_retry_delay,
    );
    // A backend that watches its leases says at once when one is taken away.
    let ended = engine.backend.lease_ended(&held.lease);
    tokio::pin!(ended);
    loop {
        tokio::select! {
            biased;
            _ = held.lost_signal().cancelled() => return Exit::Stopped,
            _ = held.engine.closed.cancelled() => return Exit::Shutdown,
            _ = &mut ended => return Exit::Lost(LossReason::LeaseGone),
            _ = sleep_until(deadline) => return Exit::Lost(LossReason::Deadline),
            _ = sleep_until(next) => {}
        }
        let sent = Instant::now();
        let result = tokio::select! {
            biased;
            _ = held.lost_signal().cancelled() => return Exit::Stopped,
            _ = &mut ended => return Exit::Lost(LossReason::LeaseGone),
            _ = sleep_until(deadline) => {
                // The renewal in flight never answered: it failed, as a timed-out check does.
                engine.telemetry.renewal(false);
                return Exit::Lost(LossReason::Deadline);
            }
            result = engine.backend.renew(&held.lease) => result,
        };
        match result {
            Ok(()) => {
                engine.telemetry.renewal(true);
                deadline = loss_deadline(sent, lease);
                held.set_deadline(deadline);
                next = after(sent, every);
                retry.reset();
            }
            Err(error) if error.kind() == BackendErrorKind::LeaseGone => {
                engine.telemetry.renewal(false);
                return Exit::Lost(LossReason::LeaseGone);
            }
            Err(error) => {
                engine.telemetry.renewal(false);
                tracing::debug!(target: "lockingkit", %error, "lease renewal failed; retrying until the deadline");
                next = crate::clock::in_(retry.next_delay());
            }
        }
    }
}

/// Checks the held connection every `interval`; a check that fails or takes longer than the
/// interval is loss.
async fn check_connection<B: LockBackend>(
    held: &Hold<B>,
    interval: Duration,
    sent: Instant,
) -> Exit {
    let engine = &held.engine;
    let ended = engine.backend.lease_ended(&held.lease);
    tokio::pin!(ended);
    // Checks are scheduled from the acquire's send time, not from when this task started.
    let mut next = after(sent, interval);
    loop {
        tokio::select! {
            biased;
            _ = held.lost_signal().cancelled() => return Exit::Stopped,
            _ = held.engine.closed.cancelled() => return Exit::Shutdown,
            _ = &mut ended => return Exit::Lost(LossReason::ConnectionLost),
            _ = sleep_until(next) => {}
        }
        let sent = Instant::now();
        next = after(sent, interval);
        let result = tokio::select! {
            biased;
            _ = held.lost_signal().cancelled() => return Exit::Stopped,
            _ = &mut ended => return Exit::Lost(LossReason::ConnectionLost),
            result = tokio::time::timeout(interval, engine.backend.renew(&held.lease)) => result,
        };
        match result {
            Ok(Ok(())) => {
                engine.telemetry.renewal(true);
                held.set_deadline(deadline_after(engine.timing, sent));
            }
            Ok(Err(error)) => {
                engine.telemetry.renewal(false);
                tracing::debug!(target: "lockingkit", %error, "connection check failed");
                return Exit::Lost(LossReason::ConnectionLost);
            }
            Err(_) => {
                engine.telemetry.renewal(false);
                return Exit::Lost(LossReason::ConnectionLost);
            }
        }
    }
}
